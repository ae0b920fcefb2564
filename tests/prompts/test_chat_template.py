"""Chat templates: the Jinja rendering equals HF transformers' ``apply_chat_template``.

Each template is written into a real GGUF (the tiny random-weight model) and read back by
llama.cpp, so the test covers the whole path: GGUF metadata -> ``Model.chat_template`` ->
sandboxed Jinja. The reference is a ``PreTrainedTokenizerFast`` with the same template and
special tokens (built from a tiny ``tokenizers`` object: no download, no torch).
"""

from __future__ import annotations

import logging

import pytest

from llamabatch import testing
from llamabatch._ffi.model import Model
from llamabatch.prompts.chat_template import (
    ChatTemplateError,
    chat_prompt_tokens,
    normalize_messages,
    render_chat,
)

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# -- real templates (as published in the models' tokenizer_config.json) ---------------------------

CHATML = testing.CHATML_TEMPLATE

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-Instruct: Hermes-style tools in the system turn, <tool_call> and <tool_response>.
QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\
<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral-style: strict alternation enforced with raise_exception, [INST] blocks, eos after turns.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

# transformers' own extras: {% generation %} blocks, tojson arguments, strftime_now, loop controls.
EXTRAS = (
    "{%- set today = strftime_now('%Y') %}"
    "{{- bos_token }}year={{ today }}\n"
    "{%- for message in messages %}"
    "{%- if message.role == 'stop' %}{% break %}{% endif %}"
    "{%- if message.role == 'skip' %}{% continue %}{% endif %}"
    "{%- if message.role == 'assistant' %}"
    "{% generation %}{{ message.role }}: {{ message.content }}{{ eos_token }}{% endgeneration %}"
    "{%- else %}{{ message.role }}: {{ message.content }}\n{%- endif %}"
    "{%- endfor %}\n"
    "{%- if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}"
    "{{ tools | tojson(separators=(',', ':'), ensure_ascii=True) }}{% endif %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city — «today»",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Hello there!  "},
    {"role": "assistant", "content": "Hi. <b>Bold</b> & 'quoted' — ünïcode"},
    {"role": "user", "content": "What is 2+2?"},
]

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    {"role": "user", "content": "Thanks"},
]


def _hf_tokenizer(template: str):
    # A word-level vocabulary holding just the special tokens: the template text is all that matters.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template
    )


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("chat-templates")


@pytest.fixture(scope="module")
def model_with(gguf_dir):
    """A loader: the tiny model with ``template`` as its GGUF chat template (vocabulary only)."""
    made: list[Model] = []

    def load(template: str | None) -> Model:
        path = gguf_dir / f"m{len(made)}.gguf"
        testing.write_llama_gguf(path, testing.PRESETS["tiny"], chat_template=template)
        model = Model(path, vocab_only=True)
        made.append(model)
        return model

    yield load
    for model in made:
        model.close()


def _both(model: Model, template: str, messages, **kwargs):
    ours = render_chat(model, messages, **kwargs)
    hf_kwargs = {"add_generation_prompt": kwargs.get("add_generation_prompt", True)}
    if kwargs.get("tools") is not None:
        hf_kwargs["tools"] = kwargs["tools"]
    theirs = _hf_tokenizer(template).apply_chat_template(
        normalize_messages(messages), tokenize=False, **hf_kwargs
    )
    return ours, theirs


