"""The reference check of generated tokens: teacher-forcing llama-cpp-python on the same file."""

from __future__ import annotations

import numpy as np
import pytest

#: float noise between batched and single-sequence runs (flash attention off on both sides)
LOGPROB_TOLERANCE = 1e-3


def reference_log_softmax(reference, prompt_tokens: list[int], generated: list[int]) -> np.ndarray:
    """Rows of log-probabilities the reference gives for each generated position."""
    reference.reset()
    reference.eval(prompt_tokens + generated)
    logits = np.asarray(reference.scores[: reference.n_tokens], dtype=np.float64)
    rows = logits[len(prompt_tokens) - 1 : len(prompt_tokens) - 1 + len(generated)]
    peak = rows.max(axis=1, keepdims=True)
    return rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))


def check_against_reference(reference, outs, top_n: int = 0) -> None:
    """Each reported log-prob equals the reference's log-softmax at that position, the chosen
    (greedy) token is the reference's argmax, and the reported top-``top_n`` are among the
    reference's most likely tokens, all within float noise."""
    for out in outs:
        log_softmax = reference_log_softmax(reference, out.prompt_token_ids, out.token_ids)
        for row, token, logprobs in zip(log_softmax, out.token_ids, out.logprobs, strict=True):
            assert logprobs[token] == pytest.approx(row[token], abs=LOGPROB_TOLERANCE)
            assert row[token] >= row.max() - LOGPROB_TOLERANCE
            if top_n:
                top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top_n]
                assert {t for t, _ in top} <= set(np.argsort(-row)[: top_n + 1].tolist())
