"""Draft-model speculative decoding through the engine, with the real llama.cpp.

The tiny draft/target pair (``llamabatch.testing.draft_pair("tiny")``): the target has exactly
the draft's logits, so every greedy draft is accepted, and greedy outputs must equal the
teacher-forced reference of the target. The vocab320 pair (an independent draft) checks that
sampled requests keep the target's distribution.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from llama_reference import check_against_reference

from llamabatch import LLM, SamplingParams, testing
from llamabatch.bench.runners.llama_cpp import load_llama_cpp
from llamabatch.errors import DraftModelMismatch
from llamabatch.generate import speculative
from llamabatch.generate.spec_accept import processed_probs
from llamabatch.generate.spec_policy import SpecPolicy

llama_cpp = pytest.importorskip("llama_cpp")

K = 4


def _spec(draft, k: int = K) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def _prompts(n: int) -> list[str]:
    sentences = testing.english_sentences(32)
    return [" ".join(sentences[i : i + 1 + i % 3]) for i in range(n)]


@pytest.fixture(autouse=True)
def always_draft(monkeypatch):
    """These tests check what verification does with drafts: drafting must happen whatever
    this machine's timings say it is worth (margin -1: any draft beats none; no bound on
    what drafts cost)."""
    monkeypatch.setattr(speculative, "SpecPolicy", lambda: SpecPolicy(margin=-1.0, loss_share=None))


@pytest.fixture(scope="module")
def pair():
    return testing.draft_pair("tiny")


def test_greedy_outputs_equal_the_target_alone(pair) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)
    prompts = _prompts(6)
    kwargs = dict(n_ctx=2048, n_parallel=4, n_batch=128, n_threads=1, flash_attn=False)
    with LLM(pair.target, speculative_config=_spec(pair.draft), **kwargs) as llm:
        spec = [o.outputs[0] for o in llm.generate(prompts, params)]
        stats = llm.stats()
    with LLM(pair.target, **kwargs) as llm:
        plain = [o.outputs[0] for o in llm.generate(prompts, params)]
    reference = load_llama_cpp(
        str(pair.target), n_ctx=1024, n_batch=512, logits_all=True, verbose=False, flash_attn=False
    )
    check_against_reference(reference, spec, top_n=2)
    check_against_reference(reference, plain, top_n=2)
    for a, b in zip(spec, plain, strict=True):
        assert len(a.token_ids) == len(b.token_ids) == 24
    # the pair's target has the draft's logits: (nearly) every draft is accepted
    drafted = sum(o.timings.spec_draft_tokens or 0 for o in spec)
    accepted = sum(o.timings.spec_accepted_tokens or 0 for o in spec)
    assert drafted > 0 and accepted >= 0.9 * drafted, (drafted, accepted, stats)


def test_draft_with_another_vocabulary_is_refused_at_load(pair) -> None:
    other = testing.draft_pair("vocab320").draft
    with pytest.raises(DraftModelMismatch, match="vocabularies differ"):
        LLM(pair.target, n_ctx=512, n_parallel=2, speculative_config=_spec(other))
    with pytest.raises(FileNotFoundError):
        LLM(pair.target, n_ctx=512, n_parallel=2, speculative_config=_spec("/nonexistent/draft.gguf"))


def test_sampled_requests_keep_the_target_distribution() -> None:
    """Many seeded requests, a draft that disagrees: the second generated token (the first a
    draft can propose) follows the target's distribution given the first (chi-square)."""
    pair = testing.draft_pair("vocab320")
    params = [
        # (3 tokens: a draft of the second may save a tick; with 2 no draft is worth making)
        SamplingParams(max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s, ignore_eos=True)
        for s in range(1504)
    ]
    prompt = "Once upon a time"
    with LLM(
        pair.target, n_ctx=4096, n_parallel=4, n_threads=1, speculative_config=_spec(pair.draft, 2)
    ) as llm:
        outs = []  # 4 at a time
        for i in range(0, len(params), 4):
            outs += [o.outputs[0] for o in llm.generate([prompt] * 4, params[i : i + 4])]
        tokens = llm.model.tokenize(prompt)
    drafted = sum(o.timings.spec_draft_tokens or 0 for o in outs)
    accepted = sum(o.timings.spec_accepted_tokens or 0 for o in outs)
    assert drafted > len(outs) // 2 and 0 < accepted < drafted, (drafted, accepted)
    first = np.array([o.token_ids[0] for o in outs])
    second = np.array([o.token_ids[1] for o in outs])
    reference = load_llama_cpp(str(pair.target), n_ctx=256, logits_all=True, verbose=False)
    expected = np.zeros(320)
    for t1 in np.unique(first):
        reference.reset()
        reference.eval([*tokens, int(t1)])
        row = np.asarray(reference.scores[reference.n_tokens - 1], dtype=np.float64)
        expected += processed_probs(row, params[0]) * (first == t1).sum()
    counts = np.bincount(second, minlength=320)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    stat, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    assert stat < df * (1 - 2 / (9 * df) + 4.0 * (2 / (9 * df)) ** 0.5) ** 3, (stat, df)


