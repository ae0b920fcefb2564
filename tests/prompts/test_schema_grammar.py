"""The JSON-schema → GBNF converter (``prompts/schema_grammar.py``, ``prompts/schema_regex.py``).

Conversion must end, fast, on every input: a pattern with a stray ``]`` or ``}`` once made the
converter loop forever, and a schema with many optional properties took time cubic in their
number. Whatever could hang runs in a child process with a timeout, so a regression fails the
test instead of stalling the suite.
"""

from __future__ import annotations

import functools
import json
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis_examples import draw_examples

from llamabatch import SamplingParams
from llamabatch.prompts.grammar_check import check_grammar
from llamabatch.prompts.structured import json_schema_grammar

STRAY_BRACKETS = ["^a]$", "^}$", "^\\{.*}$"]


def _run_child(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter; a hang is a failure, not a stalled suite."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish within {timeout} s (a conversion hangs)")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_stray_brackets_in_patterns_terminate() -> None:
    """A ``]`` or ``}`` outside a class is a literal (as in Python's ``re``), through every
    field that takes a schema."""
    out = _run_child(
        f"""
        import json
        from llamabatch import SamplingParams
        from llamabatch.toolcalls.base import arguments_rules, ToolSpec
        for pattern in {STRAY_BRACKETS!r}:
            schema = {{"type": "string", "pattern": pattern}}
            SamplingParams(json_schema=schema)
            spec = {{"name": "x", "schema": schema}}
            SamplingParams(response_format={{"type": "json_schema", "json_schema": spec}})
            obj = {{"type": "object", "properties": {{"a": schema}}, "required": ["a"]}}
            arguments_rules([ToolSpec(name="f", description="", parameters=obj)])
        print("done")
        """,
        timeout=30,
    )
    assert out.strip() == "done"


GENERATED_PATTERNS = [
    "^a]$",
    "^}$",
    "^\\{[a-z]{0,5}}$",
    "^[A-Z]{2}-\\d{1,3}$",
    '^"\\\\[^a-z]{1,3}$',
    "^(x|yz){1,3}$|^$",
    "^.{1,4}$",
    "^[\\s\\S]{2}$",
    "^[\\x00-\\x1f\\u2028]{1,2}$",
]

MIXED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^\\{.{0,3}}$"},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["a", "b"]}]},
        "either": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/small"}]},
        "both": {
            "allOf": [{"$ref": "#/$defs/small"}, {"properties": {"z": {"const": True}}, "required": ["z"]}]
        },
    },
    "required": ["code", "both"],
    "additionalProperties": False,
    "$defs": {
        "small": {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 3}},
        }
    },
}


def test_generated_values_validate() -> None:
    """A random-weight model under these schemas writes JSON that validates (the patterns
    through Python's ``re``, as ``jsonschema`` checks them): the grammar is a subset of each."""
    jsonschema = pytest.importorskip("jsonschema")
    from llamabatch import LLM
    from llamabatch.gguf.testing import model_path

    schemas = [{"type": "string", "pattern": p} for p in GENERATED_PATTERNS] + [MIXED]
    prompts = ["Write JSON:", "{"]
    with LLM(model_path("tiny"), n_ctx=2048, n_parallel=4, n_threads=1) as llm:
        for schema in schemas:
            params = SamplingParams(
                json_schema=schema, max_tokens=300, temperature=1.0, top_k=0, seed=11, n=2
            )
            for out in llm.generate(prompts, params, use_tqdm=False):
                for completion in out.outputs:
                    assert completion.finish_reason == "stop", (schema, completion.text)
                    jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("^a(?=b)b$", "lookahead"),
        ("^(a)\\1$", "backreferences"),
        ("^(?P<x>a)(?P=x)$", "backreferences"),
        ("^a*+$", "possessive"),
        ("^(?>a)$", "atomic"),
        ("^\\bx$", "assertion"),
        ("^(a*)*$", "empty string"),
        ("^a$b$", "anchors"),
        ("^(^a)$", "anchors"),
    ],
)
def test_inexpressible_patterns_are_refused(pattern: str, reason: str) -> None:
    with pytest.raises(
        ValueError, match=r"^SamplingParams\.json_schema: pattern at \$\.properties\.p"
    ) as info:
        SamplingParams(
            json_schema={"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
        )
    assert reason in str(info.value)


def test_tool_parameters_errors_name_the_tool() -> None:
    from llamabatch.toolcalls.base import ToolSpec, arguments_rules

    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)a$"}}}
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters: pattern at \$\.properties\.a"):
        arguments_rules([ToolSpec(name="f", description="", parameters=bad)])


