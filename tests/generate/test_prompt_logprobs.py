"""``SamplingParams(prompt_logprobs=N)``: the log-probability of every prompt token given the
ones before it, on the real SmolLM2-135M. Under ``batch_invariant=True`` each one equals,
bit for bit, the log-probability the model gives that token when the prompt is cut just
before it and one token is generated (teacher forcing), whatever else runs in the batch,
across the prompt's chunks, with a cached prefix and with speculation on."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamabatch import LLM, LLMEngine, SamplingParams, testing
from llamabatch.errors import RequestTooLarge

ENGINE = dict(n_threads=2, n_threads_batch=2, batch_invariant=True, n_parallel=4)
SCORE = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(testing.real_model_path(), speculative_config={"method": "ngram"}, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def long_prompt(llm) -> list[int]:
    """Over 170 tokens: the rows SmolLM2's vocabulary allows a scoring slot in a tick."""
    text = (Path(__file__).parents[1] / "data" / "sentences_en.txt").read_text()
    return llm.tokenize(text)[:400]


def forced(llm: LLM, prompt: list[int], cut: int) -> float:
    """The log-probability of ``prompt[cut]`` after ``prompt[:cut]`` (one token generated)."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=0, allowed_token_ids=[prompt[cut]])
    [out] = llm.generate([prompt[:cut]], params, use_tqdm=False)
    return out.outputs[0].logprobs[0][prompt[cut]]


def test_each_prompt_token_scores_as_teacher_forcing(llm, long_prompt):
    busy = [
        "Count to ten: one, two,",  # greedy (the engine's own argmax path) and sampled rows
        "Repeat: a b c a b c a b c a b c",  # drafts (ngram)
    ]
    outs = llm.generate(
        [busy[0], long_prompt, busy[1]],
        [SamplingParams(max_tokens=24, temperature=0), SCORE, SamplingParams(max_tokens=24, temperature=0.8)],
        use_tqdm=False,
    )
    scores = outs[1].prompt_logprobs
    assert scores is not None and len(scores) == len(long_prompt) and scores[0] is None
    for i in range(1, len(long_prompt)):
        dist = scores[i]
        assert long_prompt[i] in dist and len(dist) in (2, 3)  # the top 2, and the prompt's token
        assert list(dist.values())[:2] == sorted(dist.values(), reverse=True)[:2]
        assert all(v <= 0 for v in dist.values()) and sum(math.exp(v) for v in dist.values()) <= 1 + 1e-6
    for cut in (1, 5, 170, 171, 341, 399):  # across the 170-row chunks
        assert scores[cut][long_prompt[cut]] == forced(llm, long_prompt, cut)
    # the others' answers are what they are alone
    [alone] = llm.generate([busy[0]], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].outputs[0].prompt_logprobs == scores  # the first completion carries them


def test_a_cached_prompt_is_scored_again_and_n_shares_it(llm, long_prompt):
    first = llm.generate([long_prompt[:200]], SCORE, use_tqdm=False)[0]
    again = llm.generate(
        [long_prompt[:200]], SamplingParams(max_tokens=2, prompt_logprobs=2, n=3), use_tqdm=False
    )[0]
    assert again.prompt_logprobs == first.prompt_logprobs  # computed from its start, not reused
    assert again.outputs[0].usage.reused_tokens == 0
    assert [o.prompt_logprobs is None for o in again.outputs] == [False, True, True]  # copied, not scored
    plain = llm.generate([long_prompt[:200]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].usage.reused_tokens == 199


def test_prompt_logprobs_are_checked():
    for bad in (-1, 101, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0


def test_prompt_logprobs_count_in_the_request_memory(llm, long_prompt):
    small = LLM(testing.real_model_path(), max_request_memory_mb=1, n_parallel=1, n_threads=2)
    with small, pytest.raises(RequestTooLarge, match="prompt_logprobs=100 of 400 prompt tokens"):
        small.generate([long_prompt], SamplingParams(max_tokens=1, prompt_logprobs=100), use_tqdm=False)


def test_a_preempted_scoring_request_scores_its_whole_prompt(llm, long_prompt):
    expected = llm.generate([long_prompt], SCORE, use_tqdm=False)[0].prompt_logprobs
    with LLMEngine(testing.real_model_path(), **{**ENGINE, "n_parallel": 1}) as engine:
        engine.add_request(long_prompt, SCORE, request_id="scored")
        engine.step()  # its first chunk
        engine.add_request("Hi", SamplingParams(max_tokens=3), request_id="urgent", priority=-1)
        done = {}
        while engine.has_unfinished_requests():
            done |= {s.request_id: s.output for s in engine.step() if s.finished}
        assert done["scored"].timings.preemptions == 1
        assert done["scored"].prompt_logprobs == expected
