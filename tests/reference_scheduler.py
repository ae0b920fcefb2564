"""A small, obviously-correct pure-Python reference of the scheduler core's rules.

Same API shape as ``llamabatch._core.slots.SlotTable`` (start / accept / finish / fill /
commit / rollback), but ``fill`` returns the batch as a list of
``(token, pos, seq_id, logits)`` entries instead of writing a ``llama_batch``. The tests
check that the Cython core builds exactly these batches; the benchmarks time both.

The rules:

- slot states IDLE -> PREFILL -> AWAIT_SAMPLE <-> DECODE, any busy state -> IDLE;
- a DECODE slot feeds its last accepted token at position ``n_past`` and requests logits;
  a PREFILL slot feeds the next chunk of its prompt at contiguous positions, and the last
  prompt token requests logits;
- prompt chunks go to PREFILL slots oldest first (FIFO by start order), each at most
  ``chunk_size`` tokens; decode tokens to DECODE slots in round-robin order from a cursor
  that, after a commit that left some decode slot out, moves just past the last decode
  slot served;
- strategies split the budget ``b`` (see the functions below); ``fill`` changes nothing
  until ``commit``; ``rollback`` forgets the fill.
"""

from __future__ import annotations

IDLE, PREFILL, AWAIT_SAMPLE, DECODE = 0, 1, 2, 3


def _prefill_plan(prefill, budget, chunk_size):
    """Prompt chunks, oldest first, within ``budget`` tokens. ``prefill``: [(slot, pending)]."""
    plan = []
    left = budget
    for slot, pending in prefill:
        if left <= 0:
            break
        n = min(pending, chunk_size, left)
        plan.append((slot, n))
        left -= n
    return plan


def _tokens(plan):
    return sum(n for _, n in plan)


def decode_maximal(decode, prefill, budget, chunk_size):
    """Every decode token first (one token kept for a waiting prompt if they fill the budget)."""
    n_decode = min(len(decode), budget)
    if n_decode == budget and budget >= 2 and prefill:
        n_decode -= 1
    return [(s, 1) for s in decode[:n_decode]] + _prefill_plan(prefill, budget - n_decode, chunk_size)


def prefill_priority(decode, prefill, budget, chunk_size):
    """Prompt chunks first (one token kept for decode if a slot decodes), decode with the rest."""
    reserve = 1 if decode and budget >= 2 else 0
    chunks = _prefill_plan(prefill, budget - reserve, chunk_size)
    return chunks + [(s, 1) for s in decode[: budget - _tokens(chunks)]]