def _optional_properties(n: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"property_{i}": {"type": ["string", "integer"]} for i in range(n)},
        "additionalProperties": False,
    }


def test_many_optional_properties_convert_fast() -> None:
    """700 optional properties: 14 s with the cubic converter; a generous bound here (the
    benchmark in ``asv_bench/benchmarks/bench_schema_grammar.py`` measures)."""
    out = _run_child(
        f"""
        import time
        from llamabatch.prompts.structured import json_schema_grammar
        schema = {_optional_properties(700)!r}
        start = time.perf_counter()
        try:
            json_schema_grammar(schema)
        except ValueError:
            pass
        print(time.perf_counter() - start)
        """,
        timeout=60,
    )
    assert float(out) < 3.0, out


def test_optional_properties_grow_linearly() -> None:
    """Rules and text grow linearly; the leftmost-reference chain (``max_ref_depth``) with log n."""
    sizes = {}
    for n in (10, 100, 400):
        grammar = json_schema_grammar(_optional_properties(n))
        stats = check_grammar(grammar)
        sizes[n] = len(grammar)
        assert stats.ref_depth < 40, (n, stats)
    assert sizes[400] / 400 < 2 * sizes[10] / 10  # bytes per property within 2x


def test_optional_properties_in_declared_order() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"const": 1}, "b": {"const": 2}, "c": {"const": 3}, "d": {"const": 4}},
        "required": ["b"],
        "additionalProperties": False,
    }
    grammar = json_schema_grammar(schema)
    allowed = _language(grammar)
    assert allowed == {
        '{"b":2}', '{"a":1,"b":2}', '{"b":2,"c":3}', '{"b":2,"d":4}', '{"a":1,"b":2,"c":3}',
        '{"a":1,"b":2,"d":4}', '{"b":2,"c":3,"d":4}', '{"a":1,"b":2,"c":3,"d":4}',
    }  # fmt: skip


def _language(grammar: str, limit: int = 200) -> set[str]:
    """Every string a small, finite grammar generates, with the optional space left out.

    A naive expansion of the GBNF subset the converter writes for constants and objects."""
    rules: dict[str, str] = {}
    for line in grammar.splitlines():
        name, _, body = line.partition(" ::= ")
        rules[name] = body
    rules["space"] = '""'

    def alternatives(body: str) -> list[list[str]]:
        out: list[list[str]] = []
        current: list[str] = []
        depth = 0
        for tok in re.findall(r'"(?:\\.|[^"\\])*"\??|\(|\)\??|\||[^\s()|]+', body):
            if tok == "|" and depth == 0:
                out.append(current)
                current = []
                continue
            depth += tok.count("(") - tok.count(")") if not tok.startswith('"') else 0
            current.append(tok)
        out.append(current)
        return out

    def expand(seq: list[str]) -> set[str]:
        results = {""}
        i = 0
        while i < len(seq):
            tok = seq[i]
            if tok == "(":
                depth, j = 1, i + 1
                while depth:
                    depth += seq[j] == "(" or -(seq[j].startswith(")"))
                    j += 1
                inner = " ".join(seq[i + 1 : j - 1])
                group: set[str] = set()
                for alt in alternatives(inner):
                    group |= expand(alt)
                if seq[j - 1] == ")?":
                    group.add("")
                i = j
            elif tok.startswith('"'):
                optional = tok.endswith("?")
                group = {json.loads(tok.rstrip("?"))}
                if optional:
                    group.add("")
                i += 1
            else:
                optional = tok.endswith("?")
                group = set()
                for alt in alternatives(rules[tok.rstrip("?")]):
                    group |= expand(alt)
                if optional:
                    group.add("")
                i += 1
            results = {a + b for a in results for b in group}
            assert len(results) <= limit
        return results

    out: set[str] = set()
    for alt in alternatives(rules["root"]):
        out |= expand(alt)
    return out


