"""Tool calls and reasoning: every family's parser on answers in the exact formats those models
write (malformed and truncated ones too), the streaming parser with markers split at every
position, format detection and rendering on the real templates (tests/data/chat_templates),
and the grammars on the tiny random-weight model: forced calls always parse and validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamabatch import LLM, SamplingParams, testing
from llamabatch.chat import prepare_chat
from llamabatch.prompts.chat_template import normalize_messages, render_jinja, tool_call_arguments
from llamabatch.toolcalls import FORMATS, check_tool_call_parser, detect_format, get_format
from llamabatch.toolcalls.reasoning import ReasoningSplitter, prompt_opens_reasoning
from llamabatch.toolcalls.stream import ChatOutputParser

jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12, "description": "the city"},
        "unit": {"type": "string", "enum": ["c", "f"], "description": "degrees"},
    },
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "a number"},
                    "b": {"type": "integer", "description": "another"},
                },
                "required": ["a", "b"],
            },
        },
    },
]
PARIS = json.dumps({"city": "Paris"})
DS = {
    "B": "<｜tool▁calls▁begin｜>",
    "E": "<｜tool▁calls▁end｜>",
    "b": "<｜tool▁call▁begin｜>",
    "e": "<｜tool▁call▁end｜>",
    "s": "<｜tool▁sep｜>",
}


def parse(fmt_name: str, text: str, **kwargs) -> ChatOutputParser:
    parser = ChatOutputParser(get_format(fmt_name), **kwargs)
    parser.feed(text)
    parser.finish()
    return parser


def calls_of(parser: ChatOutputParser) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]


# -- answers as the models write them --------------------------------------------------------------

R1_CALL = '{b}function{s}get_weather\n```json\n{{"city": "Paris"}}\n```{e}'.format(**DS)
CASES = [
    # (format, answer, content, calls)
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3",
        '{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})],
    ),
    ("llama3", 'The JSON is {"name": "x"}.', 'The JSON is {"name": "x"}.', []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "Sure.",
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]add[CALL_ID]abcDEF123[ARGS]{"a": 1, "b": 2}', None, [("add", {"a": 1, "b": 2})]),
    ("deepseek_r1", "{B}{c}{E}".format(c=R1_CALL, **DS), None, [("get_weather", {"city": "Paris"})]),
    (
        "deepseek_r1",
        'I will call it.{B}{c}\n{b}function{s}add\n```json\n{{"a": 1, "b": 2}}\n```{e}{E}'.format(
            c=R1_CALL, **DS
        ),
        "I will call it.",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    (
        "deepseek_v31",
        '{B}{b}get_weather{s}{{"city": "Paris"}}{e}{E}'.format(**DS),
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "deepseek_r1",
        '{B}{b}get_weather{s}{{"city": "Paris"}}{e}{E}'.format(**DS),
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "generic",
        '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}',
        None,
        [("add", {"a": 1, "b": 2})],
    ),
    ("generic", '{"answer": 4}', '{"answer": 4}', []),
    ("generic", "Plain text.", "Plain text.", []),
]


@pytest.mark.parametrize(("fmt", "answer", "content", "calls"), CASES)
def test_parsers_read_real_answers(fmt, answer, content, calls):
    parser = parse(fmt, answer)
    assert calls_of(parser) == calls
    assert (parser.content if parser.content else None) == content or parser.content == (content or "")
    for call in parser.tool_calls:
        assert call.id and json.loads(call.arguments) is not None


MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # truncated
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
    ),  # bad JSON
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
    ("hermes", "<tool_call>"),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Pa'),
    ("llama3", '<|python_tag|>brave_search.call(query="weather")'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", "[TOOL_CALLS]not json at all"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
    ("deepseek_r1", '{B}{b}function{s}get_weather\n```json\n{{"city":'.format(**DS)),
    ("deepseek_r1", "{B}{b}function{s}get_weather\n```json\n{{nope}}\n```{e}{E}".format(**DS)),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par'),
    ("generic", '{"tool_calls": "nope"}'),
]


@pytest.mark.parametrize(("fmt", "answer"), MALFORMED)
def test_malformed_and_truncated_calls_stay_content(fmt, answer):
    parser = parse(fmt, answer)
    assert parser.tool_calls == []
    assert parser.content == answer  # nothing lost, nothing invented


def test_content_after_a_call_and_parallel_off():
    answer = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' * 2 + "done"
    parser = parse("hermes", answer, parallel=False)
    assert calls_of(parser) == [("add", {"a": 1, "b": 2})]
    assert parser.content == "done"


def test_mistral_ids_are_nine_alphanumerics():
    (call,) = parse("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]').tool_calls
    assert len(call.id) == 9 and call.id.isalnum()


# -- streaming: every split of every answer gives the whole answer's parse -----------------------


def _stream(fmt, text: str, cuts: list[int], **kwargs) -> tuple[str, str, list]:
    parser = ChatOutputParser(get_format(fmt) if fmt else None, **kwargs)
    content = reasoning = ""
    calls = []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content += delta.content
        reasoning += delta.reasoning
        calls += [(c.name, c.arguments) for _, c in delta.tool_calls]
    return content, reasoning, calls


STREAMED = [(fmt, answer) for fmt, answer, _, _ in CASES] + MALFORMED


@pytest.mark.parametrize(("fmt", "answer"), STREAMED)
def test_streaming_equals_whole_at_every_split(fmt, answer):
    whole = parse(fmt, answer)
    expected = (whole.content, whole.reasoning, [(c.name, c.arguments) for c in whole.tool_calls])
    assert _stream(fmt, answer, [i for i in range(1, len(answer))]) == expected  # char by char
    for cut in range(1, len(answer)):
        assert _stream(fmt, answer, [cut]) == expected, cut


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_no_marker_text_leaks_into_streamed_content(fmt):
    marker = (get_format(fmt).start_markers or get_format(fmt).leading_markers)[0]
    answer = {
        "hermes": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "llama3": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
        "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "deepseek_r1": '{B}{b}function{s}add\n```json\n{{"a": 1, "b": 2}}\n```{e}{E}'.format(**DS),
        "deepseek_v31": '{B}{b}add{s}{{"a": 1, "b": 2}}{e}{E}'.format(**DS),
        "generic": '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
    }[fmt]
    for cut in range(1, len(answer)):
        content, _, calls = _stream(fmt, answer, [cut])
        assert content == "" and marker not in content
        assert calls == [("add", '{"a": 1, "b": 2}')]


# -- reasoning -------------------------------------------------------------------------------------

THINKING = [
    # (answer, prompt opens <think>, reasoning, content)
    ("<think>\nThe user greets.\n</think>\n\nHello!", False, "The user greets.\n", "Hello!"),
    ("The user greets.\n</think>\n\nHello!", True, "The user greets.\n", "Hello!"),
    ("<think>\nstill thinking", False, "still thinking", ""),
    ("Hello <think> inline </think>", False, "", "Hello <think> inline </think>"),
    ("<think></think>Hi", False, "", "Hi"),
]


@pytest.mark.parametrize(("answer", "opened", "reasoning", "content"), THINKING)
def test_reasoning_split(answer, opened, reasoning, content):
    parser = parse("hermes", answer, in_reasoning=opened)
    assert (parser.reasoning, parser.content) == (reasoning, content)
    for cut in range(1, len(answer)):
        assert _stream("hermes", answer, [cut], in_reasoning=opened) == (content, reasoning, [])
    off = parse("hermes", answer, reasoning=False)
    assert off.content == answer and off.reasoning == ""


def test_reasoning_then_a_call():
    answer = (
        '<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
        + PARIS
        + "}\n</tool_call>"
    )
    parser = parse("hermes", answer)
    assert parser.reasoning == "I need the weather."
    assert calls_of(parser) == [("get_weather", {"city": "Paris"})]
    assert parser.content == ""


def test_splitter_holds_partial_markers():
    splitter = ReasoningSplitter(in_reasoning=True)
    assert splitter.feed("abc</th") == ("abc", "")
    assert splitter.feed("ink>x") == ("", "x")
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<think>\n\n</think>\n\n")


# -- real templates: detection, and tool conversations rendered ---------------------------------

DETECTED = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_v31",
}


@pytest.mark.parametrize(("name", "family"), sorted(DETECTED.items()))
def test_format_detected_from_real_templates(name, family):
    assert detect_format((TEMPLATES / name).read_text()).name == family
    assert detect_format(testing.CHATML_TEMPLATE).name == "generic"


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
        ],
    },
    {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temp": 21}'},
]


@pytest.mark.parametrize("name", sorted(DETECTED))
def test_tool_conversations_render_on_real_templates(name):
    """OpenAI's string arguments reach each template in the shape it renders (an object for
    ``tojson`` templates, the JSON string for DeepSeek R1), and the call and the tool's answer
    are in the prompt, in the family's own syntax."""
    template = (TEMPLATES / name).read_text()
    text = render_jinja(template, CONVERSATION, tools=TOOLS, bos_token="<s>", eos_token="</s>")
    assert "Paris" in text and "21" in text
    assert '"{\\"city' not in text  # never a doubly encoded string
    family = DETECTED[name]
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "deepseek_r1": DS["b"]}.get(family)
    if marker:
        assert marker in text


