"""The endpoint tests' shared server: the tiny model (2 slots of 1,024 tokens) served with an
API key, one per test module (``served``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llamabatch import LLM, testing
from llamabatch.gguf.testing import model_path


@dataclass(frozen=True)
class Served:
    """A running server: its engine, base URL and key; ``post`` sends the key."""

    llm: LLM
    url: str
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def post(self, path: str, body: Any) -> Any:
        import httpx

        return httpx.post(f"{self.url}{path}", json=body, headers=self.auth, timeout=60)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import serve

    from llamabatch.server import create_app

    with LLM(model_path("tiny"), n_ctx=2048, n_parallel=2, n_threads=1) as llm:
        with serve(create_app(llm, model_name="tiny", api_key="sk-tiny")) as url:
            yield Served(llm, url, "sk-tiny")


@pytest.fixture(scope="module")
def tiny_qwen_llm(tmp_path_factory) -> Iterator[LLM]:
    """The tiny model carrying Qwen 2.5's real chat template (its tool calls are read: the
    Hermes format is detected), 2 slots of 2,048 tokens."""
    template = (
        Path(__file__).parents[1] / "data" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    ).read_text()
    path = tmp_path_factory.mktemp("qwen-template") / "tiny-qwen.gguf"
    testing.write_llama_gguf(path, testing.PRESETS["tiny"], chat_template=template)
    with LLM(path, n_ctx=4096, n_parallel=2, n_threads=1) as llm:
        yield llm