# -- the fuzz: every conversion ends, in bounded time, with a checked grammar or a ValueError ----

_PATTERN_PIECES = [
    "a", "b", "]", "}", "{", "{2}", "{1,3}", "{,2}", "*", "+", "?", "*?", "|", "(", ")", "(?:", "[",
    "[^", "[]", "-", "\\", "\\d", "\\w", "\\s", "\\.", "\\{", "\\}", "\\]", ".", "^", "$", "é", '"',
    "\\x00", "\\u2028", "(?=", "(?P<n>", "\\1", "{0,1000}",
]  # fmt: skip


_CONSTANTS = [1, "a", None, [1], {"k": "v"}, "é\n", "\u2028"]
_FORMATS = ["date", "time", "date-time", "uuid", "email"]


_ATOMS = [
    "a", "b", "]", "}", "{", '"', "\\\\", "é", "\\d", "\\w", "\\s", "\\D", ".", "[a-c]", "[^a]", "[]x]",
    "[\\]-]", "\\{", "\\x00", "\\n", "[\\s\\S]",
]  # fmt: skip
_QUANTIFIERS = ["", "", "", "*", "+", "?", "{2}", "{1,3}", "{,2}", "{2,}", "*?", "{0}"]


@st.composite
def _regex(draw: st.DrawFn, depth: int = 0) -> str:
    """A well-formed regular expression (mostly: some quantified groups can be empty)."""
    branches = []
    for _ in range(draw(st.integers(1, 2))):
        items = []
        for _ in range(draw(st.integers(0, 4))):
            if depth < 3 and draw(st.integers(0, 3)) == 0:
                atom = draw(st.sampled_from(["(", "(?:", "(?P<g>"])) + draw(_regex(depth + 1)) + ")"
            else:
                atom = draw(st.sampled_from(_ATOMS))
            items.append(atom + draw(st.sampled_from(_QUANTIFIERS)))
        branches.append("".join(items))
    return "|".join(branches)


@st.composite
def _patterns(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        body = "".join(draw(st.lists(st.sampled_from(_PATTERN_PIECES), max_size=12)))
    else:
        body = draw(_regex())
    return draw(st.sampled_from(["^{}$", "^{}$", "^{}$", "^({})$", "^{}$|^a$", "^{}", "{}$"])).format(body)


@st.composite
def _leaf(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["pattern", "type", "enum", "format", "length", "ref", "any"]))
    if kind == "pattern":
        return {"type": "string", "pattern": draw(_patterns())}
    if kind == "type":
        return {"type": draw(st.sampled_from(["string", "integer", "number", "boolean", "null"]))}
    if kind == "enum":
        return {"enum": draw(st.lists(st.sampled_from(_CONSTANTS), min_size=1, max_size=3))}
    if kind == "format":
        return {"type": "string", "format": draw(st.sampled_from(_FORMATS))}
    if kind == "length":
        return {"type": "string", "minLength": draw(st.integers(0, 3)), "maxLength": draw(st.integers(3, 6))}
    return {"$ref": "#/$defs/d"} if kind == "ref" else {}


@st.composite
def _schemas(draw: st.DrawFn, depth: int = 0) -> Any:
    if depth >= 3:
        return draw(_leaf())
    kind = draw(st.sampled_from(["leaf", "leaf", "object", "array", "anyOf", "allOf", "types"]))
    if kind == "object":
        names = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), unique=True, max_size=5))
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {n: draw(_schemas(depth + 1)) for n in names},
            "required": draw(st.lists(st.sampled_from(names), unique=True)) if names else [],
        }
        extra = draw(st.sampled_from([None, False, True, {"type": "integer"}]))
        if extra is not None:
            schema["additionalProperties"] = extra
        return schema
    if kind == "array":
        schema = {"type": "array", "items": draw(_schemas(depth + 1))}
        if draw(st.booleans()):
            schema["prefixItems"] = [draw(_schemas(depth + 1))]
        lo = draw(st.integers(0, 3))
        schema["minItems"] = lo
        if draw(st.booleans()):
            schema["maxItems"] = lo + draw(st.integers(0, 3))
        return schema
    if kind == "anyOf":
        return {"anyOf": draw(st.lists(_schemas(depth + 1), min_size=1, max_size=3))}
    if kind == "allOf":
        return {"allOf": draw(st.lists(_schemas(depth + 1), min_size=1, max_size=3))}
    if kind == "types":
        return {
            "type": draw(st.lists(st.sampled_from(["string", "null", "object"]), min_size=1, unique=True))
        }
    return draw(_leaf())