def test_transformers_renders_the_converted_arguments_the_same():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    template = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", chat_template=template)
    converted = tool_call_arguments(normalize_messages(CONVERSATION), as_object=True)
    theirs = hf.apply_chat_template(converted, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert render_jinja(template, CONVERSATION, tools=TOOLS) == theirs


# -- tool_choice and options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "match"),
    [
        (None, "required", "needs tools"),
        (TOOLS, "sometimes", "tool_choice must be one of"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "auto", "parameters"),
        ("tools", "auto", "must be a list"),
    ],
)
def test_bad_tools_and_tool_choice(tools, choice, match):
    with pytest.raises(ValueError, match=match):
        prepare_chat(SamplingParams(), template=None, prompt="", tools=tools, tool_choice=choice)


def test_forced_call_conflicts_with_another_grammar():
    with pytest.raises(ValueError, match="cannot be combined"):
        prepare_chat(
            SamplingParams(json_schema={"type": "object"}),
            template=None,
            prompt="",
            tools=TOOLS,
            tool_choice="required",
        )
    with pytest.raises(ValueError, match="tool_call_parser"):
        check_tool_call_parser("nope")
    with pytest.raises(ValueError, match="grammar_triggers"):
        SamplingParams(grammar_triggers=["<x>"])


def test_tool_choice_none_parses_nothing():
    setup = prepare_chat(SamplingParams(), template=None, prompt="", tools=TOOLS, tool_choice="none")
    assert setup.fmt is None and setup.params.grammar is None


