"""The slot table: lifecycle, fill/commit/rollback, outputs, user strategy validation, no allocation."""

from __future__ import annotations

import gc
import tracemalloc
from array import array

import numpy as np
import pytest

from llamabatch._core import EDGES, BatchPool, DecodeMaximal, SlotState, SlotTable, slot_record, user_plans
from llamabatch._core import slots as slots_mod
from llamabatch.errors import PromptTooLong

IDLE, PREFILL, AWAIT, DECODE = SlotState.IDLE, SlotState.PREFILL, SlotState.AWAIT_SAMPLE, SlotState.DECODE


@pytest.fixture
def pool():
    p = BatchPool(n_batch=64)
    yield p
    assert p.n_outstanding == 0


def snapshot(t):
    """Everything observable about a table."""
    return (
        t.states(),
        [t.n_past(i) for i in range(t.n_parallel)],
        [t.n_pending(i) for i in range(t.n_parallel)],
        [t.history(i).tolist() for i in range(t.n_parallel)],
        t.last_plan(),
        t.outputs(),
        t.last_fill_stats,
        t.decode_cursor,
        t.fill_pending,
        [t.tokens_in_batch(i) for i in range(t.n_parallel)],
    )


def test_lifecycle_and_chunked_prefill(pool):
    t = SlotTable(n_parallel=2, n_ctx_seq=16, chunk_size=3)
    b = pool.acquire()
    t.start(0, array("i", [10, 11, 12, 13, 14]))
    assert (t.state(0), t.n_pending(0), t.n_past(0), t.n_prompt(0)) == (PREFILL, 5, 0, 5)
    assert t.fill(b, "decode_maximal", 64) == 3
    assert b.entries() == [(10, 0, 0, False), (11, 1, 0, False), (12, 2, 0, False)]
    assert t.n_outputs == 0 and t.outputs() == []
    assert t.state(0) == PREFILL and t.n_past(0) == 0  # nothing changes before commit
    t.commit()
    assert (t.state(0), t.n_past(0), t.n_pending(0)) == (PREFILL, 3, 2)
    assert t.fill(b, "decode_maximal", 64) == 2
    assert b.entries() == [(13, 3, 0, False), (14, 4, 0, True)]  # positions continue
    assert t.outputs() == [(0, 1)]
    assert t.out_slot.tolist() == [0] and t.out_index.tolist() == [1]
    t.commit()
    assert t.state(0) == AWAIT and t.n_past(0) == 5
    t.accept(0, 99)
    assert t.state(0) == DECODE and t.history(0).tolist() == [10, 11, 12, 13, 14, 99]
    assert t.n_generated(0) == 1
    assert t.fill(b, DecodeMaximal(), 64) == 1
    assert b.entries() == [(99, 5, 0, True)]
    assert t.last_fill_stats == (1, 0) and t.tokens_in_batch(0) == 1 and t.batch_index(0) == 0
    t.commit()
    assert t.state(0) == AWAIT and t.n_past(0) == 6
    t.finish(0)
    assert t.state(0) == IDLE and t.n_past(0) == 0 and t.history(0).tolist() == []
    assert t.n_commits == 3
    pool.release(b)


def test_prefix_reuse_positions(pool):
    t = SlotTable(2, 16, chunk_size=8)
    b = pool.acquire()
    with pytest.raises(ValueError, match="holds 0 tokens"):  # the KV record says slot 1 is empty
        t.start(1, [1, 2, 3, 4, 5, 6], n_past=4)
    t.start(0, [1, 2, 3, 4, 5])
    t.fill(b, "balanced", 8)
    t.commit()
    t.finish(0, keep=True)  # idle, still holding [1..5]
    assert t.seq_len(0) == 5 and t.seq_tokens(0).tolist() == [1, 2, 3, 4, 5]
    t.copy(0, 1, 4)
    assert t.cells_used == 5 and t.cells_owned(0) == 1 and t.cells_owned(1) == 0
    t.start(1, [1, 2, 3, 4, 5, 6], n_past=4)
    assert t.n_pending(1) == 2 and t.reused_tokens(1) == 4
    t.fill(b, "balanced", 8)
    assert b.entries() == [(5, 4, 1, False), (6, 5, 1, True)]
    t.commit()
    t.accept(1, 7)
    assert t.common_prefix(1, [1, 2, 3, 4, 5, 6, 9]) == 6
    assert t.common_prefix(1, [1, 2, 9]) == 2
    assert t.common_prefix(1, [1, 2, 3, 4, 5, 6, 7, 8]) == 6  # 7 is not in the KV cache yet
    assert t.best_prefix([1, 2, 3]) == (0, 3)  # the idle slot wins a tie (reused in place)
    assert t.best_prefix([1, 2, 3, 4, 5, 6]) == (1, 6)
    assert t.best_prefix([9]) == (-1, 0)
    t.trim(0, 0)
    assert t.cells_used == 6
    t.check_kv()
    assert t.best_prefix([]) == (-1, 0)
    pool.release(b)