@functools.cache
def _fuzz_patterns() -> list[str]:
    return draw_examples(_patterns(), 120)


FUZZ_CHILD = """
import json, sys, time
from llamabatch.prompts.grammar_check import check_grammar
from llamabatch.prompts.structured import json_schema_grammar
worst = 0.0
for schema in json.loads(sys.stdin.read()):
    schema.setdefault("$defs", {"d": {"type": "array", "items": {"$ref": "#/$defs/d"}, "maxItems": 2}})
    start = time.perf_counter()
    try:
        grammar = json_schema_grammar(schema)
    except ValueError as exc:
        assert str(exc).startswith("json_schema"), exc
    else:
        check_grammar(grammar)
        assert len(grammar.splitlines()) == grammar.count("\\n") + 1  # one rule per line (tools split them)
    worst = max(worst, time.perf_counter() - start)
print(worst)
"""


def test_fuzz_conversions_terminate() -> None:
    """Random schemas and patterns (stray brackets, nested groups, quantifiers): each
    conversion ends within a bound with a grammar ``check_grammar`` accepts, or a ValueError."""
    schemas = draw_examples(_schemas(), 80) + [{"type": "string", "pattern": p} for p in _fuzz_patterns()]
    try:
        done = subprocess.run(
            [sys.executable, "-c", FUZZ_CHILD],
            input=json.dumps(schemas),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a conversion did not finish within 60 s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout) < 2.0, done.stdout


PATTERN_GENERATION_CHILD = """
import json, re, sys
from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import model_path
prompts, params, patterns = [], [], []
for i, pattern in enumerate(json.loads(sys.stdin.read())):
    try:
        schema = {"type": "string", "pattern": pattern}
        sampling = SamplingParams(json_schema=schema, max_tokens=24, temperature=1.0, top_k=0, seed=i)
    except ValueError:
        continue
    prompts.append("x")
    params.append(sampling)
    patterns.append(pattern)
checked = 0
with LLM(model_path("tiny"), n_ctx=1024, n_parallel=8, n_threads=1) as llm:
    for pattern, out in zip(patterns, llm.generate(prompts, params, use_tqdm=False)):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            value = json.loads(completion.text)
            assert isinstance(value, str) and re.search(pattern, value), (pattern, completion.text)
            checked += 1
print(len(patterns), checked)
"""


