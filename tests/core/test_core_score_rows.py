"""The slot table's scoring slots (prompt log-probabilities): every prompt row computed has
logits, at most ``score_chunk`` rows a tick, whatever the strategy plans."""

from __future__ import annotations

from array import array

import pytest

from llamabatch._core import BatchPool, SlotState, SlotTable


@pytest.fixture
def pool():
    p = BatchPool(n_batch=64)
    yield p
    assert p.n_outstanding == 0


class Greedy:
    """A user strategy that plans every pending prompt token, past the chunk size."""

    name = "greedy-plan"

    def plan(self, view, budget, chunk_size, queue_depth):
        return [(s, view.n_pending(s)) for s in view.prefill_slots] + [(s, 1) for s in view.decode_slots]


@pytest.mark.parametrize("strategy", ["decode_maximal", "balanced", Greedy()])
def test_a_scoring_slot_has_every_prompt_row_in_chunks(pool, strategy):
    t = SlotTable(n_parallel=3, n_ctx_seq=32, chunk_size=16)
    b = pool.acquire()
    t.start(0, array("i", range(100, 110)), score_chunk=4)  # 10 tokens: 4 + 4 + 2
    t.start(1, array("i", range(200, 205)))  # an ordinary prompt beside it
    seen = []
    while t.state(0) == SlotState.PREFILL:
        t.fill(b, strategy, 64)
        k, first = t.tokens_in_batch(0), t.batch_index(0)
        rows = b.entries()[first : first + k]
        assert all(flag for *_, flag in rows) and k <= 4
        others = [flag for tok, pos, seq, flag in b.entries() if seq != 0]
        assert t.n_score_rows == k and sum(others) <= 1  # the other prompt: its last row only
        seen += [pos for _, pos, _, _ in rows]
        t.commit()
    assert seen == list(range(10))
    assert (0, first + k - 1) in t.outputs()  # the last prompt row is also sampled
    t.finish(0)
    t.finish(1)
    t.start(0, array("i", [1, 2, 3]))  # the flag does not outlive its request
    t.fill(b, "decode_maximal", 64)
    assert t.n_score_rows == 0 and [flag for *_, flag in b.entries()] == [False, False, True]
    t.rollback()
    pool.release(b)


def test_score_chunk_is_checked(pool):
    t = SlotTable(n_parallel=1, n_ctx_seq=8)
    with pytest.raises(ValueError, match="score_chunk must be >= 0"):
        t.start(0, [1, 2], score_chunk=-1)
    assert t.state(0) == SlotState.IDLE