def test_start_errors():
    t = SlotTable(2, 8)
    with pytest.raises(PromptTooLong):
        t.start(0, list(range(9)))
    with pytest.raises(ValueError):  # PromptTooLong is a ValueError
        t.start(0, list(range(9)))
    with pytest.raises(ValueError, match="empty"):
        t.start(0, [])
    with pytest.raises(ValueError, match="n_past"):
        t.start(0, [1, 2], n_past=2)
    with pytest.raises(IndexError):
        t.start(2, [1])
    t.start(0, list(range(8)))  # exactly n_ctx_seq fits
    with pytest.raises(ValueError, match="busy"):
        t.start(0, [1])
    assert t.state(0) == PREFILL and t.n_pending(0) == 8


def test_accept_finish_errors(pool):
    t = SlotTable(1, 3, chunk_size=8)
    b = pool.acquire()
    with pytest.raises(ValueError, match="idle"):
        t.finish(0)
    t.start(0, [1, 2])
    with pytest.raises(ValueError, match="not awaiting"):
        t.accept(0, 5)
    t.fill(b, "decode_maximal", 8)
    t.commit()
    t.accept(0, 3)  # history [1, 2, 3] fills n_ctx_seq = 3
    t.fill(b, "decode_maximal", 8)
    t.commit()
    assert t.room(0) == 0
    with pytest.raises(ValueError, match="full"):
        t.accept(0, 4)
    t.finish(0)
    pool.release(b)


def test_fill_commit_rollback_protocol(pool):
    t = SlotTable(2, 16, chunk_size=4)
    b = pool.acquire()
    with pytest.raises(RuntimeError, match="without a pending fill"):
        t.commit()
    with pytest.raises(RuntimeError, match="without a pending fill"):
        t.rollback()
    t.start(0, list(range(10)))
    before = snapshot(t)
    assert t.fill(b, "prefill_priority", 16) == 4
    with pytest.raises(RuntimeError, match="pending"):
        t.fill(b, "prefill_priority", 16)
    t.rollback()
    after = snapshot(t)
    assert after[:4] == before[:4] and t.n_rollbacks == 1
    assert t.fill(b, "prefill_priority", 2) == 2  # retry with a smaller batch
    assert b.entries() == [(0, 0, 0, False), (1, 1, 0, False)]
    t.commit()
    assert t.n_past(0) == 2
    with pytest.raises(ValueError, match="n_batch"):
        t.fill(b, "prefill_priority", 65)
    with pytest.raises(ValueError, match="n_batch"):
        t.fill(b, "prefill_priority", 0)
    with pytest.raises(ValueError, match="unknown strategy"):
        t.fill(b, "fastest", 8)
    assert not t.fill_pending
    # an empty fill leaves nothing pending; commit or rollback right after it are no-ops
    t.finish(0)
    assert t.fill(b, "balanced", 8) == 0
    assert not t.fill_pending
    assert t.fill(b, "balanced", 8) == 0
    t.commit()
    with pytest.raises(RuntimeError, match="without a pending fill"):
        t.commit()
    assert t.fill(b, "balanced", 8) == 0
    t.rollback()
    with pytest.raises(RuntimeError, match="without a pending fill"):
        t.rollback()
    pool.release(b)


def test_finish_between_fill_and_commit(pool):
    t = SlotTable(3, 16, chunk_size=8)
    b = pool.acquire()
    t.start(0, [1, 2])
    t.start(1, [3, 4, 5])
    t.fill(b, "decode_maximal", 16)
    assert t.outputs() == [(0, 1), (1, 4)]
    t.finish(1)  # cancelled while its tokens are in the batch
    t.start(1, [7])  # and the slot reused
    t.commit()
    assert t.state(0) == AWAIT and t.state(1) == PREFILL and t.n_past(1) == 0
    t.check_invariants()
    pool.release(b)


