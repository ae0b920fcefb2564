"""``SlotTable.move``: a decoding sequence changes slots between ticks (``compaction.py``)."""

from __future__ import annotations

import pytest

from llamabatch._core import BatchPool, SlotState, SlotTable

IDLE, DECODE = SlotState.IDLE, SlotState.DECODE


def _decoding(table: SlotTable, batch, slots: dict[int, list[int]]) -> None:
    """Start ``slots`` (slot -> prompt), compute their prompts and accept one token each."""
    for slot, prompt in slots.items():
        table.start(slot, prompt)
    table.fill(batch, "decode_maximal", 64)
    table.commit()
    for slot in slots:
        table.accept(slot, 100 + slot)


@pytest.mark.parametrize("kv_unified", [True, False])
def test_a_decoding_sequence_moves_with_its_tokens_lengths_and_cells(kv_unified):
    pool = BatchPool(n_batch=64)
    batch = pool.acquire()
    table = SlotTable(4, 32, 64, kv_unified=kv_unified, kv_size=64 if kv_unified else 0)
    _decoding(table, batch, {0: [1, 2, 3], 2: [4, 5, 6, 7]})
    used = table.cells_used
    arrival = table.arrival(2)
    table.move(2, 1)
    assert table.states() == [DECODE, DECODE, IDLE, IDLE]
    assert table.history(1).tolist() == [4, 5, 6, 7, 102] and table.n_past(1) == 4
    assert table.n_prompt(1) == 4 and table.n_generated(1) == 1 and table.arrival(1) == arrival
    assert table.history(2).tolist() == [] and table.seq_len(2) == 0
    assert table.cells_used == used
    table.check_kv()
    # the next fill decodes the moved sequence at its next position, in its new slot
    table.fill(batch, "decode_maximal", 64)
    assert sorted(batch.entries()) == [(100, 3, 0, True), (102, 4, 1, True)]
    table.commit()
    assert table.n_past(1) == 5
    table.check_kv()
    pool.release(batch)


def test_a_move_is_refused_where_it_would_lose_a_sequence():
    pool = BatchPool(n_batch=64)
    batch = pool.acquire()
    table = SlotTable(4, 32, 64, kv_unified=False)
    _decoding(table, batch, {0: [1, 2], 1: [3, 4]})
    table.start(3, [5, 6, 7])  # prefilling
    table.record_cached(2, [8, 9])  # an idle slot caching a prefix
    with pytest.raises(ValueError, match="not decoding"):
        table.move(3, 2)
    with pytest.raises(ValueError, match="not idle and empty"):
        table.move(0, 1)
    with pytest.raises(ValueError, match="not idle and empty"):
        table.move(0, 2)
    with pytest.raises(ValueError, match="onto itself"):
        table.move(0, 0)
    with pytest.raises(IndexError):
        table.move(0, 4)
    table.set_draft(0, [11, 12])
    table.fill(batch, "decode_maximal", 64)
    with pytest.raises(RuntimeError, match="fill is pending"):
        table.move(0, 2)
    table.rollback()
    table.trim(2, 0)
    table.move(0, 2)  # the draft stays behind: drafts are planned each tick
    assert table.states()[2] == DECODE and table.history(2).tolist() == [1, 2, 100]
    table.fill(batch, "decode_maximal", 64)
    assert table.draft_in_fill(2) == 0
    table.rollback()
    pool.release(batch)