# -- the grammars, on the tiny model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    with LLM(testing.model_path("tiny"), n_ctx=4096, n_parallel=4, n_threads=1) as llm:
        yield llm


def _schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_forced_calls_parse_and_validate(llm, parser):
    """``tool_choice="required"`` and a named function: even the random-weight model writes a
    call of a tool, its arguments valid under the tool's schema, and finishes with tool_calls."""
    llm.chat_options.tool_call_parser = parser
    try:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        params = SamplingParams(max_tokens=400, temperature=0.8, seed=1)
        named = {"type": "function", "function": {"name": "add"}}
        results = [
            llm.chat(
                messages, params, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, use_tqdm=False
            )
            for choice in ("required", named)
        ]
    finally:
        llm.chat_options.tool_call_parser = "auto"
    for result, choice in zip(results, ("required", "named"), strict=True):
        out = result[0].outputs[0]
        assert out.finish_reason == "tool_calls", (choice, out.text)
        (call,) = out.tool_calls
        if choice == "named":
            assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), _schema(call.name))


def test_lazy_grammar_applies_from_its_trigger(llm):
    """``grammar_triggers``: the output is free until a token ends with the trigger word, then
    the grammar holds (llama.cpp's lazy grammar). The trigger comes from the model's own
    greedy answer, so the free part is known."""
    greedy = SamplingParams(max_tokens=24, temperature=0)
    free = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0]
    k = next(k for k in range(2, 20) if len(llm.detokenize(free.token_ids[:k]).strip()) >= 6)
    prefix = llm.detokenize(free.token_ids[:k])
    trigger = prefix[-4:]
    assert trigger not in prefix[:-1]
    grammar = f"root ::= {json.dumps(trigger)} [0-9] [0-9] [0-9]"
    lazy = SamplingParams(max_tokens=24, temperature=0, grammar=grammar, grammar_triggers=[trigger])
    text = llm.generate("Once upon a time", lazy, use_tqdm=False)[0].outputs[0].text
    head = text[:-3]  # the free part: the greedy answer up to the trigger, then 3 digits
    assert head.endswith(trigger) and free.text.startswith(head) and text[-3:].isdigit()
    first = llm.detokenize(free.token_ids[:1])
    word = first.strip()
    anchored = SamplingParams(
        max_tokens=24,
        temperature=0,
        grammar=f"root ::= {json.dumps(word)} [0-9]",
        grammar_triggers=["^" + word],
    )
    text = llm.generate("Once upon a time", anchored, use_tqdm=False)[0].outputs[0].text
    assert text.strip()[: len(word)] == word and text.strip()[len(word) :].isdigit()