def test_edges_match_the_methods(pool):
    """Every state change made by the public methods is an edge of EDGES, and every edge is used."""
    t = SlotTable(1, 8, chunk_size=8)
    b = pool.acquire()
    seen = set()

    def step(fn):
        old = t.state(0)
        fn()
        if t.state(0) != old:
            seen.add((old, t.state(0)))

    step(lambda: t.start(0, [1, 2]))
    step(lambda: t.finish(0))  # PREFILL -> IDLE
    step(lambda: t.start(0, [1, 2]))
    step(lambda: (t.fill(b, "decode_maximal", 8), t.commit()))
    step(lambda: t.finish(0))  # AWAIT -> IDLE
    step(lambda: t.start(0, [1, 2]))
    step(lambda: (t.fill(b, "decode_maximal", 8), t.commit()))
    step(lambda: t.accept(0, 3))
    step(lambda: (t.fill(b, "decode_maximal", 8), t.commit()))
    step(lambda: t.accept(0, 3))
    step(lambda: t.finish(0))  # DECODE -> IDLE
    assert seen == EDGES
    assert all(isinstance(a, SlotState) and isinstance(z, SlotState) for a, z in EDGES)
    pool.release(b)


@pytest.mark.skipif(not slots_mod.DEBUG, reason="edge checks are compiled in debug builds only")
def test_debug_build_rejects_illegal_edges():
    t = SlotTable(1, 8)
    with pytest.raises(RuntimeError, match="illegal slot state transition IDLE -> DECODE"):
        t._transition(0, SlotState.DECODE)
    t.start(0, [1])
    with pytest.raises(RuntimeError, match="PREFILL -> DECODE"):
        t._transition(0, SlotState.DECODE)


def test_internal_classes_refuse_construction():
    with pytest.raises(TypeError):
        user_plans.TableView()
    with pytest.raises(TypeError, match="make a SlotTable"):
        slot_record.SlotRecord()
    assert "TableView" in repr(type(SlotTable(1, 1).view()))


def test_live_table_counter():
    gc.collect()
    base = slots_mod.live_tables()
    tables = [SlotTable(4, 64) for _ in range(3)]
    assert slots_mod.live_tables() == base + 3
    del tables
    gc.collect()
    assert slots_mod.live_tables() == base


def test_table_arguments():
    for args in [(0, 8), (1, 0), (1, 8, 0)]:
        with pytest.raises(ValueError):
            SlotTable(*args)


def test_queries():
    t = SlotTable(3, 8)
    t.start(1, np.array([4, 5, 6], dtype=np.int32))
    assert t.free_slot() == 0 and t.count(PREFILL) == 1 and t.busy_slots == 1
    assert t.arrival(1) == 0
    t.start(0, [1])
    t.start(2, [1])
    assert t.free_slot() == -1 and t.view().prefill_slots == [1, 0, 2]
    assert t.view().n_parallel == 3
    assert "busy=3" in repr(t)


def test_order_prefill_deals_the_start_counters_again():
    t = SlotTable(4, 64)
    for slot in (1, 0, 2):
        t.start(slot, [1, 2, 3])
    t.order_prefill([2, 1, 0])
    assert t.view().prefill_slots == [2, 1, 0]
    assert [t.arrival(s) for s in (2, 1, 0)] == [0, 1, 2]
    t.check_invariants()
    for bad in ([2, 1], [2, 1, 0, 3], [2, 2, 0]):
        with pytest.raises(ValueError, match="permutation"):
            t.order_prefill(bad)
    assert t.view().prefill_slots == [2, 1, 0]


def _decoding(t, b, slot, prompt):
    """Slot ``slot`` through its prompt to DECODE."""
    t.start(slot, prompt)
    t.fill(b, "decode_maximal", 256)
    t.commit()
    t.accept(slot, 7)


@pytest.mark.parametrize("kv_unified", [True, False])
def test_drafts_keep_a_tick_under_the_rows_bound(kv_unified):
    """``draft_rows_below`` 64: a stream's decode row and drafts stay at 63 rows; with one
    unified stream, all the tick's rows do (a prompt chunk's too); no bound: ``MAX_DRAFT``."""
    p = BatchPool(n_batch=256)
    b = p.acquire()
    t = SlotTable(2, 512, chunk_size=512, kv_unified=kv_unified, kv_size=1024 if kv_unified else 0)
    _decoding(t, b, 0, list(range(1, 10)))
    t.start(1, list(range(1, 31)))  # a 30-token prompt beside the decode
    for below, drafted in ((0, 64), (64, 32 if kv_unified else 62)):
        t.draft_rows_below = below
        assert t.set_draft(0, list(range(100))) == 64  # (MAX_DRAFT)
        t.fill(b, "decode_maximal", 256)
        assert t.n_draft_tokens == drafted
        t.rollback()
    t.draft_rows_below = 64
    t.set_draft(0, list(range(100)))
    t.fill(b, "decode_maximal", 256)  # the prompt joins; 1 + 30 rows: 32 drafts
    t.commit()
    t.accept(1, 7)
    t.reject(0, t.draft_in_fill(0))
    t.accept(0, 8)
    t.set_draft(0, list(range(100)))
    t.fill(b, "decode_maximal", 256)  # two decode rows
    assert t.n_draft_tokens == (61 if kv_unified else 62)
    t.rollback()
    p.release(b)


