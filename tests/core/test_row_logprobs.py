"""``row_logprobs`` (``generate/sample_rows.py`` over ``_core/logprobs.pyx``): a logits row's
log-probabilities in one pass in C, equal to the float64 numpy computation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch._core.logprobs import row_top_logprobs
from llamabatch.generate.sample_rows import row_logprobs


class Rows:
    """The one method of a ``Context`` that ``row_logprobs`` reads."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def logits_view(self, idx: int) -> np.ndarray:
        return self.logits[idx]


def reference(logits: np.ndarray, token: int, n: int) -> dict[int, float]:
    """float64 log-softmax; the ``n`` best by logit, the lower id first among equals."""
    values = logits.astype(np.float64)
    peak = values.max()
    lse = peak + np.log(np.exp(values - peak).sum())
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))[:n]
    out = {i: float(values[i] - lse) for i in order}
    out[token] = float(values[token] - lse)
    return out


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    n_vocab=st.integers(1, 300),
    n=st.integers(0, 30),
    coarse=st.booleans(),
)
def test_row_logprobs_equal_the_float64_reference(data, n_vocab: int, n: int, coarse: bool) -> None:
    values = data.draw(st.lists(st.floats(-60, 60, width=32), min_size=n_vocab, max_size=n_vocab))
    logits = np.array(values, dtype=np.float32)
    if coarse:  # many equal logits: the order of ties is the lower id first
        logits = np.round(logits / 20) * 20
    token = data.draw(st.integers(0, n_vocab - 1))
    got = row_logprobs(Rows(logits[None, :]), 0, token, n, n_vocab)
    want = reference(logits, token, min(n, n_vocab))
    assert list(got) == list(want)
    assert np.allclose(list(got.values()), list(want.values()), rtol=0, atol=1e-9)


def test_ties_go_to_the_lower_id_and_bad_rows_are_refused() -> None:
    logits = np.zeros(8, dtype=np.float32)
    logits[[5, 2, 7]] = 1.0
    assert list(row_top_logprobs(logits, 2, 0)) == [2, 5, 0]
    assert list(row_top_logprobs(logits, 3, 7)) == [2, 5, 7]
    assert list(row_top_logprobs(logits, 0, -1)) == []
    with pytest.raises(ValueError, match="empty"):
        row_top_logprobs(np.zeros(0, dtype=np.float32), 1, 0)
    with pytest.raises(ValueError, match="outside"):
        row_top_logprobs(logits, 1, 8)
