"""``--merge-lora`` over HTTP: the merged adapter is the served model; asking for another
adapter or scale is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

from test_server import serve

from llamabatch import LLM, SamplingParams
from llamabatch.server import create_app
from llamabatch.testing import make_lora, model_path

PROMPT = "The cat sat on"


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, str]]:
    tiny = model_path("tiny")
    d = tmp_path_factory.mktemp("merge")
    adapter = make_lora(tiny, d / "a.gguf", rank=4, seed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(d / "cache"))
        llm = LLM(tiny, lora_adapters={"a": adapter}, merge_lora=True, n_ctx=512, n_threads=1)
    with llm, serve(create_app(llm, model_name="tiny")) as url:
        yield llm, url


def _complete(url: str, **fields: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_merged_adapter_is_the_served_model(merged: tuple[LLM, str]) -> None:
    llm, url = merged
    want = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    text = want[0].outputs[0].text
    assert _complete(url).json()["choices"][0]["text"] == text
    assert _complete(url, model="a").json()["choices"][0]["text"] == text
    assert _complete(url, lora=[{"id": 0, "scale": 1.0}]).json()["choices"][0]["text"] == text
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert ids == ["tiny", "a"]
    response = _complete(url, lora=[{"id": 0, "scale": 0.5}])
    assert response.status_code == 400, response.text
    assert "merged into the weights at scale 1" in response.json()["error"]["message"]
    assert Path(llm.lora_adapters()["a"]).name == "a.gguf"