# --------------------------------------------------------------------- user strategies


class Recorder:
    """A user strategy that records what it saw and returns a fixed plan."""

    name = "recorder"

    def __init__(self, plan):
        self._plan = plan
        self.seen = None

    def plan(self, view, budget, chunk_size, queue_depth):
        self.seen = dict(
            decode=view.decode_slots,
            prefill=view.prefill_slots,
            pending=[view.n_pending(s) for s in view.prefill_slots],
            states=[view.state(s) for s in range(view.n_parallel)],
            n_past=[view.n_past(s) for s in range(view.n_parallel)],
            gen=[view.n_generated(s) for s in range(view.n_parallel)],
            arrival=[view.arrival(s) for s in view.prefill_slots],
            args=(budget, chunk_size, queue_depth),
        )
        return self._plan


def busy_table(pool):
    """Slot 0 DECODE, slot 1 AWAIT_SAMPLE, slot 2 PREFILL (6 pending), slot 3 IDLE."""
    t = SlotTable(4, 32, chunk_size=4)
    b = pool.acquire()
    t.start(0, [1, 2])
    t.start(1, [3])
    t.fill(b, "decode_maximal", 8)
    t.commit()
    t.accept(0, 9)
    t.start(2, list(range(20, 26)))
    pool.release(b)
    return t


def test_user_strategy_sees_the_view_and_drives_the_batch(pool):
    t = busy_table(pool)
    b = pool.acquire()
    s = Recorder([(2, 3), (0, 1)])
    assert t.fill(b, s, 10, queue_depth=7) == 4
    assert s.seen == dict(
        decode=[0],
        prefill=[2],
        pending=[6],
        states=[DECODE, AWAIT, PREFILL, IDLE],
        n_past=[2, 1, 0, 0],
        gen=[1, 0, 0, 0],
        arrival=[2],
        args=(10, 4, 7),
    )
    assert b.entries() == [(20, 0, 2, False), (21, 1, 2, False), (22, 2, 2, False), (9, 2, 0, True)]
    assert t.outputs() == [(0, 3)]
    t.commit()
    pool.release(b)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ([(1, 1)], "slot 1 cannot be scheduled \\(AWAIT_SAMPLE\\)"),
        ([(3, 1)], "slot 3 cannot be scheduled \\(IDLE\\)"),
        ([(4, 1)], "slot 4 out of range"),
        ([(-1, 1)], "slot -1 out of range"),
        ([(0, 2)], "decoding slot 0 must get exactly 1 token, got 2"),
        ([(2, 0)], "prefilling slot 2 must get 1..4 tokens"),
        ([(2, 5)], "prefilling slot 2 must get 1..4 tokens \\(pending 6, chunk_size 4\\), got 5"),
        ([(0, 1), (0, 1)], "slot 0 planned twice"),
        ([(2, 4), (0, 1)], "plan exceeds the budget of 4 tokens \\(5 so far\\)"),
        ([(2,)], "not a \\(slot, n_tokens\\) pair"),
        ([("0", 1)], "not a \\(slot, n_tokens\\) pair"),
        ([(0.0, 1)], "not a \\(slot, n_tokens\\) pair"),
        (42, "not an iterable"),
    ],
)
def test_invalid_user_plans_raise_and_leave_the_table_unchanged(pool, plan, message):
    t = busy_table(pool)
    b = pool.acquire()
    before = snapshot(t)
    with pytest.raises(ValueError, match="^strategy 'recorder': .*" + message):
        t.fill(b, Recorder(plan), 4)
    assert snapshot(t) == before
    t.fill(b, "decode_maximal", 4)  # still usable
    t.commit()
    pool.release(b)


