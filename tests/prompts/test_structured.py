"""Structured output: ``SamplingParams(json_schema=...)`` and ``response_format``, on the real engine.

A random-weight model has no idea what JSON is; the grammar alone makes every output valid.
Schemas are bounded (``maxLength``, ``enum``, ``maxItems``) so each value completes within
``max_tokens`` and the grammar then allows only an end-of-generation token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import model_path
from llamabatch.prompts.structured import json_object_grammar, json_schema_grammar, resolve_grammar

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "mood": {"enum": ["happy", "sad", 3, None]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"const": "cat"}, "age": {"enum": [1, 2, 3]}},
            "required": ["kind", "age"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "mood", "ok", "tags", "pet"],
    "additionalProperties": False,
}

PROMPTS = ["Describe a person as JSON:", "The quick brown fox", "Once upon a time", "{"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model_path("tiny"), n_ctx=2048, n_parallel=4, n_threads=1) as llm:
        yield llm


def _completions(outs) -> list:
    """Every completion of ``generate``'s results (RequestOutput.outputs, or CompletionOutputs)."""
    flat = []
    for out in outs:
        flat.extend(getattr(out, "outputs", [out]))
    return flat


def _check_all(llm: LLM, params: SamplingParams, schema: dict) -> list:
    outs = _completions(llm.generate(PROMPTS, params))
    assert len(outs) == len(PROMPTS) * params.n
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
    return outs


def test_json_schema_dict(llm):
    params = SamplingParams(
        json_schema=PERSON, max_tokens=200, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7
    )
    _check_all(llm, params, PERSON)


def test_json_schema_string_and_n(llm):
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue", 1.5]}, "minItems": 1, "maxItems": 4}
    params = SamplingParams(json_schema=json.dumps(schema), max_tokens=80, temperature=1.5, n=3, seed=1)
    outs = _check_all(llm, params, schema)
    assert len({o.text for o in outs}) > 1  # sampled, not all alike


def test_response_format_json_schema(llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    params = SamplingParams(response_format=fmt, max_tokens=200, temperature=0.9, seed=3)
    _check_all(llm, params, PERSON)
    # llama.cpp's server extension: json_object with a schema
    params = SamplingParams(response_format={"type": "json_object", "schema": PERSON}, max_tokens=200, seed=4)
    _check_all(llm, params, PERSON)


def test_greedy_is_constrained_too(llm):
    # greedy decoding must go through the grammar sampler, not a plain argmax
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    params = SamplingParams(json_schema=schema, max_tokens=40, temperature=0)
    _check_all(llm, params, schema)


def test_json_object_output_stays_json(llm):
    # Any JSON object: a random model may not close it within max_tokens, but every output
    # must be JSON so far, and a finished one must parse as an object.
    params = SamplingParams(response_format={"type": "json_object"}, max_tokens=48, temperature=1.0, seed=5)
    for out in _completions(llm.generate(PROMPTS, params)):
        assert out.text.lstrip().startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length"


def test_text_format_is_unconstrained():
    assert SamplingParams(response_format={"type": "text"}).effective_grammar is None
    assert SamplingParams().effective_grammar is None
    assert SamplingParams(grammar='root ::= "a"').effective_grammar == 'root ::= "a"'
    # a text response_format does not conflict with a grammar
    assert SamplingParams(grammar='root ::= "a"', response_format={"type": "text"}).effective_grammar


def test_effective_grammar_is_the_converters():
    assert SamplingParams(json_schema=PERSON).effective_grammar == json_schema_grammar(PERSON)
    assert SamplingParams(response_format={"type": "json_object"}).effective_grammar == json_object_grammar()
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}  # no schema: any object
    assert resolve_grammar(None, None, fmt) == json_object_grammar()


def test_json_strings_exclude_control_characters():
    # JSON forbids raw control characters in strings; the converter's rule is narrowed
    grammar = json_schema_grammar({"type": "string"})
    assert "\\x00-\\x1F" in grammar.split("char ::=")[1].splitlines()[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, "json_schema conflicts with"),
        ({"json_schema": {"type": "string"}, "response_format": {"type": "json_object"}}, "conflicts"),
        (
            {"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
            "response_format conflicts",
        ),
        ({"json_schema": "{not json"}, r"json_schema is not valid JSON"),
        ({"json_schema": [1, 2]}, r"json_schema must be a JSON schema object"),
        ({"json_schema": {"$ref": "https://example.com/s.json"}}, r"json_schema: \$ref .* is refused"),
        ({"response_format": {"type": "xml"}}, r"response_format.type must be one of"),
        ({"response_format": "json"}, r"response_format must be an object"),
        ({"response_format": {"type": "json_schema"}}, r"response_format.json_schema must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            r"response_format.json_schema.schema must be a JSON schema object",
        ),
    ],
)
def test_bad_structured_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_round_trip():
    params = SamplingParams(json_schema=PERSON, seed=1)
    again = SamplingParams.from_dict(params.to_dict()) if hasattr(SamplingParams, "from_dict") else params
    assert again == params and again.effective_grammar == params.effective_grammar
