"""vLLM's structured outputs besides JSON: ``regex`` (``guided_regex``) and ``choice``
(``guided_choice``), as grammars over the whole output."""

from __future__ import annotations

import re

import pytest

from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import model_path
from llamabatch.prompts.text_grammar import MAX_CHOICES, choice_grammar, regex_grammar

PATTERNS = [
    "[A-Z]{2}-\\d{1,3}",
    "(x|yz){1,3}",
    '"[^a-z]{1,3}',
    ".{1,4}",
    "a]",
    "\\{[a-z]{0,5}}",
    "^(cat|dog)s?$",
    "[\\s\\S]{2}",
    "^ab$|^cd$",
]


@pytest.fixture(scope="module")
def llm():
    with LLM(model_path("tiny"), n_ctx=2048, n_parallel=4, n_threads=1) as llm:
        yield llm


def test_outputs_match_the_pattern_whole(llm):
    """A random-weight model at temperature 1 writes only what the pattern matches, whole, by
    Python's ``re`` (the grammar is a subset of the pattern's language)."""
    for pattern in PATTERNS:
        params = SamplingParams(regex=pattern, max_tokens=64, temperature=1.0, top_k=0, seed=7, n=3)
        for out in llm.generate(["Answer:", "x"], params, use_tqdm=False):
            for completion in out.outputs:
                assert completion.finish_reason == "stop", (pattern, completion.text)
                assert re.fullmatch(pattern, completion.text), (pattern, completion.text)


def test_outputs_are_one_of_the_choices(llm):
    choices = ["yes", "no", 'maybe "so"', "é ü"]
    params = SamplingParams(choice=choices, max_tokens=16, temperature=1.0, top_k=0, seed=3, n=8)
    seen = {c.text for out in llm.generate(["Answer:"], params, use_tqdm=False) for c in out.outputs}
    assert seen <= set(choices) and len(seen) > 1


def test_the_grammars():
    assert regex_grammar("\\d{3}") == "root ::= [0-9]{3}\n"
    assert regex_grammar("^a$|^b$", what="regex") == 'root ::= ("a" | "b")\n'
    assert choice_grammar(["a", "b", "a"]) == 'root ::= "a" | "b"\n'  # each once


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"regex": "(a)\\1"}, r"regex is not supported: backreferences"),
        ({"regex": "a(?=b)"}, r"regex is not supported: lookahead"),
        ({"regex": "a^b"}, r"regex is not supported: the anchors"),
        ({"regex": "(a"}, r"regex: pattern at the output is not a valid regular expression"),
        ({"regex": "a{5000}"}, r"regex: the quantifier \{5000\}.*GrammarLimits\.max_repetition"),
        ({"regex": ""}, r"regex must be a non-empty string"),
        ({"choice": []}, r"choice must hold 1 to"),
        ({"choice": ["a"] * (MAX_CHOICES + 1)}, r"choice must hold 1 to"),
        ({"choice": ["a", ""]}, r"choice items must be non-empty strings"),
        (
            {"choice": ["a"], "json_schema": {"type": "string"}},
            r"choice conflicts with SamplingParams\.json_schema",
        ),
        ({"regex": "a", "grammar": 'root ::= "a"'}, r"regex conflicts with SamplingParams\.grammar"),
    ],
)
def test_bad_constraints_name_their_field(fields, message):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{message}"):
        SamplingParams(**fields)


def test_over_http_with_vllm_names(llm):
    """``guided_regex`` and ``guided_choice`` (vLLM's request fields) constrain the answer."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import serve

    from llamabatch.server import create_app

    with serve(create_app(llm, model_name="tiny")) as url:
        body = {"prompt": "Code:", "max_tokens": 16, "temperature": 1.0, "seed": 1}
        r = httpx.post(f"{url}/v1/completions", json={**body, "guided_regex": "[A-Z]{3}\\d"}).json()
        assert re.fullmatch("[A-Z]{3}\\d", r["choices"][0]["text"])
        messages = [{"role": "user", "content": "Pick one."}]
        chat = {"messages": messages, "max_tokens": 8, "guided_choice": ["red", "blue"]}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat).json()
        assert r["choices"][0]["message"]["content"] in ("red", "blue")
        bad = httpx.post(f"{url}/v1/completions", json={**body, "guided_regex": "(a)\\1"})
        assert bad.status_code == 400 and "backreferences" in bad.json()["error"]["message"]
