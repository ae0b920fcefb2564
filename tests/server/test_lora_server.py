"""LoRA adapters over HTTP: ``"model": name`` (vLLM) and ``"lora": [{"id", "scale"}]``
(llama-server) select them, ``/v1/models`` lists them, bad entries are 400s naming ``lora``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("uvicorn")

from test_server import serve

from llamabatch import LLM, SamplingParams
from llamabatch.server import create_app
from llamabatch.testing import make_lora, model_path

PROMPT = "The cat sat on"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    tiny = model_path("tiny")
    d = tmp_path_factory.mktemp("lora")
    adapters = {
        "a": make_lora(tiny, d / "a.gguf", rank=4, seed=1),
        "b": make_lora(tiny, d / "b.gguf", rank=4, seed=2),
    }
    with LLM(tiny, lora_adapters=adapters, n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def url(llm: LLM) -> Iterator[str]:
    with serve(create_app(llm, model_name="tiny")) as url:
        yield url


def _expected(llm: LLM, lora: object) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, lora=lora)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def _complete(url: str, **fields: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_model_name_and_lora_field_select_adapters(llm: LLM, url: str) -> None:
    base, a, b = _expected(llm, ()), _expected(llm, "a"), _expected(llm, "b")
    assert len({base, a, b}) == 3
    assert _complete(url).json()["choices"][0]["text"] == base
    assert _complete(url, model="a").json()["choices"][0]["text"] == a
    assert _complete(url, lora=[{"id": 1, "scale": 1.0}]).json()["choices"][0]["text"] == b
    assert _complete(url, model="a", lora=[{"id": 0, "scale": 0}]).json()["choices"][0]["text"] == base
    mixed = _complete(url, lora=[{"id": 0, "scale": 0.5}, {"id": 1}]).json()["choices"][0]["text"]
    assert mixed == _expected(llm, {"a": 0.5, "b": 1.0})
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "b",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=60,
    )
    assert chat.status_code == 200


def test_models_lists_adapters(url: str) -> None:
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert ids == ["tiny", "a", "b"]


@pytest.mark.parametrize(
    "lora",
    [
        [{"id": 2}],
        [{"id": -1}],
        [{"id": "a"}],
        [{"id": 0, "scale": "x"}],
        [{"id": 0, "extra": 1}],
        ["a"],
        [{"id": True}],
    ],
)
def test_bad_lora_entries_are_400s(url: str, lora: object) -> None:
    response = _complete(url, lora=lora)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "lora"


def test_adapter_failing_to_load_is_a_server_error_naming_it(
    llm: LLM, url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    broken = tmp_path_factory.mktemp("broken") / "broken.gguf"
    broken.write_bytes(make_lora(model_path("tiny"), broken, rank=4, seed=3).read_bytes())
    llm.load_lora("broken", broken)
    try:
        broken.write_bytes(b"GGUF" + b"\0" * 40)  # replaced after it was checked: the load fails
        response = _complete(url, model="broken")
        assert response.status_code == 500, response.text
        assert "'broken'" in response.json()["error"]["message"]
    finally:
        llm.unload_lora("broken")
    assert _complete(url).status_code == 200


def test_bare_file_adapters_apply_to_every_request_that_selects_none(llm: LLM) -> None:
    # llama-server applies --lora FILE adapters to every request at scale 1
    base, a = _expected(llm, ()), _expected(llm, "a")
    with serve(create_app(llm, model_name="tiny", lora_applied=["a"])) as applied_url:
        assert _complete(applied_url).json()["choices"][0]["text"] == a
        assert _complete(applied_url, model="a").json()["choices"][0]["text"] == a
        assert _complete(applied_url, lora=[]).json()["choices"][0]["text"] == base
        assert _complete(applied_url, lora=[{"id": 0, "scale": 0.0}]).json()["choices"][0]["text"] == base
        assert _complete(applied_url, model="b").json()["choices"][0]["text"] == _expected(llm, "b")
    with pytest.raises(ValueError, match=r"lora_applied.*'zzz'"):
        create_app(llm, model_name="tiny", lora_applied=["zzz"])


@pytest.mark.parametrize(
    ("argv", "applied"),
    [
        (["--lora", "x/sql.gguf", "--lora", "chat=c.gguf"], ("sql",)),
        (["--lora", "x/sql.gguf", "--lora", "y/more.gguf"], ("sql", "more")),
        (["--lora", "x/sql.gguf", "--lora-init-without-apply"], ()),
        (["--lora", "chat=c.gguf"], ()),
        ([], ()),
    ],
)
def test_serve_applies_bare_file_adapters_unless_init_without_apply(
    argv: list[str], applied: tuple[str, ...]
) -> None:
    import argparse

    from llamabatch.server.cli import add_arguments
    from llamabatch.server.lora import applied_adapters

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["-m", "model.gguf", *argv])
    assert applied_adapters(args.lora_adapters, args.lora_init_without_apply) == applied
