"""The one chat pipeline (``llamabatch.chat``): ``prepare`` names the request field at fault,
a streamed answer's typed deltas add up to the whole answer's split however the text is cut,
and the same conversation gives the same tool calls, reasoning and text from ``LLM.chat``,
``LLMEngine`` and ``POST /v1/chat/completions``, streamed and not, on the real SmolLM2."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch import LLM, LLMEngine, SamplingParams, testing
from llamabatch.chat import (
    ChatRequestError,
    ChatSetup,
    ContentDelta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallHead,
    assistant_message,
    prepare,
    prepare_chat,
)
from llamabatch.outputs import CompletionOutput, Timings, Usage
from llamabatch.toolcalls import get_format

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER_TOOL]


# -- errors name the request field -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Iterator[LLM]:
    with LLM(testing.model_path("tiny"), n_ctx=1024, n_parallel=1, n_threads=1) as llm:
        yield llm


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs"),
        ({"messages": [{"content": "hi"}]}, "messages"),
    ],
)
def test_prepare_errors_name_the_field(tiny, fields, param):
    fields = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ChatRequestError) as info:
        prepare(tiny, fields.pop("messages"), SamplingParams(max_tokens=4), **fields)
    assert info.value.param == param, str(info.value)
    assert isinstance(info.value, ValueError)  # what LLM.chat raised before: still caught as one


def test_a_forced_call_with_another_grammar_names_tool_choice():
    with pytest.raises(ChatRequestError, match="cannot be combined") as info:
        prepare_chat(
            SamplingParams(json_schema={"type": "object"}),
            template=None,
            prompt="",
            tools=TOOLS,
            tool_choice="required",
        )
    assert info.value.param == "tool_choice"


# -- streamed and whole answers are read alike -------------------------------------------------

THINK_CONTENT_CALLS = (
    "<think>The user wants the weather.</think>\n\nLet me check. "
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
)


def _output(text: str, finish_reason: str = "stop") -> CompletionOutput:
    return CompletionOutput(
        request_id=0,
        text=text,
        token_ids=[],
        finish_reason=finish_reason,  # type: ignore[arg-type]
        usage=Usage(1, 1),
        timings=Timings(0.0, None, 0.0),
    )


def _setup(fmt: str | None = "hermes") -> ChatSetup:
    return ChatSetup(
        SamplingParams(), get_format(fmt) if fmt else None, reasoning=True, in_reasoning=False, parallel=True
    )


def _read(pieces: list) -> tuple[str, str, list[tuple[int, str, str]]]:
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
    heads = {p.index: (p.id, p.name) for p in pieces if isinstance(p, ToolCallHead)}
    arguments = {p.index: p.arguments for p in pieces if isinstance(p, ToolCallArguments)}
    calls = [(i, heads[i][1], arguments[i]) for i in sorted(heads)]
    return content, reasoning, calls


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(THINK_CONTENT_CALLS)), max_size=12))
def test_stream_deltas_add_up_to_the_whole_answer(cuts):
    """However the answer is cut into pieces, the typed deltas give the whole answer's split,
    and a head comes before its arguments."""
    whole = _setup().finish_output(_output(THINK_CONTENT_CALLS))
    assert whole.finish_reason == "tool_calls"
    assert (whole.reasoning, whole.text) == ("The user wants the weather.", "Let me check.")
    assert [json.loads(c.arguments)["city"] for c in whole.tool_calls] == ["Paris", "Lyon"]
    stream = _setup().stream()
    pieces, start = [], 0
    for cut in [*sorted(cuts), len(THINK_CONTENT_CALLS)]:
        pieces += stream.feed(THINK_CONTENT_CALLS[start:cut])
        start = cut
    pieces += stream.finish("stop")
    content, reasoning, calls = _read(pieces)
    assert (content, reasoning, stream.finish_reason) == (whole.text, whole.reasoning, "tool_calls")
    assert [(name, args) for _, name, args in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    for i, piece in enumerate(pieces):
        if isinstance(piece, ToolCallArguments):
            assert isinstance(pieces[i - 1], ToolCallHead) and pieces[i - 1].index == piece.index


def test_deltas_and_message_in_openai_shapes():
    out = _setup().finish_output(_output(THINK_CONTENT_CALLS))
    message = assistant_message(out)
    assert message["content"] == "Let me check." and message["reasoning_content"] == out.reasoning
    assert message["tool_calls"] == [call.to_dict() for call in out.tool_calls]
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    only_calls = assistant_message(dataclasses.replace(out, text=""))
    assert only_calls["content"] is None
    head = ToolCallHead(0, "call_1", "get_weather").to_dict()
    assert head == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    assert ToolCallArguments(0, "{}").to_dict() == {
        "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]
    }
    assert ReasoningDelta("r").to_dict() == {"reasoning_content": "r"}
    assert ContentDelta("c").to_dict() == {"content": "c"}


def test_the_finish_reason_rule_and_errors():
    """``stop`` after calls is ``tool_calls``; ``length`` stays; a cancelled answer is split
    (as its stream was), an error's text is not; without a format or reasoning nothing is split
    or held back."""
    assert _setup().finish_output(_output(THINK_CONTENT_CALLS, "length")).finish_reason == "length"
    cancelled = _setup().finish_output(_output(THINK_CONTENT_CALLS, "cancelled"))
    assert (
        cancelled.finish_reason == "cancelled" and cancelled.text == "Let me check." and cancelled.tool_calls
    )
    failed = _output(THINK_CONTENT_CALLS, "error")
    assert _setup().finish_output(failed) == failed
    stream = _setup().stream()
    stream.feed(THINK_CONTENT_CALLS)
    assert stream.finish("error") == [] and stream.finish_reason == "error"
    plain = ChatSetup(SamplingParams(), None, reasoning=False, in_reasoning=False, parallel=True)
    raw = plain.stream()
    assert raw.feed("a <think> ") == [ContentDelta("a <think> ")] and raw.feed("") == []
    assert raw.finish("stop") == [] and raw.finish_reason == "stop"
    assert plain.finish_output(_output(THINK_CONTENT_CALLS)) == _output(THINK_CONTENT_CALLS)


# -- the same answer from every entry point, on the real model ---------------------------------

#: an earlier turn that thought before answering, then the question
CONVERSATION = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "<think>The user greets me.</think>Hello! How can I help you?"},
    {"role": "user", "content": "What is the weather like in Paris today?"},
]
#: an answer holding all three parts, forced by a grammar (tool_choice "auto" then reads it);
#: ``max_tokens`` cuts it inside its second call, which the end of the stream must resolve
FORCED_ANSWER = (
    "<think>The user wants the weather in Paris.</think>Let me check. "
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
)
CASES = {
    # SmolLM2's template names no tool-call format: the generic one (a JSON answer) is detected
    "required": {"tool_choice": "required", "max_tokens": 96, "parser": "auto"},
    # Hermes' markers let a call follow content; the whole answer is 130 tokens
    "think-content-call-cut": {
        "tool_choice": "auto",
        "max_tokens": 100,
        "grammar": f"root ::= {json.dumps(FORCED_ANSWER)}",
        "parser": "hermes",
    },
}
OPTIONS = {
    "n_ctx": 2048,
    "n_parallel": 1,
    "n_threads": 1,
    "prefix_cache": False,  # every request computes its whole prompt: the same batches each time
}

Answer = tuple[str, str, list[tuple[str, str]], str]  # content, reasoning, calls, finish reason


def _params(case: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=case["max_tokens"], grammar=case.get("grammar"))


def _from_llm_chat(llm: LLM, case: dict) -> Answer:
    (result,) = llm.chat(
        CONVERSATION, _params(case), tools=TOOLS, tool_choice=case["tool_choice"], use_tqdm=False
    )
    out = result.outputs[0]
    return out.text, out.reasoning or "", [(c.name, c.arguments) for c in out.tool_calls], out.finish_reason


def _from_llm_engine(engine: LLMEngine, case: dict) -> Answer:
    rid = engine.add_request(CONVERSATION, _params(case), tools=TOOLS, tool_choice=case["tool_choice"])
    content = reasoning = ""
    calls: list[tuple[str, str]] = []
    finish = None
    while engine.has_unfinished_requests():
        for step in engine.step():
            assert step.request_id == rid
            content, reasoning = content + step.text, reasoning + step.reasoning
            calls += [(c.name, c.arguments) for c in step.tool_calls]
            finish = step.finish_reason or finish
    assert finish is not None
    return content, reasoning, calls, finish


def _body(case: dict, stream: bool) -> dict:
    body = {
        "messages": CONVERSATION,
        "tools": TOOLS,
        "tool_choice": case["tool_choice"],
        "temperature": 0,
        "max_tokens": case["max_tokens"],
        "stream": stream,
    }
    if "grammar" in case:
        body["grammar"] = case["grammar"]
    return body


def _from_server(httpx, url: str, case: dict) -> Answer:
    reply = httpx.post(f"{url}/v1/chat/completions", json=_body(case, False), timeout=120)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    assert all(
        c["type"] == "function" and c["id"].startswith("call_") for c in message.get("tool_calls") or []
    )
    return message["content"] or "", message.get("reasoning_content") or "", calls, choice["finish_reason"]


def _from_server_stream(httpx, url: str, case: dict) -> Answer:
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    finish = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(case, True), timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[len("data: ") :])["choices"]
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for part in delta.get("tool_calls") or []:
                if "id" in part:  # the head: index, id, type, name
                    assert part["index"] not in calls and part["function"]["arguments"] == ""
                    calls[part["index"]] = [part["function"]["name"], ""]
                calls[part["index"]][1] += part["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    assert finish is not None
    return content, reasoning, [(name, args) for name, args in calls.values()], finish


@pytest.mark.parametrize("case", CASES)
def test_the_same_answer_from_llm_chat_llm_engine_and_the_server(smollm2_path, case):
    """The same conversation (tools, a think block, greedy) gives the same tool calls,
    reasoning and text from ``LLM.chat``, ``LLMEngine`` and ``POST /v1/chat/completions``,
    streamed and not."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import serve

    from llamabatch.server import create_app

    spec = CASES[case]
    options = {**OPTIONS, "tool_call_parser": spec["parser"]}
    with LLMEngine(smollm2_path, **options) as engine:  # type: ignore[arg-type]
        from_engine = _from_llm_engine(engine, spec)
    with LLM(smollm2_path, **options) as llm, serve(create_app(llm, model_name="smollm2")) as url:  # type: ignore[arg-type]
        answers = {
            "LLM.chat": _from_llm_chat(llm, spec),
            "LLMEngine": from_engine,
            "server": _from_server(httpx, url, spec),
            "server, streamed": _from_server_stream(httpx, url, spec),
        }
    expected = answers["LLM.chat"]
    for name, answer in answers.items():
        assert answer == expected, (name, answer, expected)
    content, reasoning, calls, finish = expected
    ((function, arguments),) = calls
    assert function == "get_weather" and "Paris" in json.loads(arguments)["city"]
    if case == "required":
        assert (reasoning, content, finish) == ("", "", "tool_calls")
    else:  # the call cut by max_tokens stays content, resolved when the answer ends
        assert reasoning == "The user wants the weather in Paris." and finish == "length"
        assert content.startswith('Let me check.<tool_call>\n{"name": "get_weather"'), content