def test_fuzz_generated_strings_match_their_patterns() -> None:
    """Random patterns the converter accepts: what a random-weight model writes under their
    grammar parses as a JSON string that matches the pattern (Python's ``re``)."""
    patterns = _fuzz_patterns()
    try:
        done = subprocess.run(
            [sys.executable, "-c", PATTERN_GENERATION_CHILD],
            input=json.dumps(patterns),
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("generation under the fuzzed patterns did not finish within 120 s")
    assert done.returncode == 0, done.stderr[-3000:]
    accepted, checked = map(int, done.stdout.split())
    print("patterns accepted, outputs checked:", accepted, checked)
    assert accepted >= 20 and checked >= 10, done.stdout


def _distributed(levels: int, width: int) -> dict[str, Any]:
    """allOf over anyOf, level after level: width**levels combinations to visit, each the same."""
    defs = {}
    for level in range(levels):
        below = [{"$ref": f"#/$defs/l{level + 1}"}] if level + 1 < levels else []
        part = {"allOf": [{"properties": {f"x{level}": {"const": 1}}}, *below]}
        defs[f"l{level}"] = {"anyOf": [dict(part) for _ in range(width)]}
    return {"allOf": [{"$ref": "#/$defs/l0"}], "$defs": defs}


def test_conversion_budget_is_a_value_error() -> None:
    out = _run_child(
        f"""
        import time
        from llamabatch import SamplingParams
        start = time.perf_counter()
        try:
            SamplingParams(json_schema={_distributed(10, 6)!r})
        except ValueError as exc:
            print(time.perf_counter() - start, exc)
        """,
        timeout=60,
    )
    seconds, message = out.split(" ", 1)
    assert message.startswith("SamplingParams.json_schema: ") and "exceeds the conversion budget" in message
    assert float(seconds) < 10


def test_self_references_end() -> None:
    loop = {
        "$ref": "#/$defs/a",
        "$defs": {"a": {"allOf": [{"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}]}},
    }
    with pytest.raises(ValueError, match=r"^SamplingParams\.json_schema: the schema nests deeper"):
        SamplingParams(json_schema=loop)
    itself = {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}}
    assert SamplingParams(json_schema=itself).effective_grammar  # a and a is a: any value
    tree = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                "additionalProperties": False,
            }
        },
    }
    check_grammar(json_schema_grammar(tree))


def test_server_answers_stray_bracket_patterns(tmp_path: Path) -> None:
    """Through the server (each pattern through ``json_schema``, ``response_format`` and a
    tool's ``parameters``, more requests than the default executor's workers): every request
    is answered, and a normal one after them too."""
    httpx = pytest.importorskip("httpx")
    from serve_process import wait_until_healthy

    pytest.importorskip("starlette")
    from llamabatch.gguf.testing import model_path

    template = Path(__file__).parents[1] / "data" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "llamabatch", "serve", "-m", str(model_path("tiny")), "-t", "1"]
    command += ["--port", str(port), "-np", "2", "-c", "2048", "--chat-template", str(template)]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, lambda: log.read_text(errors="replace")[-3000:])
        ask = [{"role": "user", "content": "Hi"}]
        for pattern in STRAY_BRACKETS * 3:
            schema = {"type": "string", "pattern": pattern}
            obj = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
            tool = {"type": "function", "function": {"name": "f", "description": "", "parameters": obj}}
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            for path, body in [
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "json_schema": schema}),
                ("/v1/chat/completions", {"messages": ask, "max_tokens": 2, "response_format": fmt}),
                ("/v1/chat/completions", {"messages": ask, "max_tokens": 2, "tools": [tool]}),
            ]:
                r = httpx.post(f"{url}{path}", json=body, timeout=30)
                assert r.status_code == 200, (path, pattern, r.text)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_all_of_merges() -> None:
    both = {"allOf": [{"type": ["string", "null"]}, {"type": "string", "maxLength": 3}, {"maxLength": 2}]}
    grammar = json_schema_grammar(both)
    assert "char{0,2}" in grammar and "null" not in grammar.split("\n", 1)[0]
    closed = {
        "allOf": [
            {"properties": {"a": {"const": 1}, "b": {"const": 2}}, "additionalProperties": False},
            {"properties": {"b": {"const": 2}, "c": {"const": 3}}},
        ]
    }
    # c is forbidden by the first part
    assert _language(json_schema_grammar(closed)) == {"{}", '{"a":1}', '{"b":2}', '{"a":1,"b":2}'}
    refused: list[tuple[dict[str, Any], str]] = [
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "share no value"),
        ({"allOf": [{"type": "string", "minLength": 3}, {"maxLength": 2}]}, "minLength 3 is above maxLength"),
        ({"allOf": [{"pattern": "^a$"}, {"pattern": "^b$"}]}, "disagree on 'pattern'"),
    ]
    for schema, message in refused:
        with pytest.raises(ValueError, match=r"^SamplingParams\.json_schema: ") as info:
            SamplingParams(json_schema=schema)
        assert message in str(info.value)


def test_non_negative_numbers_have_no_sign() -> None:
    grammar = json_schema_grammar({"type": "integer", "minimum": 0})
    assert '"-"' not in grammar
    assert '"-"' in json_schema_grammar({"type": "integer", "minimum": -1})
