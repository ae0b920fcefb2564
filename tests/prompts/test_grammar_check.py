"""``llamabatch.prompts.grammar_check`` and the schema checks of ``llamabatch.prompts.structured`` (issue 26).

No model is needed: these are the validator's own decisions. ``test_hostile_inputs.py`` puts
the same inputs through llama.cpp in a child process.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch import SamplingParams
from llamabatch.prompts.grammar_check import (
    DEFAULT_GRAMMAR_LIMITS,
    GrammarLimits,
    check_grammar,
    get_grammar_limits,
    set_grammar_limits,
)
from llamabatch.prompts.structured import check_schema, json_object_grammar, json_schema_grammar

ARITHMETIC = r"""
# a small calculator language
root  ::= expr
expr  ::= term (("+" | "-") term)*
term  ::= factor (("*" | "/") factor)*
factor ::= number | "(" ws expr ws ")"
number ::= "-"? [0-9]+ ("." [0-9]{1,6})?
ws ::= [ \t\n]*
"""

LISTS = 'root ::= item+\nitem ::= "- " [^\\n]+ "\\n"\r\n'
TOKENS = 'root ::= <[1]> !<[2]> "x" | <[3]>'
ESCAPES = r'root ::= "\x41\u00e9\U0001F600\t\"\\" [\[\]\-] [^\x00-\x1F] .'
MULTILINE = 'root ::= (\n  "a" |\n  "b"\n) "c"'


@pytest.mark.parametrize("grammar", [ARITHMETIC, LISTS, TOKENS, ESCAPES, MULTILINE, 'root ::= "a" | '])
def test_valid_grammars_pass(grammar: str) -> None:
    stats = check_grammar(grammar)
    assert stats.n_rules >= 1 and stats.ref_depth >= 1


def test_json_grammars_pass() -> None:
    check_grammar(json_object_grammar())
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 1000},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 1000},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}(x|yz)?$"},
            "when": {"type": "string", "format": "date-time"},
            "n": {"type": "integer", "minimum": 0},
            "kind": {"$ref": "#/$defs/kind"},
        },
        "required": ["name"],
        "$defs": {"kind": {"enum": ["a", "b", None, 1.5]}},
    }
    grammar = json_schema_grammar(schema)
    assert "char{1,1000}" in grammar and "{1,999}" in grammar  # repetitions stay flat
    assert check_grammar(grammar).max_nesting < 20


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ("root ::= [b-a]", "inverted character range"),
        ("root ::= []", "empty character class"),
        ("root ::= [^]", "empty character class"),
        ("root ::= [^\\x00-\\U0010FFFF]", "matches no character"),
        ("root ::= [\\x00]", "matches no character"),
        ('root ::= "\\x00"', "U+0000 can never be generated"),
        ("root ::= x", "undefined rule 'x'"),
        ('x ::= "a"', "no 'root' rule"),
        ('root ::= "a" x\nx ::= "b" x', "can never finish"),
        ('root ::= root "a" | "b"', "left recursion"),
        ('root ::= y root "a" | "b"\ny ::= z\nz ::= | "c"', "left recursion"),
        ('root ::= "a"{5,2}', "maximum below its minimum"),
        ('root ::= "a"{0,1001}', "GrammarLimits.max_repetition"),
        ('root ::= "a"{99999999999999999999999}', "GrammarLimits.max_repetition"),
        ("root ::= " + "(" * 201 + '"a"' + ")" * 201, "GrammarLimits.max_nesting"),
        ('root ::= ("a"{0,100}){0,100}', "above llama.cpp's limit"),
        ('root ::= "a" )', "unexpected ')'"),
        ('root ::= ("a"', "expecting ')'"),
        ('root ::= "abc', "unterminated string"),
        ("root ::= [abc", "unterminated character class"),
        ('root ::= "\\q"', "unknown escape"),
        ('root ::= "\\x4"', "hex digits"),
        ("root ::= *", "needs a preceding item"),
        ('root ::= ""*', "needs a preceding item"),
        ('root = "a"', "expecting ::="),
        ("root ::= <[99999999999]>", "token id out of range"),
        ('root ::= "a"\x00', "NUL"),
    ],
)
def test_invalid_grammars_are_refused(grammar: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^grammar: ") as info:
        check_grammar(grammar)
    assert message in str(info.value)


def test_expansion_costs_are_bounded() -> None:
    calls = "root ::= r0\n" + "\n".join(f"r{k} ::= r{k + 1} | r{k + 1}" for k in range(40)) + '\nr40 ::= "a"'
    with pytest.raises(ValueError, match=r"GrammarLimits\.max_(stacks|ref_calls)"):
        check_grammar(calls)
    fan = (
        "root ::= r0\n"
        + "\n".join(f'r{k} ::= r{k + 1} "a" | r{k + 1} "b"' for k in range(30))
        + '\nr30 ::= "a"'
    )
    with pytest.raises(ValueError, match=r"GrammarLimits\.max_stacks"):
        check_grammar(fan)
    chain = "root ::= r0\n" + "\n".join(f'r{k} ::= r{k + 1} "a"' for k in range(600)) + '\nr600 ::= "a"'
    with pytest.raises(ValueError, match=r"GrammarLimits\.max_ref_depth"):
        check_grammar(chain)
    rules = "root ::= " + " ".join(f'"{k}"{{0,1000}}' for k in range(11))
    with pytest.raises(ValueError, match=r"GrammarLimits\.max_rules"):
        check_grammar(rules)
    elements = "root ::= " + " ".join('"abcdefghij"{1000}' for _ in range(25))
    with pytest.raises(ValueError, match=r"GrammarLimits\.max_elements"):
        check_grammar(elements)
    big = "root ::= " + '"a" ' * (DEFAULT_GRAMMAR_LIMITS.max_bytes // 4)
    with pytest.raises(ValueError, match=r"GrammarLimits\.max_bytes"):
        check_grammar(big)


def test_limits_are_configurable() -> None:
    deep = "root ::= " + "(" * 5 + '"a"' + ")" * 5
    check_grammar(deep)
    with pytest.raises(ValueError, match=r"nested groups \(4\) exceeds the limit of 3"):
        check_grammar(deep, limits=GrammarLimits(max_nesting=3))
    previous = set_grammar_limits(GrammarLimits(max_repetition=5))
    try:
        assert get_grammar_limits().max_repetition == 5
        with pytest.raises(ValueError, match=r"SamplingParams\.grammar: repetition count 6"):
            SamplingParams(grammar='root ::= "a"{6}')
        with pytest.raises(ValueError, match=r"SamplingParams\.json_schema: maxLength 6"):
            SamplingParams(json_schema={"type": "string", "maxLength": 6})
    finally:
        set_grammar_limits(previous)
    assert get_grammar_limits() == DEFAULT_GRAMMAR_LIMITS
    SamplingParams(grammar='root ::= "a"{6}')


@pytest.mark.parametrize(
    "kwargs",
    [{"max_repetition": 2001}, {"max_nesting": 0}, {"max_rules": True}, {"max_bytes": 1.5}],
)
def test_grammar_limits_are_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"GrammarLimits\."):
        GrammarLimits(**kwargs)
    with pytest.raises(TypeError):
        set_grammar_limits({"max_nesting": 3})  # type: ignore[arg-type]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "maxLength": 50000}, "maxLength 50000 at $ exceeds the limit of 1000"),
        ({"type": "string", "minLength": 1001}, "GrammarLimits.max_repetition"),
        ({"type": "array", "maxItems": 100000}, "GrammarLimits.max_repetition"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is above maxLength 2"),
        ({"type": "string", "maxLength": -1}, "non-negative integer"),
        ({"type": "string", "maxLength": True}, "non-negative integer"),
        ({"type": "string", "maxLength": 2.5}, "non-negative integer"),
        ({"type": "string", "pattern": "^a{0,20000}$"}, "quantifier {0,20000}"),
        ({"type": "string", "pattern": "^(a$"}, "not a valid regular expression"),
        ({"type": "string", "pattern": "a+"}, "must start with ^ and end with $"),
        ({"type": "string", "pattern": 5}, "pattern at $ must be a string"),
        ({"type": "string", "pattern": "^" + "(" * 300 + "a" + ")" * 300 + "$"}, "GrammarLimits.max_nesting"),
        ({"type": "number", "minimum": "x"}, "minimum at $ must be a finite number"),
        ({"type": "number", "maximum": math.inf}, "must be a finite number"),
        ({"const": math.nan}, "NaN"),
        ({"enum": [1, math.inf]}, "inf"),
        ({"enum": []}, "enum at $ must be a non-empty list"),
        ({"type": "strng"}, "type at $ must be one of"),
        ({"type": []}, "type at $ must be one of"),
        ({"$ref": "https://example.com/x.json"}, "only local references"),
        ({"$ref": "http://127.0.0.1/x"}, "only local references"),
        ({"$ref": "file:///etc/passwd"}, "only local references"),
        ({"$ref": 5}, "only local references"),
        ({"$ref": "#/$defs/missing", "$defs": {}}, "does not resolve"),
        ({"properties": {"a": True}}, "$.properties.a must be a schema object"),
        ({"items": [1]}, "must be a schema object"),
        ({"anyOf": []}, "anyOf at $ must be a non-empty list"),
        ({"required": "a"}, "required at $ must be a list"),
        ({"properties": []}, "properties at $ must be an object"),
        (_nested(70), "GrammarLimits.max_schema_depth"),
        ({"enum": list(range(30000))}, "GrammarLimits.max_schema_nodes"),
    ],
)
def test_invalid_schemas_are_refused(schema: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_schema(schema, what="S")
    assert str(info.value).startswith("S"), info.value
    assert message in str(info.value), info.value


def test_schema_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^SamplingParams\.json_schema: maxLength"):
        SamplingParams(json_schema={"type": "string", "maxLength": 50000})
    with pytest.raises(ValueError, match=r"^SamplingParams\.response_format\.json_schema\.schema: enum"):
        SamplingParams(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}
        )
    with pytest.raises(
        ValueError, match=r"^SamplingParams\.response_format\.schema: pattern .* bad character range"
    ):
        SamplingParams(
            response_format={"type": "json_object", "schema": {"type": "string", "pattern": "^[b-a]$"}}
        )
    with pytest.raises(ValueError, match=r"^SamplingParams\.json_schema is not valid JSON: NaN is not JSON"):
        SamplingParams(json_schema='{"const": NaN}')
    with pytest.raises(ValueError, match=r"^SamplingParams\.json_schema: the schema is \d+ bytes"):
        SamplingParams(json_schema=json.dumps({"enum": ["x" * 300_000]}))
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match=r"^SamplingParams\.json_schema"):
        SamplingParams(json_schema=deep)


def test_schemas_within_limits_still_work() -> None:
    for schema in (
        {"type": "string", "maxLength": 1000},
        {"type": "array", "items": {"type": "number"}, "minItems": 1000, "maxItems": 1000},
        {"type": "string", "pattern": "^a{0,1000}$"},
        {
            "properties": {"k": {"$ref": "#/$defs/a"}},
            "$defs": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},
                "b": {"type": "null"},
            },
        },
        _nested(60),
        {"type": "object", "additionalProperties": False, "properties": {"x": {"type": "boolean"}}},
    ):
        assert SamplingParams(json_schema=schema).effective_grammar


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"penalty_last_n": 2**31 - 1}, "penalty_last_n must be an int in [-1, 1048576]"),
        ({"penalty_last_n": -2}, "penalty_last_n"),
        ({"n": 129}, "n must be an int in [1, 128]"),
        ({"stop": ["s"] * 65}, "stop takes at most 64 strings"),
        ({"stop": ["x" * 1025]}, "stop[0] must be at most 1024 characters"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids takes at most 1024 ids"),
        ({"logit_bias": dict.fromkeys(range(2**18 + 1), 1.0)}, "logit_bias takes at most 262144 entries"),
        ({"logprobs": 101}, "logprobs"),
    ],
)
def test_allocation_sizes_are_capped(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value), info.value


_GBNF_ALPHABET = st.sampled_from(
    list('root ::= "ab" [^a-z] \\ x u U 0 1 9 F ( ) | * + ? { } , . < > ! # \n \r \t - ] [ é _ :')
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(_GBNF_ALPHABET, max_size=60).map(lambda body: "root ::= " + body))
def test_any_text_gives_a_verdict(text: str) -> None:
    """The validator itself never fails with anything but ValueError, whatever the text."""
    try:
        check_grammar(text)
    except ValueError:
        pass
