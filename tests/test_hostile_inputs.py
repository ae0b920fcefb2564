"""Hostile grammars, JSON schemas and sampling parameters through ``LLM.generate`` (issue 26).

Every case runs in a child process (``tests/hostile_cases.py``) on the tiny model, so a crash
(SIGSEGV, ``std::terminate``, an abort) or a hang is a failed test naming the case, not a lost
run. A case must give a ``ValueError`` or correct completions, and the child must exit normally.

- the issue's reproductions (defects 1, 2, 3, 9, 10, 11) and the grammar crashes found while
  fixing them (before the fix each one crashed, hung or produced non-JSON; see the notes);
- hypothesis-generated grammars, schemas and parameters: a small budget by default,
  a larger one under ``--runslow``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hostile_cases import issue_cases, judge, run_cases
from hypothesis import strategies as st
from hypothesis_examples import draw_examples

from llamabatch import LLM, SamplingParams
from llamabatch._ffi.sampler import penalty_window
from llamabatch.gguf.testing import model_path

#: Hypothesis cases per family (grammars, schemas, parameters) by default, and under --runslow.
BUDGET, SLOW_BUDGET = 25, 400


def _check(cases: list[dict[str, Any]], code: int, outcomes: dict, died: str | None) -> None:
    problems = [f"{c['name']}: {why}" for c in cases if (why := judge(c, outcomes.get(c["name"])))]
    assert code == 0 and died is None, f"the child exited with {code} in case {died!r}; {problems[:5]}"
    assert not problems, "\n".join(problems)


def test_issue_reproductions(tmp_path: Path) -> None:
    cases = issue_cases()
    code, outcomes, died = run_cases(cases, tmp_path)
    _check(cases, code, outcomes, died)
    # The errors name the field and the limit.
    message = {name: o.get("message", "") for name, o in outcomes.items()}
    for name in ("d1_maxLength", "d1_maxItems", "d1_pattern"):
        assert "SamplingParams.json_schema" in message[name], message[name]
        assert "GrammarLimits.max_repetition" in message[name], message[name]
    assert "GrammarLimits.max_nesting" in message["d1_nested_groups"]
    assert message["d2_inverted_range"].startswith("SamplingParams.grammar: inverted character range")
    assert "response_format" in message["d2_response_format"]
    assert "SamplingParams.penalty_last_n" in message["d3_penalty_last_n"]
    assert "only local references" in message["d9_remote_ref"]
    assert "NaN" in message["d11_const_nan"] and "Infinity" in message["d11_const_inf_text"]
    assert "response_format" in message["d11_empty_enum"] and "enum" in message["d11_empty_enum"]
    assert "not a valid regular expression" in message["d11_bad_pattern"]
    assert "minimum" in message["d11_bad_minimum"]
    for name in ("dead_end_min_tokens", "dead_end_token_id"):
        assert "admits no token" in outcomes[name]["outputs"][0]["error"]
    assert "GrammarLimits.max_live_stacks" in outcomes["ambiguous_grammar"]["outputs"][0]["error"]


def test_checks_hold_under_python_O(tmp_path: Path) -> None:
    """Defect 9: the converter refused a remote $ref with an assert, gone under ``python -O``."""
    cases = [c for c in issue_cases() if c["name"] in ("d9_remote_ref", "d2_inverted_range", "d11_const_nan")]
    cases.append({"name": "no_anchor", "params": {"json_schema": {"pattern": "a+"}}, "expect": "error"})
    code, outcomes, died = run_cases(cases, tmp_path, optimize=True)
    _check(cases, code, outcomes, died)


def test_penalty_last_n_minus_one_is_the_whole_context() -> None:
    """Defect 10: llama.cpp reads -1 as 0 (off); it now means the request's context."""
    assert penalty_window(-1, 512) == 512
    assert penalty_window(1 << 20, 512) == 512 and penalty_window(64, 512) == 64
    with LLM(model_path("tiny"), n_ctx=512, n_parallel=1, n_threads=1) as llm:

        def tokens(last_n: int) -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=150, repeat_penalty=1e6, penalty_last_n=last_n)
            return llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0].token_ids

        whole, off = tokens(-1), tokens(0)
    assert len(set(whole)) == len(whole) == 150  # every token penalised for the whole output
    assert len(set(off)) < len(off)