@pytest.mark.parametrize(
    ("name", "template", "messages", "tools"),
    [
        ("chatml", CHATML, CONVERSATION, None),
        ("llama3", LLAMA3, CONVERSATION, None),
        ("qwen25-no-tools", QWEN25_TOOLS, CONVERSATION, None),
        ("qwen25-tools", QWEN25_TOOLS, TOOL_CONVERSATION, TOOLS),
        ("qwen25-tools-system", QWEN25_TOOLS, CONVERSATION, TOOLS),
        ("mistral", MISTRAL, CONVERSATION[1:], None),
        ("extras", EXTRAS, [*CONVERSATION, {"role": "skip", "content": "x"}], TOOLS),
        ("extras-break", EXTRAS, [CONVERSATION[1], {"role": "stop", "content": ""}, CONVERSATION[3]], None),
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_jinja_matches_transformers(model_with, name, template, messages, tools, add_generation_prompt):
    model = model_with(template)
    assert model.chat_template == template  # round-tripped through the GGUF and llama.cpp
    ours, theirs = _both(model, template, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours  # not trivially empty


def test_bos_and_eos_come_from_the_model(model_with):
    model = model_with(LLAMA3)
    text = render_chat(model, [{"role": "user", "content": "hi"}])
    assert text.startswith("<s><|start_header_id|>user")
    text = render_chat(model, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                       chat_template=MISTRAL, add_generation_prompt=False)  # fmt: skip
    assert text == "<s>[INST] a [/INST]b</s>"


def test_content_parts_are_joined_text(model_with):
    model = model_with(CHATML)
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert render_chat(model, parts) == render_chat(model, [{"role": "user", "content": "one\ntwo"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(ValueError, match=r"content\[0\].*only text content parts.*image_url"):
        render_chat(model, image)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be"),
        (["user: hi"], r"messages\[0\] must be a mapping"),
    ],
)
def test_bad_messages(model_with, messages, match):
    model = model_with(CHATML)
    with pytest.raises(ValueError, match=match):
        render_chat(model, messages)


def test_raise_exception_is_a_value_error(model_with):
    model = model_with(MISTRAL)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(model, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_sandbox_refuses_python_internals(model_with, caplog):
    # A template that reaches for Python internals cannot render in the sandbox; with no
    # llama.cpp format to fall back on, the error says both failed.
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    model = model_with(evil)
    with (
        caplog.at_level(logging.WARNING, "llamabatch"),
        pytest.raises(ValueError, match="could not be rendered"),
    ):
        render_chat(model, [{"role": "user", "content": "x"}])
    # the sandbox cannot modify its inputs either (ImmutableSandboxedEnvironment)
    model = model_with("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    with pytest.raises(ValueError, match="could not be rendered"):
        render_chat(model, [{"role": "user", "content": "x"}])


def test_falls_back_to_llama_cpp_builtin_only_when_jinja_fails(model_with, caplog):
    # Broken Jinja that llama.cpp still recognises as ChatML by its markers.
    broken = CHATML + "{% if %}<|im_start|>"
    model = model_with(broken)
    messages = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING, "llamabatch"):
        text = render_chat(model, messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "falling back" in caplog.text
    with pytest.raises(ValueError, match="cannot render tools"):
        render_chat(model, messages, tools=TOOLS)


def test_builtin_template_by_name_and_override(model_with):
    model = model_with(CHATML)
    messages = [{"role": "user", "content": "hi"}]
    llama3 = render_chat(model, messages, chat_template="llama3")
    assert llama3.startswith("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    assert render_chat(model, messages, chat_template=LLAMA3).startswith("<s><|start_header_id|>user")


def test_no_template(model_with):
    model = model_with(None)
    assert model.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        render_chat(model, [{"role": "user", "content": "hi"}])
    assert render_chat(model, [{"role": "user", "content": "hi"}], chat_template="chatml").startswith(
        "<|im_start|>user"
    )


def test_chat_template_kwargs(model_with):
    model = model_with("{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}ok")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(model, messages) == "ok"
    assert render_chat(model, messages, chat_template_kwargs={"enable_thinking": False}) == "/no_thinkok"


def test_chat_prompt_tokens_has_one_bos(model_with):
    model = model_with(LLAMA3)
    messages = [{"role": "user", "content": "hi"}]
    tokens = chat_prompt_tokens(model, render_chat(model, messages))
    assert tokens[0] == testing.BOS_ID and tokens[1] != testing.BOS_ID
    chatml = chat_prompt_tokens(model, render_chat(model, messages, chat_template=CHATML))
    assert chatml[:2] == [testing.BOS_ID, testing.IM_START_ID]  # BOS added as the model asks