def balanced(decode, prefill, budget, chunk_size):
    """Decode up to half the budget, prefill the rest; unused budget flows both ways."""
    n_decode = min(len(decode), budget // 2)
    n_decode = min(len(decode), budget - _tokens(_prefill_plan(prefill, budget - n_decode, chunk_size)))
    return [(s, 1) for s in decode[:n_decode]] + _prefill_plan(prefill, budget - n_decode, chunk_size)


STRATEGIES = {
    "decode_maximal": decode_maximal,
    "prefill_priority": prefill_priority,
    "balanced": balanced,
}


class Slot:
    def __init__(self):
        self.state = IDLE
        self.history = []
        self.n_prompt = 0
        self.n_past = 0
        self.arrival = 0


class RefView:
    """The view protocol a user strategy receives (same as the core's TableView)."""

    def __init__(self, table):
        self._t = table

    @property
    def n_parallel(self):
        return self._t.n_parallel

    @property
    def decode_slots(self):
        return self._t.decode_order()

    @property
    def prefill_slots(self):
        return self._t.prefill_order()

    def state(self, slot):
        return self._t.slots[slot].state

    def n_pending(self, slot):
        return self._t.n_pending(slot)

    def n_past(self, slot):
        return self._t.slots[slot].n_past

    def arrival(self, slot):
        return self._t.slots[slot].arrival

    def n_generated(self, slot):
        s = self._t.slots[slot]
        return len(s.history) - s.n_prompt


class ReferenceTable:
    def __init__(self, n_parallel, n_ctx_seq, chunk_size=512):
        self.n_parallel = n_parallel
        self.n_ctx_seq = n_ctx_seq
        self.chunk_size = chunk_size
        self.slots = [Slot() for _ in range(n_parallel)]
        self.cursor = 0
        self.arrivals = 0
        self.pending = None  # (plan, next_cursor, dropped slots) of an uncommitted fill
        self.plan = []
        self.outputs = []

    # -- slot lifecycle

    def start(self, slot, tokens, n_past=0):
        s = self.slots[slot]
        tokens = [int(t) for t in tokens]
        if s.state != IDLE:
            raise ValueError("slot busy")
        if not tokens or len(tokens) > self.n_ctx_seq or not 0 <= n_past <= len(tokens) - 1:
            raise ValueError("bad prompt")
        s.state, s.history, s.n_prompt, s.n_past = PREFILL, tokens, len(tokens), n_past
        s.arrival = self.arrivals
        self.arrivals += 1

    def accept(self, slot, token):
        s = self.slots[slot]
        if s.state != AWAIT_SAMPLE or len(s.history) >= self.n_ctx_seq:
            raise ValueError("cannot accept")
        s.history.append(token)
        s.state = DECODE

    def finish(self, slot):
        if self.slots[slot].state == IDLE:
            raise ValueError("idle")
        self.slots[slot] = Slot()
        if self.pending is not None:
            self.pending[2].add(slot)

    def n_pending(self, slot):
        s = self.slots[slot]
        return s.n_prompt - s.n_past if s.state == PREFILL else 0

    # -- orders

    def decode_order(self):
        order = [(self.cursor + j) % self.n_parallel for j in range(self.n_parallel)]
        return [i for i in order if self.slots[i].state == DECODE]

    def prefill_order(self):
        waiting = [i for i in range(self.n_parallel) if self.slots[i].state == PREFILL]
        return sorted(waiting, key=lambda i: self.slots[i].arrival)

    # -- the tick

    def make_plan(self, strategy, n_batch, queue_depth=0):
        if isinstance(strategy, str):
            decode = self.decode_order()
            prefill = [(i, self.n_pending(i)) for i in self.prefill_order()]
            return STRATEGIES[strategy](decode, prefill, n_batch, self.chunk_size)
        plan = [
            (int(s), int(n)) for s, n in strategy.plan(RefView(self), n_batch, self.chunk_size, queue_depth)
        ]
        seen = set()
        for slot, n in plan:
            state = self.slots[slot].state if 0 <= slot < self.n_parallel else None
            if slot in seen or state not in (PREFILL, DECODE):
                raise ValueError("bad slot")
            if state == DECODE and n != 1:
                raise ValueError("decode slot needs 1 token")
            if state == PREFILL and not 1 <= n <= min(self.n_pending(slot), self.chunk_size):
                raise ValueError("bad chunk")
            seen.add(slot)
        if _tokens(plan) > n_batch:
            raise ValueError("over budget")
        return plan

    def fill(self, strategy, n_batch, queue_depth=0):
        """The batch entries [(token, pos, seq_id, logits)] of this tick (nothing changes yet)."""
        if self.pending is not None:
            raise RuntimeError("fill pending")
        decode = self.decode_order()
        plan = self.make_plan(strategy, n_batch, queue_depth)
        entries, outputs = [], []
        for slot, n in plan:
            s = self.slots[slot]
            for j in range(n):
                pos = s.n_past + j
                logits = s.state == DECODE or pos == s.n_prompt - 1
                if logits:
                    outputs.append((slot, len(entries)))
                entries.append((s.history[pos], pos, slot, logits))
        next_cursor = self.cursor
        served = [slot for slot, _ in plan if self.slots[slot].state == DECODE]
        if served and len(served) < len(decode):
            last = max(served, key=decode.index)
            next_cursor = (last + 1) % self.n_parallel
        self.pending = (plan, next_cursor, set()) if entries else None  # an empty fill: nothing pending
        self.plan, self.outputs = plan, outputs
        return entries

    def commit(self):
        if self.pending is None:  # after an empty fill
            return
        plan, next_cursor, dropped = self.pending
        for slot, n in plan:
            if slot in dropped:
                continue
            s = self.slots[slot]
            s.n_past += n
            if s.state == DECODE or s.n_past == s.n_prompt:
                s.state = AWAIT_SAMPLE
        self.cursor = next_cursor
        self.pending = None

    def rollback(self):
        self.pending = None
        self.plan, self.outputs = [], []
