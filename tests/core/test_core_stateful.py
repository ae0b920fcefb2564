"""Stateful hypothesis test: the Cython core builds exactly the reference's batches.

Random arrivals (with prefix reuse), samples, completions, cancellations (also between a
fill and its commit), strategies (built-in and user-defined, valid and faulty), budgets,
chunk sizes, failed decodes (rollback then a smaller retry). After every step the core and
the reference agree on every slot, and every batch satisfies the invariants: at most
``n_batch`` tokens; each slot at most once (one contiguous run); positions contiguous and
never reused within a sequence; under decode_maximal every decoding slot is in the batch
when the budget allows; no slot starves under the built-ins; the pool never leaks.
"""

from __future__ import annotations

import reference_scheduler as ref
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llamabatch._core import BatchPool, DecodeMaximal, PrefillPriority, SlotState, SlotTable
from llamabatch.errors import PromptTooLong

BUILTINS = ["decode_maximal", "prefill_priority", "balanced"]


class Lifo:
    """User strategy: newest prompt first, then decode slots in reverse order."""

    name = "lifo"

    def plan(self, view, budget, chunk_size, queue_depth):
        out, left = [], budget
        for s in reversed(view.prefill_slots):
            if left == 0:
                break
            n = min(view.n_pending(s), chunk_size, left)
            out.append((s, n))
            left -= n
        for s in reversed(view.decode_slots):
            if left == 0:
                break
            out.append((s, 1))
            left -= 1
        return out


class Adaptive:
    """User strategy using the queue depth: prefill first while requests wait."""

    name = "adaptive"

    def plan(self, view, budget, chunk_size, queue_depth):
        inner = PrefillPriority() if queue_depth > 0 else DecodeMaximal()
        return iter(inner.plan(view, budget, chunk_size, queue_depth))


class SubclassedBuiltin(DecodeMaximal):
    """A Python subclass of a built-in: not native, goes through plan() and validation."""

    name = "subclassed"


class Greedy:
    """Faulty user strategy: every schedulable slot gets its whole pending prompt (over budget)."""

    name = "greedy"

    def plan(self, view, budget, chunk_size, queue_depth):
        return [(s, 1) for s in view.decode_slots] + [(s, view.n_pending(s)) for s in view.prefill_slots]


class Raising:
    name = "raising"

    def plan(self, view, budget, chunk_size, queue_depth):
        raise LookupError("strategy bug")


USER = [Lifo(), Adaptive(), SubclassedBuiltin(), Greedy(), Raising()]


def observable(core):
    return (
        core.states(),
        [core.n_past(i) for i in range(core.n_parallel)],
        [core.n_pending(i) for i in range(core.n_parallel)],
        core.last_plan(),
        core.outputs(),
        core.decode_cursor,
        core.fill_pending,
    )