def _drafter_is_empty(llm: LLM) -> None:
    drafter = llm.core.spec.drafter
    assert drafter.n_free_sequences == llm.n_parallel
    for seq in range(llm.n_parallel):
        assert drafter.context.seq_pos_max(seq) == -1


def test_draft_kv_under_preemption_and_cancel(pair) -> None:
    """Preempted requests (a KV cache too small for all) are recomputed and still equal the
    reference; cancelled ones free their draft sequence; at the end the draft KV is empty."""
    params = SamplingParams(max_tokens=60, temperature=0, logprobs=1, ignore_eos=True)
    prompts = _prompts(4)
    with LLM(
        pair.target,
        n_ctx=256,
        n_parallel=4,
        n_batch=64,
        n_threads=1,
        flash_attn=False,
        kv_unified=True,
        speculative_config=_spec(pair.draft),
    ) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert sum(o.timings.preemptions for o in outs) > 0
        assert sum(o.timings.spec_draft_tokens or 0 for o in outs) > 0
        _drafter_is_empty(llm)
        handles = [
            llm.submit(p, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)) for p in prompts
        ]
        for h in handles[:2]:
            h.cancel()
        ends = [h.result(timeout=60).outputs[0].finish_reason for h in handles]
        assert ends[:2] == ["cancelled"] * 2 or ends[:2] != ["length"] * 2, ends
        deadline = time.monotonic() + 10
        while llm.stats().busy_slots and time.monotonic() < deadline:
            time.sleep(0.01)
        _drafter_is_empty(llm)
    reference = load_llama_cpp(
        str(pair.target), n_ctx=1024, n_batch=512, logits_all=True, verbose=False, flash_attn=False
    )
    check_against_reference(reference, outs)


def test_seeded_sampled_requests_are_reproducible(pair) -> None:
    """Rule "sampled" (plain temperature sampling): the same seed gives the same tokens run after
    run. Rule "match" (a repetition penalty: the target's own sampler chain decides every
    token): the same tokens as without speculation, seed for seed."""
    kwargs = dict(n_ctx=1024, n_parallel=2, n_threads=1, flash_attn=False)
    prompts = _prompts(2)
    sampled = [SamplingParams(max_tokens=24, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(2)]
    match = [
        SamplingParams(max_tokens=24, temperature=0.9, repeat_penalty=1.2, seed=11 + i, ignore_eos=True)
        for i in range(2)
    ]
    with LLM(pair.target, speculative_config=_spec(pair.draft), **kwargs) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
        spec_match = [o.outputs[0] for o in llm.generate(prompts, match)]
    with LLM(pair.target, **kwargs) as llm:
        plain_match = [o.outputs[0] for o in llm.generate(prompts, match)]
    assert first == again
    assert [o.token_ids for o in spec_match] == [o.token_ids for o in plain_match]
    assert sum(o.timings.spec_draft_tokens or 0 for o in spec_match) > 0