# -- hypothesis-generated cases -----------------------------------------------------------------

_CHARS = st.sampled_from(
    ["a", "b", "z", "0", " ", "\\n", "\\t", "\\x41", "\\u00e9", "\\\\", '\\"', "é", "中", "-"]
)
_NAMES = st.sampled_from(["root", "a", "b", "c", "item", "undefined-x"])


@st.composite
def _item(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(
        st.sampled_from(["lit", "lit", "class", "ref", "group", "dot", "token"] if depth < 3 else ["lit"])
    )
    if kind == "lit":
        text = '"' + "".join(draw(st.lists(_CHARS, min_size=0, max_size=4))) + '"'
    elif kind == "class":
        parts = draw(
            st.lists(
                st.sampled_from(["a", "a-z", "z-a", "0-9", "\\x00", "\\x00-\\U0010FFFF", "é"]), max_size=3
            )
        )
        text = "[" + draw(st.sampled_from(["", "^"])) + "".join(parts) + "]"
    elif kind == "ref":
        text = draw(_NAMES)
    elif kind == "group":
        alts = draw(st.lists(st.lists(_item(depth + 1), min_size=0, max_size=3), min_size=1, max_size=3))
        text = "(" + " | ".join(" ".join(a) for a in alts) + ")"
    elif kind == "dot":
        text = "."
    else:
        text = draw(st.sampled_from(["<[1]>", "<[5]>", "!<[2]>", "<[99999]>"]))
    suffix = draw(
        st.sampled_from(
            ["", "", "*", "+", "?", "{2}", "{1,3}", "{0,}", "{3,1}", "{0,1500}", "{2000}", "{5000}"]
        )
    )
    return text + suffix


@st.composite
def _grammar(draw: st.DrawFn) -> str:
    rules = []
    for name in [*draw(st.lists(_NAMES, min_size=1, max_size=4, unique=True)), "root"]:
        alts = draw(st.lists(st.lists(_item(), min_size=0, max_size=4), min_size=1, max_size=3))
        rules.append(f"{name} ::= " + " | ".join(" ".join(a) for a in alts))
    text = "\n".join(rules)
    if draw(st.booleans()) and draw(st.booleans()):  # a raw mutation
        i = draw(st.integers(0, len(text)))
        text = (
            text[:i] + draw(st.sampled_from(["(", ")", "|", "[", "]", '"', "::=", "\n", "{", "#"])) + text[i:]
        )
    return text


_BOUND = st.sampled_from([0, 1, 3, 10, -1, 1000, 1001, 50000, 2.5, True, "5", None])
_SCALAR = st.sampled_from([0, 1, -1.5, 1e308, float("nan"), float("inf"), "x", None, True, [], {}])


@st.composite
def _schema(draw: st.DrawFn, depth: int = 0) -> Any:
    kind = draw(
        st.sampled_from(["string", "array", "object", "number", "enum", "const", "ref", "anyOf", "raw"])
    )
    schema: dict[str, Any]
    if kind == "string":
        schema = {"type": "string"}
        for key in draw(st.lists(st.sampled_from(["minLength", "maxLength"]), unique=True)):
            schema[key] = draw(_BOUND)
        if draw(st.booleans()):
            schema["pattern"] = draw(
                st.sampled_from(
                    ["^a{0,20000}$", "^(a$", "^[b-a]$", "^ab?c{1,3}$", "a+", "^(x|y)*$", "^.{2}$"]
                )
            )
    elif kind == "array":
        items = draw(_schema(depth + 1)) if depth < 3 else {"type": "integer"}
        schema = {"type": "array", "items": items}
        for key in draw(st.lists(st.sampled_from(["minItems", "maxItems"]), unique=True)):
            schema[key] = draw(_BOUND)
    elif kind == "object":
        names = draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3))
        schema = {
            "type": "object",
            "properties": {
                n: (draw(_schema(depth + 1)) if depth < 3 else {"type": "boolean"}) for n in names
            },
            "required": names[: draw(st.integers(0, len(names)))],
        }
    elif kind == "number":
        schema = {"type": draw(st.sampled_from(["number", "integer", "numbr"])), "minimum": draw(_SCALAR)}
    elif kind == "enum":
        schema = {"enum": draw(st.lists(_SCALAR, max_size=3))}
    elif kind == "const":
        schema = {"const": draw(_SCALAR)}
    elif kind == "ref":
        schema = {
            "$ref": draw(
                st.sampled_from(["#/$defs/x", "#/$defs/missing", "https://h/x.json", "http://h/x", "x"])
            ),
            "$defs": {"x": {"type": "string", "maxLength": 3}},
        }
    elif kind == "anyOf":
        schema = {"anyOf": draw(st.lists(_schema(depth + 1), max_size=2)) if depth < 3 else []}
    else:
        schema = draw(st.sampled_from([{}, {"type": "null"}, {"type": ["string", "null"]}, {"items": 5}]))
    return schema


