"""A client's ``chat_template_kwargs`` cannot switch off the template's own checks: a key
that would replace one of its globals (``raise_exception``, ``namespace``) is refused, and a
request the template fails to render is an error naming the field, never a silent fall back
to llama.cpp's built-in template (which has none of the template's checks)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from llamabatch import LLM, testing
from llamabatch._ffi.model import Model
from llamabatch.prompts.chat_template import ChatTemplateError, render_chat

# Mistral-style: strict alternation enforced with raise_exception (llama.cpp knows [INST]).
MISTRAL = (
    "{% set ns = namespace(turns=0) %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set ns.turns = ns.turns + 1 %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)
# ChatML (llama.cpp knows it by its markers) that does arithmetic on a client's variable.
CHATML_DEPTH = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if depth is defined %}{{ depth + 1 }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NOT_ALTERNATING = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
ALTERNATING = [{"role": "user", "content": "a"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Iterator[Model]:
    path = tmp_path_factory.mktemp("kwargs") / "mistral.gguf"
    testing.write_llama_gguf(path, testing.PRESETS["tiny"], chat_template=MISTRAL)
    with Model(path, vocab_only=True) as model:
        yield model


@pytest.mark.parametrize("key", ["raise_exception", "namespace", "range", "strftime_now"])
def test_kwargs_cannot_shadow_the_templates_globals(model, key):
    with pytest.raises(ChatTemplateError, match=f"chat_template_kwargs.{key}") as info:
        render_chat(model, NOT_ALTERNATING, chat_template_kwargs={key: 0})
    assert info.value.param == "chat_template_kwargs"
    with pytest.raises(ChatTemplateError, match=f"chat_template_kwargs.{key}"):  # even on good messages
        render_chat(model, ALTERNATING, chat_template_kwargs={key: 0})


def test_the_templates_own_check_still_fires(model):
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(model, NOT_ALTERNATING, chat_template_kwargs={"enable_thinking": False})
    assert render_chat(model, ALTERNATING, chat_template_kwargs={"enable_thinking": False}).startswith(
        "<s>[INST] a [/INST]"
    )


def test_a_render_error_names_the_kwargs_and_does_not_fall_back(model):
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs") as info:
        render_chat(model, ALTERNATING, chat_template=CHATML_DEPTH, chat_template_kwargs={"depth": "x"})
    assert info.value.param == "chat_template_kwargs"
    assert render_chat(model, ALTERNATING, chat_template=CHATML_DEPTH, chat_template_kwargs={"depth": 1})
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs must be an object"):
        render_chat(model, ALTERNATING, chat_template_kwargs=["depth"])  # type: ignore[arg-type]


def test_the_fall_back_is_decided_per_template():
    from llamabatch.prompts.chat_template import jinja_render_error

    assert jinja_render_error(MISTRAL) is None
    assert jinja_render_error(CHATML_DEPTH) is None
    assert jinja_render_error("{% if %}<|im_start|>") is not None


def test_llm_chat_refuses_shadowing_kwargs():
    with LLM(testing.model_path("tiny"), n_ctx=256, n_parallel=1, n_threads=1) as llm:
        with pytest.raises(ValueError, match=r"chat_template_kwargs\.raise_exception"):
            llm.chat(NOT_ALTERNATING, chat_template=MISTRAL, chat_template_kwargs={"raise_exception": 0})


def test_server_answers_400_naming_chat_template_kwargs():
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamabatch.server import create_app
    from llamabatch.server.limits import ServerLimits

    limits = ServerLimits(allowed_hosts=("testserver",))
    with (
        LLM(testing.model_path("tiny"), n_ctx=256, n_parallel=1, n_threads=1) as llm,
        TestClient(create_app(llm, chat_template=MISTRAL, limits=limits)) as client,
    ):
        for kwargs, param, words in [
            ({"raise_exception": 0}, "chat_template_kwargs", "raise_exception"),
            ({"namespace": 0}, "chat_template_kwargs", "namespace"),
            ({}, "messages", "roles must alternate"),
        ]:
            body = {"messages": NOT_ALTERNATING, "max_tokens": 1, "chat_template_kwargs": kwargs}
            response = client.post(
                "/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"}
            )
            error = response.json()["error"]
            assert response.status_code == 400, response.text
            assert error["param"] == param and words in error["message"]
