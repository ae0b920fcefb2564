"""Greedy sampling under a grammar checks the chain's own best token first (the C helper in
``_ffi/_build.py``): when the grammar allows it, it is the best token the grammar allows,
so the grammar is matched against one token instead of the vocabulary (llama.cpp's common
sampler does the same). These tests hold it to the whole-vocabulary path, token for token, on
the real model: ``temperature=1, top_k=0, top_p=1e-6`` ends the chain in a draw over the one
best candidate the grammar allows, which no shortcut touches (top-k, when on, has one of its
own: ``test_grammar_top_k.py``), and picks the same token greedy does."""

from __future__ import annotations

import pytest
from grammar_chains import DIGITS

from llamabatch import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
#: the model's own next token is rarely a digit: most steps fall back to the whole vocabulary
PROMPTS = ["Describe a cat as JSON.", "Count from one to ten.", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(str(smollm2_path), n_ctx=2048, n_parallel=1, n_threads=2) as llm:
        yield llm


def _tokens(llm: LLM, prompt: str, **params) -> list[int]:
    out = llm.generate(prompt, SamplingParams(max_tokens=40, **params), use_tqdm=False)[0]
    return out.outputs[0].token_ids


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_schema": SCHEMA},
        {"grammar": DIGITS},
        {"grammar": DIGITS, "logit_bias": {15: 5.0, 16: -3.0}, "repeat_penalty": 1.3},
    ],
    ids=["schema", "digits", "digits-bias-penalty"],
)
def test_greedy_under_a_grammar_picks_what_the_whole_vocabulary_path_picks(llm, constraint):
    for prompt in PROMPTS:
        greedy = _tokens(llm, prompt, temperature=0, **constraint)
        whole = _tokens(llm, prompt, temperature=1.0, top_k=0, top_p=1e-6, seed=1, **constraint)
        assert greedy == whole, prompt
        assert len(greedy) > 3


def test_a_grammar_dead_end_is_still_found_greedy(llm):
    """The shortcut's check fails at a dead end (no token allowed), and the whole-vocabulary
    path then reports it as before."""
    params = SamplingParams(max_tokens=8, temperature=0, grammar='root ::= "a"', min_tokens=3)
    out = llm.generate("Hi", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and "admits no token" in out.error