@st.composite
def _params(draw: st.DrawFn) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": draw(st.integers(1, 8))}
    if draw(st.booleans()):
        params["penalty_last_n"] = draw(st.sampled_from([-2, -1, 0, 64, 1 << 20, (1 << 20) + 1, 2**31 - 1]))
        params["repeat_penalty"] = draw(st.sampled_from([1.0, 1.1, 2.0]))
    if draw(st.booleans()):
        params["n"] = draw(st.sampled_from([1, 2, 3, 129]))
    if draw(st.booleans()):
        params["stop"] = draw(st.sampled_from([["a"], ["x" * 1025], ["s"] * 65, []]))
    if draw(st.booleans()):
        params["logit_bias"] = {str(t): draw(st.sampled_from([-100.0, float("-inf"), 5.0])) for t in range(3)}
    if draw(st.booleans()):
        params["grammar"] = draw(st.sampled_from(['root ::= "a"', "root ::= [a-z]+", 'root ::= "é"']))
        params["min_tokens"] = draw(st.integers(0, params["max_tokens"]))
    return params


def _fuzz(tmp_path: Path, n: int) -> None:
    cases = [
        {"name": f"grammar-{i}", "params": {"grammar": g, "max_tokens": 6}}
        for i, g in enumerate(draw_examples(_grammar(), n))
    ]
    cases += [
        {"name": f"schema-{i}", "params": {"json_schema": s, "max_tokens": 6}}
        for i, s in enumerate(draw_examples(_schema(), n))
    ]
    cases += [{"name": f"params-{i}", "params": p} for i, p in enumerate(draw_examples(_params(), n))]
    for case in cases:
        case["expect"] = "any"
    code, outcomes, died = run_cases(cases, tmp_path, timeout=120 + 2 * len(cases))
    _check(cases, code, outcomes, died)
    # What our validator passes, llama.cpp accepts: it is never looser than llama.cpp's parser.
    gaps = [
        (c["params"].get("grammar"), outcomes[c["name"]]["message"])
        for c in cases
        if "llama.cpp could not parse" in outcomes[c["name"]].get("message", "")
    ]
    assert not gaps, gaps[:3]
    results = [o["result"] for o in outcomes.values()]
    print(f"\n{len(cases)} cases: {results.count('ok')} completed, {results.count('ValueError')} refused")
    assert "ok" in results and "ValueError" in results
    (tmp_path / "cases-summary.json").write_text(json.dumps(results))


def test_fuzz_hostile_inputs(tmp_path: Path) -> None:
    _fuzz(tmp_path, BUDGET)


@pytest.mark.slow
def test_fuzz_hostile_inputs_long(tmp_path: Path) -> None:
    _fuzz(tmp_path, SLOW_BUDGET)
