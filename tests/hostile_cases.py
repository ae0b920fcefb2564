"""Hostile grammars, schemas and sampling parameters, and a child process that runs them.

``tests/test_hostile_inputs.py`` writes cases (JSON) to a file and runs this module as a child
process: ``python hostile_cases.py CASES RESULTS``. The child loads the tiny test model once and
puts every case through ``LLM.generate``, writing a line to RESULTS before (``start``) and after
each case, so that a crash (the child killed by a signal, or ``std::terminate``) is a test
failure that names the case, not a lost run.

A case is ``{"name", "params": SamplingParams kwargs, "expect"}``: ``expect`` is ``"error"``
(a ``ValueError``), ``"ok"`` (completions), ``"finish_error"`` (completions that end with
``finish_reason="error"``) or ``"any"`` (a ``ValueError`` or completions). Outcomes are
``{"result": "ok", "outputs": [...]}`` or ``{"result": "<exception type>", "message": ...}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: A deeply nested raw grammar (issue 26, defect 1): llama.cpp's parser recursed once per level.
NESTED_GROUPS = 20_000


def issue_cases() -> list[dict[str, Any]]:
    """The in-process reproductions of issue 26 (defects 1, 2, 3, 9, 10, 11), and the grammar
    crashes found while fixing them."""
    nested = "root ::= " + "(" * NESTED_GROUPS + '"a"' + ")" * NESTED_GROUPS
    calls = "root ::= r0\n" + "\n".join(f"r{k} ::= r{k + 1} | r{k + 1}" for k in range(34)) + '\nr34 ::= "a"'
    stacks = (
        "root ::= r0\n"
        + "\n".join(f'r{k} ::= r{k + 1} "a" | r{k + 1} "b"' for k in range(30))
        + '\nr30 ::= "a"'
    )
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^[b-a]$"}},
    }
    cases: list[tuple[str, dict[str, Any], str]] = [
        # defect 1: deep grammars overflowed the stack
        ("d1_maxLength", {"json_schema": {"type": "string", "maxLength": 50000}}, "error"),
        (
            "d1_maxItems",
            {"json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 100000}},
            "error",
        ),
        ("d1_pattern", {"json_schema": {"type": "string", "pattern": "^a{0,20000}$"}}, "error"),
        ("d1_nested_groups", {"grammar": nested}, "error"),
        (
            "d1_maxLength_at_limit",
            {"json_schema": {"type": "string", "maxLength": 1000}, "max_tokens": 8},
            "ok",
        ),
        ("d1_maxItems_at_limit", {"json_schema": {"type": "array", "maxItems": 1000}, "max_tokens": 8}, "ok"),
        # defect 2: a grammar that admits no token ended the process (std::terminate)
        ("d2_inverted_range", {"grammar": "root ::= [b-a]"}, "error"),
        ("d2_response_format", {"response_format": rf}, "error"),
        # defect 3: repeat_last_n (penalty_last_n) sized a 2**31-entry buffer
        ("d3_penalty_last_n", {"penalty_last_n": 2**31 - 1, "repeat_penalty": 1.1}, "error"),
        ("d3_penalty_window_clamped", {"penalty_last_n": 1 << 20, "repeat_penalty": 1.1}, "ok"),
        # defect 9: a remote $ref (the converter's check was an assert; see the -O test)
        ("d9_remote_ref", {"json_schema": {"$ref": "https://127.0.0.1:9/x.json"}}, "error"),
        ("d9_http_ref", {"json_schema": {"$ref": "http://127.0.0.1:9/x.json"}}, "error"),
        # defect 10: -1 is the whole context (checked by the greedy test in test_hostile_inputs)
        ("d10_whole_context", {"penalty_last_n": -1, "repeat_penalty": 1.3}, "ok"),
        # defect 11: invalid schemas, NaN, an empty enum
        ("d11_const_nan", {"json_schema": {"const": float("nan")}}, "error"),
        ("d11_const_inf_text", {"json_schema": '{"const": Infinity}'}, "error"),
        ("d11_bad_pattern", {"json_schema": {"type": "string", "pattern": "^(a$"}}, "error"),
        ("d11_bad_minimum", {"json_schema": {"type": "number", "minimum": "x"}}, "error"),
        ("d11_empty_enum", {"response_format": {"type": "json_object", "schema": {"enum": []}}}, "error"),
        # found while fixing: each crashed or hung llama.cpp
        ("inverted_repetition", {"grammar": 'root ::= "a"{5,2}'}, "error"),  # looped until OOM
        ("exponential_left_recursion_check", {"grammar": calls}, "error"),  # hung
        ("exponential_stacks", {"grammar": stacks}, "error"),  # hung
        ("nullable_left_recursion", {"grammar": 'root ::= y root "a" | "b"\ny ::= z\nz ::= | "c"'}, "error"),
        ("unproductive", {"grammar": 'root ::= "a" x\nx ::= "b" x'}, "error"),
        ("empty_class", {"grammar": "root ::= []"}, "error"),
        ("negated_everything", {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}, "error"),
        # valid grammars that reach a dead end at run time: the request ends with "error"
        (
            "dead_end_min_tokens",
            {"grammar": 'root ::= "a"', "min_tokens": 4, "max_tokens": 8},
            "finish_error",
        ),
        ("dead_end_token_id", {"grammar": "root ::= <[999999]>", "max_tokens": 4}, "finish_error"),
        # an ambiguous grammar: its parse stacks multiply with every "a" (40 s for 60 tokens on the
        # tiny model before, the engine thread frozen); now it ends past GrammarLimits.max_live_stacks
        (
            "ambiguous_grammar",
            {"grammar": 'root ::= r{0,100}\nr ::= "a"{0,100}', "min_tokens": 60, "max_tokens": 60},
            "finish_error",
        ),
        # a lazy grammar whose trigger the grammar does not accept: llama.cpp throws when it
        # replays the triggering text into the grammar (caught in C++, the request ends)
        (
            "lazy_trigger_mismatch",
            {
                "grammar": 'root ::= "zz"',
                "grammar_triggers": ["e"],
                "max_tokens": 40,
                "temperature": 1.0,
                "seed": 1,
            },
            "any",
        ),
    ]
    return [{"name": name, "params": params, "expect": expect} for name, params, expect in cases]


def _params(raw: dict[str, Any]) -> dict[str, Any]:
    params = dict(raw)
    if isinstance(params.get("logit_bias"), dict):
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    return params


def run_child(cases_path: str, results_path: str) -> None:
    """The child: every case through ``LLM.generate`` on the tiny model."""
    from llamabatch import LLM, SamplingParams
    from llamabatch.gguf.testing import model_path

    cases = json.loads(Path(cases_path).read_text())
    with (
        LLM(model_path("tiny"), n_ctx=512, n_parallel=2, n_threads=1) as llm,
        open(results_path, "a", encoding="utf-8") as out,
    ):
        for case in cases:
            out.write(json.dumps({"name": case["name"], "start": True}) + "\n")
            out.flush()
            try:
                params = SamplingParams(**_params(case["params"]))
                result = llm.generate([case.get("prompt", "Hi")], params, use_tqdm=False)[0]
                outputs = [
                    {
                        "finish_reason": c.finish_reason,
                        "text": c.text,
                        "error": c.error,
                        "token_ids": c.token_ids,
                    }
                    for c in result.outputs
                ]
                record: dict[str, Any] = {"result": "ok", "outputs": outputs}
            except ValueError as exc:
                record = {"result": "ValueError", "message": str(exc)}
            except Exception as exc:  # reported, and judged by the parent
                record = {"result": type(exc).__name__, "message": str(exc)}
            out.write(json.dumps({"name": case["name"], **record}) + "\n")
            out.flush()


def run_cases(
    cases: list[dict[str, Any]],
    tmp: Path,
    *,
    timeout: float = 300.0,
    optimize: bool = False,
    pythonpath: str | None = None,
) -> tuple[int, dict[str, dict[str, Any]], str | None]:
    """Run ``cases`` in a child: ``(exit code, {name: outcome}, the case it died in or None)``."""
    cases_path = tmp / "cases.json"
    results_path = tmp / "results.jsonl"
    cases_path.write_text(json.dumps(cases))
    results_path.write_text("")
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    command = [sys.executable, *(["-O"] if optimize else []), str(Path(__file__).resolve())]
    try:
        proc = subprocess.run(
            [*command, str(cases_path), str(results_path)],
            env=env,
            timeout=timeout,
            capture_output=True,
            text=True,
            errors="replace",
        )
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = -999
    outcomes: dict[str, dict[str, Any]] = {}
    last_started = None
    for line in results_path.read_text().splitlines():
        record = json.loads(line)
        if record.get("start"):
            last_started = record["name"]
        else:
            outcomes[record["name"]] = record
            last_started = None
    return code, outcomes, last_started


def judge(case: dict[str, Any], outcome: dict[str, Any] | None) -> str | None:
    """None when ``outcome`` is what ``case`` expects, else what is wrong."""
    if outcome is None:
        return "no outcome (the child died or hung on it)"
    result, expect = outcome["result"], case["expect"]
    if result not in ("ok", "ValueError"):
        return f"raised {result}: {outcome.get('message')}"
    if expect == "error" and result != "ValueError":
        return f"expected a ValueError, got completions {outcome.get('outputs')!r:.200}"
    if expect in ("ok", "finish_error") and result != "ok":
        return f"expected completions, got ValueError {outcome.get('message')}"
    if result == "ok":
        reasons = {o["finish_reason"] for o in outcome["outputs"]}
        if expect == "finish_error" and reasons != {"error"}:
            return f"expected finish_reason 'error', got {reasons}"
        if expect == "ok" and "error" in reasons:
            return f"a completion failed: {outcome['outputs']!r:.200}"
    return None


if __name__ == "__main__":
    run_child(sys.argv[1], sys.argv[2])