class CoreVsReference(RuleBasedStateMachine):
    @initialize(
        n_parallel=st.integers(1, 12),
        n_ctx_seq=st.integers(2, 40),
        chunk=st.integers(1, 12),
        cap=st.integers(1, 24),
        data=st.data(),
    )
    def setup(self, n_parallel, n_ctx_seq, chunk, cap, data):
        self.n = n_parallel
        self.core = SlotTable(n_parallel, n_ctx_seq, chunk)
        self.ref = ref.ReferenceTable(n_parallel, n_ctx_seq, chunk)
        self.pool = BatchPool(cap)
        self.cap = cap
        self.next_pos = [0] * n_parallel  # committed next position of each sequence
        self.misses = [0] * n_parallel  # consecutive built-in ticks a DECODE slot was left out
        for _ in range(data.draw(st.integers(0, self.n), label="initial arrivals")):
            self.arrive(data)

    def slots_in(self, state):
        return [i for i in range(self.n) if self.ref.slots[i].state == state]

    # ---------------------------------------------------------------- arrivals and samples

    @rule(data=st.data())
    def arrive(self, data):
        if data.draw(st.integers(0, 9), label="too long") == 0:
            self.too_long(data.draw(st.integers(1, 5)))
            return
        free = self.slots_in(ref.IDLE)
        if not free:
            return
        slot = data.draw(st.sampled_from(free), label="slot")
        length = data.draw(st.integers(1, self.core.n_ctx_seq), label="length")
        tokens = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length))
        n_past = data.draw(st.integers(0, length - 1) | st.just(0), label="n_past")
        self.core.trim(slot, 0)  # stands for llama.cpp's sequence holding the reused prefix
        self.core.record_cached(slot, tokens[:n_past])
        self.core.start(slot, tokens, n_past)
        self.ref.start(slot, tokens, n_past)
        self.next_pos[slot] = n_past
        self.misses[slot] = 0

    def too_long(self, extra):
        free = self.slots_in(ref.IDLE)
        if not free:
            return
        try:
            self.core.start(free[0], [1] * (self.core.n_ctx_seq + extra))
        except PromptTooLong:
            pass
        else:
            raise AssertionError("a prompt longer than n_ctx_seq was accepted")

    @rule(data=st.data())
    def sample(self, data):
        waiting = self.slots_in(ref.AWAIT_SAMPLE)
        if not waiting:
            return
        slot = data.draw(st.sampled_from(waiting), label="slot")
        done = data.draw(st.booleans(), label="done") and data.draw(st.booleans())
        if done or len(self.ref.slots[slot].history) >= self.core.n_ctx_seq:
            self.core.finish(slot)
            self.ref.finish(slot)
        else:
            token = data.draw(st.integers(0, 2**31 - 1), label="token")
            self.core.accept(slot, token)
            self.ref.accept(slot, token)
        self.misses[slot] = 0

    @rule()
    def sample_all(self):
        for slot in self.slots_in(ref.AWAIT_SAMPLE):
            if len(self.ref.slots[slot].history) < self.core.n_ctx_seq:
                self.core.accept(slot, 1000 + slot)
                self.ref.accept(slot, 1000 + slot)
            else:
                self.core.finish(slot)
                self.ref.finish(slot)
            self.misses[slot] = 0

    @precondition(lambda self: any(s.state != ref.IDLE for s in self.ref.slots))
    @rule(data=st.data())
    def cancel(self, data):
        busy = [i for i in range(self.n) if self.ref.slots[i].state != ref.IDLE]
        slot = data.draw(st.sampled_from(busy), label="cancel")
        if data.draw(st.integers(0, 2), label="really") != 0:
            return
        self.core.finish(slot)
        self.ref.finish(slot)
        self.misses[slot] = 0

    # ---------------------------------------------------------------- the tick

    @rule(data=st.data(), n_ticks=st.integers(1, 4))
    def ticks(self, data, n_ticks):
        for _ in range(n_ticks):
            strategy = data.draw(st.sampled_from(BUILTINS * 3 + USER), label="strategy")
            tight = max(1, min(self.cap, len(self.slots_in(ref.DECODE)) + 1))  # decode fills the batch
            n_batch = data.draw(
                st.just(self.cap) | st.integers(1, self.cap) | st.integers(1, tight), label="n_batch"
            )
            queue_depth = data.draw(st.integers(0, 3), label="queue_depth")
            fail = data.draw(st.integers(0, 5), label="fail") == 0
            batch = self.pool.acquire()
            try:
                self._tick(data, batch, strategy, n_batch, queue_depth, fail)
            finally:
                self.pool.release(batch)

    def _tick(self, data, batch, strategy, n_batch, queue_depth, fail):
        if not self.slots_in(ref.DECODE) and not self.slots_in(ref.PREFILL):
            self.arrive(data)  # the engine admits a waiting request first
        before = observable(self.core)
        decoding = self.slots_in(ref.DECODE)
        prefill_fifo = self.ref.prefill_order()
        try:
            expected = self.ref.fill(strategy, n_batch, queue_depth)
        except (ValueError, LookupError) as exc:
            try:
                self.core.fill(batch, strategy, n_batch, queue_depth)
            except type(exc):
                pass
            else:
                raise AssertionError("the core accepted what the reference rejected") from None
            assert observable(self.core) == before
            return
        n_tokens = self.core.fill(batch, strategy, n_batch, queue_depth)
        entries = batch.entries()
        assert entries == expected
        assert n_tokens == len(entries) == batch.n_tokens <= n_batch
        assert self.core.outputs() == self.ref.outputs
        assert self.core.last_plan() == self.ref.plan
        # each slot at most once: its entries form one run, at its next positions
        runs = [e[2] for i, e in enumerate(entries) if i == 0 or entries[i - 1][2] != e[2]]
        assert len(runs) == len(set(runs))
        for slot in set(runs):
            positions = [e[1] for e in entries if e[2] == slot]
            assert positions == list(range(self.next_pos[slot], self.next_pos[slot] + len(positions)))
        served_decode = [s for s, _ in self.ref.plan if s in decoding]
        builtin = isinstance(strategy, str)
        if strategy == "decode_maximal":
            if len(decoding) < n_batch:
                assert sorted(served_decode) == decoding
            else:
                assert len(served_decode) == n_batch - (1 if prefill_fifo and n_batch >= 2 else 0)
        if builtin and n_batch >= 2:
            assert not decoding or served_decode
            assert not prefill_fifo or prefill_fifo[0] in [s for s, _ in self.ref.plan]
        # a failed decode, or a cancellation in flight
        if data.draw(st.integers(0, 5), label="cancel in flight") == 0:
            busy = [i for i in range(self.n) if self.ref.slots[i].state != ref.IDLE]
            if busy:
                slot = data.draw(st.sampled_from(busy))
                self.core.finish(slot)
                self.ref.finish(slot)
                self.misses[slot] = 0
        if fail:
            self.core.rollback()
            self.ref.rollback()
            return
        dropped = set(self.ref.pending[2]) if self.ref.pending else set()
        self.core.commit()
        self.ref.commit()
        for slot, n in self.ref.plan:
            if slot not in dropped:
                self.next_pos[slot] += n
        # the engine samples every output: mostly another token, sometimes the end
        for slot, _ in self.core.outputs():
            if self.ref.slots[slot].state != ref.AWAIT_SAMPLE:
                continue  # cancelled in flight
            if data.draw(st.integers(0, 7), label="stop") == 0 or self.core.room(slot) == 0:
                self.core.finish(slot)
                self.ref.finish(slot)
            else:
                token = data.draw(st.integers(0, 2**31 - 1), label="token")
                self.core.accept(slot, token)
                self.ref.accept(slot, token)
            self.misses[slot] = 0
        # no decode slot waits more than n_parallel - 1 built-in ticks
        if not builtin:
            self.misses = [0] * self.n
        elif served_decode:
            for s in decoding:
                self.misses[s] = 0 if s in served_decode else self.misses[s] + 1
                assert self.misses[s] <= self.n - 1, f"slot {s} starved for {self.misses[s]} ticks"

    # ---------------------------------------------------------------- invariants

    @invariant()
    def same_slots(self):
        core, r = self.core, self.ref
        assert [int(s) for s in core.states()] == [s.state for s in r.slots]
        for i in range(self.n):
            assert core.n_past(i) == r.slots[i].n_past
            assert core.n_pending(i) == r.n_pending(i)
            assert core.history(i).tolist() == r.slots[i].history
            if r.slots[i].state != ref.IDLE:
                assert core.n_past(i) == self.next_pos[i]
        assert core.decode_cursor == r.cursor
        assert core.view().prefill_slots == r.prefill_order()
        assert core.view().decode_slots == r.decode_order()
        core.check_invariants()

    @invariant()
    def pool_does_not_leak(self):
        assert self.pool.n_outstanding == 0

    def teardown(self):
        if hasattr(self, "core"):
            assert not self.core.fill_pending
            assert all(isinstance(s, SlotState) for s in self.core.states())


CoreVsReference.TestCase.settings = settings(
    max_examples=settings.default.max_examples * 3, stateful_step_count=40
)
TestCoreVsReference = CoreVsReference.TestCase
