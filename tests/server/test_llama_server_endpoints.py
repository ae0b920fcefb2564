"""llama-server's own endpoints beside the OpenAI ones: ``/apply-template`` (the prompt a chat
request renders to) and ``GET /props`` (the server's context, slots, template and defaults)."""

from __future__ import annotations

import pytest

from llamabatch import SamplingParams
from llamabatch.gguf.testing import model_path

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_apply_template_renders_what_chat_completions_would(served):
    response = served.post("/apply-template", {"messages": MESSAGES, "max_tokens": 5})
    assert response.status_code == 200
    assert response.json() == {"prompt": served.llm.apply_chat_template(MESSAGES)}
    # the same prompt the chat endpoint runs: its token count is the chat's prompt_tokens
    chat = served.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(
        served.llm.tokenize(response.json()["prompt"], parse_special=True)
    )
    bare = served.post("/apply-template", {"messages": MESSAGES, "add_generation_prompt": False})
    assert not bare.json()["prompt"].endswith("<|im_start|>assistant\n")


def test_apply_template_refuses_bad_messages_naming_them(served):
    for body in ({}, {"messages": "hi"}, {"messages": []}, {"messages": [{"role": "user", "content": 5}]}):
        response = served.post("/apply-template", body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == "messages"
    assert httpx.post(f"{served.url}/apply-template", json={"messages": MESSAGES}).status_code == 401


def test_props_tell_the_context_slots_and_template(served):
    response = httpx.get(f"{served.url}/props", headers=served.auth)
    assert response.status_code == 200
    props = response.json()
    assert props["default_generation_settings"]["n_ctx"] == served.llm.n_ctx_seq
    assert props["default_generation_settings"]["params"]["temperature"] == SamplingParams().temperature
    assert props["total_slots"] == 2 and props["model_alias"] == "tiny"
    assert props["model_path"] == model_path("tiny").name  # the file's name, never its directory
    assert props["chat_template"] == served.llm.model.chat_template
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["bos_token"] == served.llm.model.token_text(served.llm.model.bos)
    assert httpx.get(f"{served.url}/props").status_code == 401