def test_exceptions_inside_a_user_strategy_propagate(pool):
    class Boom:
        def plan(self, view, budget, chunk_size, queue_depth):
            raise KeyError("boom")

    def gen_plan(view, budget, chunk_size, queue_depth):
        yield (0, 1)
        raise ZeroDivisionError

    class Gen:
        plan = staticmethod(gen_plan)

    t = busy_table(pool)
    b = pool.acquire()
    t.fill(b, "decode_maximal", 8)
    t.commit()  # slot 0 AWAIT now; slot 2 partly prefilled
    t.accept(0, 5)
    before = snapshot(t)
    with pytest.raises(KeyError, match="boom"):
        t.fill(b, Boom(), 8)
    assert snapshot(t) == before
    with pytest.raises(ZeroDivisionError):
        t.fill(b, Gen(), 8)
    assert snapshot(t) == before
    pool.release(b)


def test_user_strategy_cannot_mutate_the_table(pool):
    t = busy_table(pool)
    b = pool.acquire()

    class Sneaky:
        def plan(self, view, budget, chunk_size, queue_depth):
            t.finish(0)

    with pytest.raises(RuntimeError, match="inside a strategy"):
        t.fill(b, Sneaky(), 8)
    assert t.state(0) == DECODE and not t.fill_pending
    pool.release(b)


def test_a_kept_view_is_invalid_after_plan(pool):
    t = busy_table(pool)
    b = pool.acquire()
    kept = []

    class Keeper:
        def plan(self, view, budget, chunk_size, queue_depth):
            kept.append(view)
            return []

    assert t.fill(b, Keeper(), 8) == 0
    t.commit()
    with pytest.raises(RuntimeError, match="only valid during plan"):
        _ = kept[0].decode_slots
    pool.release(b)


# --------------------------------------------------------------------- no allocation


def run_ticks(t, b, n_ticks, prompts):
    """A steady workload: decode until out of room, then restart with the next prompt."""
    restart = 0
    for _ in range(n_ticks):
        t.fill(b, "decode_maximal", 64)
        t.commit()
        for slot, _idx in t.outputs():
            if t.room(slot) > 0:
                t.accept(slot, 7)
            else:
                t.finish(slot)
                t.start(slot, prompts[restart % len(prompts)])
                restart += 1


def test_fill_does_not_allocate(pool):
    t = SlotTable(n_parallel=16, n_ctx_seq=48, chunk_size=16)
    b = pool.acquire()
    prompts = [np.arange(n, dtype=np.int32) for n in (5, 17, 40)]
    for i in range(16):
        t.start(i, prompts[i % 3])
    run_ticks(t, b, 500, prompts)  # warm up
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        run_ticks(t, b, 10_000, prompts)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
        # and the fill/commit pair alone, on a table that stays busy
        t2 = SlotTable(n_parallel=64, n_ctx_seq=4096, chunk_size=512)
        for i in range(64):
            t2.start(i, np.arange(4000, dtype=np.int32))
        mid, _ = tracemalloc.get_traced_memory()
        for _ in range(1000):
            t2.fill(b, "balanced", 64)
            t2.rollback()
        for _ in range(10):
            t2.fill(b, "prefill_priority", 64)
            t2.commit()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < 2048, f"grew {end - start} bytes over 10,000 ticks"
    assert after - mid < 1024, f"fill/commit grew {after - mid} bytes"
    pool.release(b)


@pytest.mark.parametrize("unified", [False, True])
def test_admission_slot_keeps_busy_streams_consecutive(unified):
    """Per-stream KV: llama.cpp decodes each run of consecutive busy seq_ids as its own forward
    pass, so a new request joins a run of busy slots (filling a gap first); ties and a unified
    cache go by least recent use."""
    t = SlotTable(6, 16, kv_unified=unified)
    for seq in (5, 4, 3, 2, 1, 0):  # slot 5 used longest ago ... slot 0 most recently
        t.touch(seq)
    assert t.admission_slot() == 5  # nothing busy: the least recently used
    t.start(0, array("i", [1, 2]))
    assert t.admission_slot() == (5 if unified else 1)  # extends the run {0}
    t.start(2, array("i", [1, 2]))
    assert t.admission_slot() == (5 if unified else 1)  # merges {0} and {2}
    t.start(1, array("i", [1, 2]))
    t.touch(4)
    assert t.admission_slot() == (5 if unified else 3)  # extends {0, 1, 2}, before the older 5
    for seq in range(3):
        t.start(seq + 3, array("i", [1, 2]))
    assert t.admission_slot() == -1
