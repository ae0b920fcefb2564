"""Tool calls end to end: a real server, the official ``openai`` client, the tiny random-weight
model carrying Qwen 2.5's real chat template (so the Hermes format is detected). Forced calls
(``tool_choice="required"`` and a named function) come back as ``tool_calls`` whose arguments
validate against the tool's schema, streamed and not; the follow-up turn with the ``tool``
message is accepted and rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamabatch import LLM, testing

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")

from test_server import serve  # noqa: E402 (after the skips: it needs the server extra)

from llamabatch.server import create_app  # noqa: E402

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_qwen_llm):
    with serve(create_app(tiny_qwen_llm, model_name="tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _validate(name: str, arguments: str) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("tool_choice", CHOICES, ids=["required", "named"])
def test_forced_tool_calls(client, tool_choice):
    response = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=300,
        seed=1,
        parallel_tool_calls=False,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    _validate(call.function.name, call.function.arguments)
    assert not choice.message.content


@pytest.mark.parametrize("tool_choice", CHOICES, ids=["required", "named"])
def test_forced_tool_calls_streamed(client, tool_choice):
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=300, seed=1)
    whole = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    stream = client.chat.completions.create(**kwargs, parallel_tool_calls=False, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:  # the first piece: index, id, name
                assert part.index not in calls and part.function.name
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    (call,) = calls.values()
    _validate(call["name"], call["arguments"])
    # the same seed: the streamed answer is the non-streamed one
    (expected,) = whole.message.tool_calls
    assert (call["name"], call["arguments"]) == (expected.function.name, expected.function.arguments)


def test_follow_up_turn_with_the_tool_result(client, tiny_qwen_llm):
    first = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        seed=2,
        parallel_tool_calls=False,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    follow = client.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS, max_tokens=8)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = tiny_qwen_llm.apply_chat_template(conversation, tools=TOOLS)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in rendered
    arguments = json.loads(call.function.arguments)
    assert f'{{"name": "{call.function.name}", "arguments": {json.dumps(arguments)}}}' in rendered
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in it


def test_bad_tool_choice_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required", max_tokens=4)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": 5}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": "x"}, *ASK]},
            "messages",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(client, extra, param):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/chat/completions", body=body, cast_to=openai.types.chat.ChatCompletion)
    assert info.value.body.get("param") == param, info.value.body


def test_tool_choice_none_and_auto_answer_in_text(client):
    for tool_choice in ("none", "auto"):
        response = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=8, temperature=0
        )
        choice = response.choices[0]
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")


def test_reasoning_content(tmp_path):
    """DeepSeek R1's template opens ``<think>`` in the prompt: the answer (never closed by the
    random model) is ``reasoning_content``, streamed and not, and the same both ways."""
    path = tmp_path / "tiny-r1.gguf"
    template = TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
    testing.write_llama_gguf(path, testing.PRESETS["tiny"], chat_template=template.read_text())
    with LLM(path, n_ctx=1024, n_parallel=1, n_threads=1) as llm, serve(create_app(llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        kwargs = dict(model="tiny", messages=ASK, max_tokens=12, temperature=0)
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert reasoning and not message.content
        streamed = ""
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None:
                assert not delta.content
                streamed += (delta.model_extra or {}).get("reasoning_content") or ""
        assert streamed == reasoning
