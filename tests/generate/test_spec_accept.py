"""The speculative acceptance rules on arrays, and processed_probs against llama.cpp's sampler."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llamabatch import SamplingParams
from llamabatch.generate.spec_accept import (
    accept_greedy,
    accept_sampled,
    acceptance_rule,
    processed_probs,
    sample_from,
)


def chi2_critical(df: int, z: float = 4.0) -> float:
    """The chi-square quantile ~z standard deviations out (Wilson-Hilferty): false alarms ~3e-5."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count < 5 lumped together; (stat, df)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    assert obs.sum() == counts.sum() or counts[probs == 0].sum() == 0
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def test_accept_greedy() -> None:
    assert accept_greedy([5, 6, 7], [5, 6]) == (2, 7)
    assert accept_greedy([5, 9, 7], [5, 6]) == (1, 9)
    assert accept_greedy([4, 6, 7], [5, 6]) == (0, 4)
    assert accept_greedy([3], []) == (0, 3)


def test_accept_sampled_equal_distributions_accepts_everything() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6), size=4)
    for seed in range(50):
        draft = [sample_from(p[i], np.random.default_rng(seed + 100 * i)) for i in range(3)]
        n, _ = accept_sampled(p, p[:3], draft, np.random.default_rng(seed))
        assert n == 3


def test_accept_sampled_disjoint_support_rejects_and_resamples_from_p() -> None:
    p = np.array([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([[0, 0, 1.0, 0]])
    for seed in range(20):
        n, token = accept_sampled(p, q, [2], np.random.default_rng(seed))
        assert n == 0 and token in (0, 1)


def test_accept_sampled_shape_checked() -> None:
    with pytest.raises(ValueError, match="target rows"):
        accept_sampled(np.ones((2, 3)) / 3, np.ones((2, 3)) / 3, [0, 1], np.random.default_rng())


@pytest.mark.parametrize("k", [1, 3])
def test_accept_sampled_keeps_the_target_distribution(k: int) -> None:
    """The emitted tokens at each position are distributed as p, whatever q is."""
    rng = np.random.default_rng(1234)
    n_vocab = 8
    p = rng.dirichlet(np.ones(n_vocab) * 0.7, size=k + 1)
    q = rng.dirichlet(np.ones(n_vocab) * 0.7, size=k)
    q[:, 0] = 0.0  # a token the draft never proposes but the target can emit
    q /= q.sum(axis=1, keepdims=True)
    trials = 12000
    first = np.zeros(n_vocab, np.int64)
    second = np.zeros(n_vocab, np.int64)
    for _ in range(trials):
        draft = [sample_from(q[i], rng) for i in range(k)]
        n, token = accept_sampled(p, q, draft, rng)
        emitted = [*draft[:n], token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    stat, df = chi2_stat(first, p[0])
    assert stat < chi2_critical(df), (stat, df)
    if k > 1:  # position 2's distribution is p[1] (p does not depend on the context here)
        stat, df = chi2_stat(second, p[1])
        assert stat < chi2_critical(df), (stat, df)


def test_acceptance_rule() -> None:
    assert acceptance_rule(SamplingParams(temperature=0)) == "greedy"
    assert acceptance_rule(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)) == "sampled"
    assert acceptance_rule(SamplingParams(temperature=0.7, logit_bias={3: 1.0})) == "sampled"
    assert acceptance_rule(SamplingParams(temperature=0.7, repeat_penalty=1.1)) == "match"
    assert acceptance_rule(SamplingParams(temperature=0.7, grammar='root ::= "a"')) == "match"
    assert acceptance_rule(SamplingParams(temperature=0.7, min_tokens=2)) == "match"


def test_processed_probs_by_hand() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    top2 = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    np.testing.assert_allclose(top2[0], [0.625, 0.375, 0, 0])
    top_p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0))
    np.testing.assert_allclose(top_p[0], [0.625, 0.375, 0, 0])  # 0.5 + 0.3 passes 0.75
    min_p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    np.testing.assert_allclose(min_p[0], [0.5, 0.3, 0.15, 0] / np.float64(0.95))
    hot = processed_probs(logits[0], SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0))
    expected = np.sqrt([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(hot, expected / expected.sum())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=1.5, top_k=0, top_p=0.7, min_p=0.0, logit_bias={300: 3.0}),
    ],
)
def test_processed_probs_matches_llama_cpp_sampler(params: SamplingParams) -> None:
    """Draws of llama.cpp's own sampler chain, over many seeds, follow processed_probs."""
    from llamabatch._ffi.context import Context
    from llamabatch._ffi.model import Model
    from llamabatch._ffi.sampler import SamplerChain
    from llamabatch.testing import draft_pair

    model = Model(draft_pair("vocab320").target)
    with Context(model, n_ctx=128, n_threads=1) as ctx:
        tokens = model.tokenize("The capital of France is")
        ctx.decode_tokens(tokens)
        p = processed_probs(ctx.logits_ith(len(tokens) - 1), params)
        counts = np.zeros(model.n_vocab, np.int64)
        for seed in range(3000):
            chain = SamplerChain(model, dataclasses.replace(params, seed=seed))
            counts[chain.sample(ctx, len(tokens) - 1)] += 1
            chain.close()
    assert counts[p == 0].sum() == 0
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df), (stat, df)
    model.close()