def test_auto_mode_leaves_text_free_and_parses_nothing(llm):
    out = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=16, temperature=0),
        tools=TOOLS,
        use_tqdm=False,
    )[0].outputs[0]
    plain = llm.chat(
        [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False
    )[0].outputs[0]
    assert out.tool_calls == [] and out.finish_reason in ("stop", "length")
    assert out.text and plain.text


def test_llm_engine_add_request_takes_a_conversation_with_tools():
    from llamabatch import LLMEngine

    with LLMEngine(testing.model_path("tiny"), n_ctx=2048, n_parallel=2, tool_call_parser="hermes") as engine:
        ask = [{"role": "user", "content": "1 + 2?"}]
        params = SamplingParams(max_tokens=300, seed=1)
        rid = engine.add_request(ask, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        plain = engine.add_request("plain text", SamplingParams(max_tokens=4))
        content, calls, last = "", [], None
        while engine.has_unfinished_requests():
            for step in engine.step():
                if step.request_id == rid:
                    content += step.text
                    calls += step.tool_calls
                    last = step if step.finished else last
        assert last is not None and last.finish_reason == "tool_calls" and content == ""
        assert last.output.tool_calls == calls and len(calls) == 1
        jsonschema.validate(json.loads(calls[0].arguments), _schema(calls[0].name))
        assert plain != rid
        named = {"type": "function", "function": {"name": "add"}}
        engine.add_request(ask, params, tools=TOOLS, tool_choice=named)
        (out,) = engine.run_until_complete()
        assert out.finish_reason == "tool_calls" and [c.name for c in out.tool_calls] == ["add"]
        with pytest.raises(ValueError, match="only for a conversation"):
            engine.add_request("text", tools=TOOLS)


def test_reasoning_in_the_python_api(tmp_path):
    """A template that opens ``<think>`` in the prompt (DeepSeek R1's): the random model never
    closes it, so its whole answer is reasoning; ``reasoning_format="none"`` keeps it content;
    ``chat_template_kwargs`` reach the template (Qwen 3's ``enable_thinking``)."""
    r1 = tmp_path / "r1.gguf"
    testing.write_llama_gguf(
        r1,
        testing.PRESETS["tiny"],
        chat_template=(TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text(),
    )
    ask = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=8, temperature=0)
    with LLM(r1, n_ctx=1024, n_parallel=1, n_threads=1) as llm:
        assert llm.apply_chat_template(ask).endswith("<think>\n")
        out = llm.chat(ask, params, use_tqdm=False)[0].outputs[0]
        assert out.reasoning and out.text == ""
    with LLM(r1, n_ctx=1024, n_parallel=1, n_threads=1, reasoning_format="none") as llm:
        raw = llm.chat(ask, params, use_tqdm=False)[0].outputs[0]
        assert raw.reasoning is None and raw.text.strip() == out.reasoning.strip()
    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    with LLM(testing.model_path("tiny"), n_ctx=1024, n_parallel=1, n_threads=1) as llm:
        off = llm.apply_chat_template(
            ask, chat_template=qwen3, chat_template_kwargs={"enable_thinking": False}
        )
        assert off.endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(off)
        out = llm.chat(
            ask, params, chat_template=qwen3, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False
        )[0].outputs[0]
        assert out.reasoning is None and out.text


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_lazy_triggers_begin_the_grammar(llm, parser):
    """Every lazy-grammar trigger must begin the section grammar's language: llama.cpp feeds
    the grammar from the trigger on, and a rejected character aborts the process. The forced
    (required) answer shows what the grammar starts with."""
    fmt = get_format(parser)
    setup = prepare_chat(
        SamplingParams(max_tokens=300, seed=3),
        template=None,
        prompt="",
        tools=TOOLS,
        tool_choice="required",
        tool_call_parser=parser,
        parallel_tool_calls=False,
    )
    text = llm.generate("Call a tool:", setup.params, use_tqdm=False)[0].outputs[0].text
    words = [w.removeprefix("^") for w in fmt.trigger_words()]
    optional = {"<|python_tag|>"}  # llama3's grammar may start with it or without it
    body = text.removeprefix("<|python_tag|>") if parser == "llama3" else text
    assert words and all(body.startswith(w) for w in words if w not in optional), (words, text[:40])
    assert get_format(parser).parse_section(text, True).calls


def test_auto_mode_lazy_grammar_constrains_a_call_after_its_marker(llm):
    """``tool_choice="auto"`` end to end with a marker the model does write: free text up to the
    marker, then the lazy grammar forces a valid call, the parser reads it and the answer ends
    in ``tool_calls``. The marker is taken from the model's own greedy answer (at a token end)."""
    from llamabatch.chat import ChatSetup
    from llamabatch.toolcalls.base import (
        Section,
        call_from_object,
        gbnf_literal,
        json_call_rules,
        json_value_end,
        load_json,
        normalize_tools,
    )
    from llamabatch.toolcalls.hermes import HermesFormat

    greedy = SamplingParams(max_tokens=24, temperature=0)
    free = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0]
    k = next(k for k in range(2, 20) if len(llm.detokenize(free.token_ids[:k]).strip()) >= 6)
    marker = llm.detokenize(free.token_ids[:k])[-4:]

    class MarkerFormat(HermesFormat):
        name = "marker"
        start_markers = (marker,)

        def parse_section(self, text, final):
            end = json_value_end(text, len(marker)) if text[len(marker) : len(marker) + 1] == "{" else None
            if end is None:
                return Section(len(text), None) if final else None
            call = call_from_object(load_json(text[len(marker) : end]))
            return Section(end, [call] if call else None)

        def section_grammar(self, tools, parallel):
            return "\n".join([f"root ::= {gbnf_literal(marker)} call", json_call_rules(tools)])

    fmt = MarkerFormat()
    specs = normalize_tools(TOOLS)
    params = SamplingParams(
        max_tokens=300,
        temperature=0,
        grammar=fmt.section_grammar(specs, False),
        grammar_triggers=fmt.trigger_words(),
    )
    setup = ChatSetup(params, fmt, reasoning=False, in_reasoning=False, parallel=False)
    raw = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    out = setup.finish_output(raw)
    assert out.finish_reason == "tool_calls", raw.text
    at = raw.text.index(marker) + len(marker)  # free text up to the marker, as without the grammar
    assert free.text.startswith(raw.text[:at]) and raw.text[:at].startswith(out.text)
    (call,) = out.tool_calls
    jsonschema.validate(json.loads(call.arguments), _schema(call.name))
