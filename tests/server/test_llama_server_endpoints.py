"""llama-server's own endpoints beside the OpenAI ones: ``/apply-template`` (the prompt a chat
request renders to) and ``GET /props`` (the server's context, slots, template and defaults)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import model_path

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from test_server import serve  # noqa: E402 (after the skips: it needs the server extra)

from llamabatch.server import create_app  # noqa: E402

KEY = "sk-props"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model_path("tiny"), n_ctx=2048, n_parallel=2, n_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def base_url(llm) -> Iterator[str]:
    with serve(create_app(llm, model_name="tiny", api_key=KEY)) as url:
        yield url


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})


def test_apply_template_renders_what_chat_completions_would(base_url, llm):
    response = _post(f"{base_url}/apply-template", {"messages": MESSAGES, "max_tokens": 5})
    assert response.status_code == 200
    assert response.json() == {"prompt": llm.apply_chat_template(MESSAGES)}
    # the same prompt the chat endpoint runs: its token count is the chat's prompt_tokens
    chat = _post(f"{base_url}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(llm.tokenize(response.json()["prompt"], parse_special=True))
    bare = _post(f"{base_url}/apply-template", {"messages": MESSAGES, "add_generation_prompt": False})
    assert not bare.json()["prompt"].endswith("<|im_start|>assistant\n")


def test_apply_template_refuses_bad_messages_naming_them(base_url):
    for body in ({}, {"messages": "hi"}, {"messages": []}, {"messages": [{"role": "user", "content": 5}]}):
        response = _post(f"{base_url}/apply-template", body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == "messages"
    assert httpx.post(f"{base_url}/apply-template", json={"messages": MESSAGES}).status_code == 401


def test_props_tell_the_context_slots_and_template(base_url, llm):
    response = httpx.get(f"{base_url}/props", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    props = response.json()
    assert props["default_generation_settings"]["n_ctx"] == llm.n_ctx_seq
    assert props["default_generation_settings"]["params"]["temperature"] == SamplingParams().temperature
    assert props["total_slots"] == 2 and props["model_alias"] == "tiny"
    assert props["model_path"] == model_path("tiny").name  # the file's name, never its directory
    assert props["chat_template"] == llm.model.chat_template
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["bos_token"] == llm.model.token_text(llm.model.bos)
    assert httpx.get(f"{base_url}/props").status_code == 401
