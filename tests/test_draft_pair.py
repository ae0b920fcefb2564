"""The draft/target test pairs of llamabatch.testing, checked with the real llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch.testing import PAIR_PRESETS, draft_pair


def _logprobs(path, tokens: list[int]) -> np.ndarray:
    model = Model(path)
    try:
        with Context(model, n_ctx=256, n_threads=1) as ctx:
            ctx.decode_tokens(tokens, all_logits=True)
            logits = ctx.logits_rows(len(tokens)).astype(np.float64)
        return (
            logits
            - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
            - logits.max(1, keepdims=True)
        )
    finally:
        model.close()


def test_tiny_pair_target_has_the_drafts_logits() -> None:
    pair = draft_pair("tiny")
    draft, target = Model(pair.draft, vocab_only=True), Model(pair.target, vocab_only=True)
    assert target.n_layer == 4 * draft.n_layer and target.n_vocab == draft.n_vocab
    tokens = draft.tokenize("The quick brown fox jumps over the lazy dog, again and again.")
    np.testing.assert_allclose(_logprobs(pair.target, tokens), _logprobs(pair.draft, tokens), atol=1e-4)


def test_vocab320_pair_disagrees() -> None:
    pair = draft_pair("vocab320")
    tokens = Model(pair.draft, vocab_only=True).tokenize("The quick brown fox")
    a, b = _logprobs(pair.draft, tokens), _logprobs(pair.target, tokens)
    assert a.shape == b.shape == (len(tokens), 320)
    assert np.abs(a - b).max() > 1.0


def test_135m_pair_shapes() -> None:
    draft, target, zero_from = PAIR_PRESETS["135m"]
    assert (draft.n_layer, target.n_layer, zero_from) == (4, 30, 4)
    assert draft.n_vocab == target.n_vocab and draft.seed == target.seed


def test_unknown_pair() -> None:
    with pytest.raises(ValueError, match="unknown draft pair"):
        draft_pair("huge")
