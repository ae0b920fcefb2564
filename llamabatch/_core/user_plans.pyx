"""Plans from user strategies: any object with ``plan(view, budget, chunk_size, queue_depth)``.

``SlotTable.fill`` runs a built-in strategy's plan in C. Any other strategy gets a
read-only :class:`TableView` of the table, valid only during its ``plan()``, and returns
``(slot, n_tokens)`` pairs; :func:`read_plan` checks each against the rules a built-in
plan follows (a decoding slot gets 1 token, a prefilling one 1 to its pending tokens and
``chunk_size``, no slot twice, the budget) and writes the plan where the C path writes its
own. The view reads the table's record (``SlotRecord``) and, through pointers the table gives
it, the table's own prompt order and round-robin cursor: this module never imports
``slots.pyx``, which imports it.
"""

from libc.stdint cimport int32_t, int64_t
from libc.string cimport memset

import operator

from llamabatch._core.slot_record cimport ST_DECODE, ST_PREFILL, SlotRecord, slot_t
from llamabatch._core.strategies cimport plan_in_t

from llamabatch._core.slot_record import SlotState
from llamabatch._core.strategies import strategy_name

cdef object _CREATE = object()
cdef tuple _STATE_BY_VALUE = tuple(SlotState)


cdef TableView make_view(SlotRecord t, const int32_t * rr_cursor, const int32_t * fifo, const int32_t * n_fifo):
    """A read-only view of the table ``t``, whose round-robin cursor, FIFO of prompts and its
    length are at ``rr_cursor``, ``fifo`` and ``n_fifo`` (fields of ``t``: valid while it is)."""
    cdef TableView v = TableView.__new__(TableView, _CREATE)
    v.t = t
    v.rr_cursor = rr_cursor
    v.fifo = fifo
    v.n_fifo = n_fifo
    return v


cdef str violation(SlotRecord t, const plan_in_t * p, const int32_t * mark, int32_t s, int64_t k, int64_t total):
    """Why ``(s, k)`` cannot join a plan already holding ``total`` tokens (its slots marked in
    ``mark``), or None."""
    cdef slot_t * sl
    if s < 0 or s >= t.n_parallel:
        return "slot %d out of range 0..%d" % (s, t.n_parallel - 1)
    sl = &t.slots[s]
    if mark[s]:
        return "slot %d planned twice" % s
    if sl.state == ST_DECODE:
        if k != 1:
            return "decoding slot %d must get exactly 1 token, got %d" % (s, k)
    elif sl.state == ST_PREFILL:
        if k < 1 or k > min(sl.n_prompt - sl.n_past, p.chunk_size):
            return "prefilling slot %d must get 1..%d tokens (pending %d, chunk_size %d), got %d" % (
                s, min(sl.n_prompt - sl.n_past, p.chunk_size), sl.n_prompt - sl.n_past,
                p.chunk_size, k)
    else:
        return "slot %d cannot be scheduled (%s)" % (s, _STATE_BY_VALUE[sl.state].name)
    if total + k > p.budget:
        return "plan exceeds the budget of %d tokens (%d so far)" % (p.budget, total + k)
    return None


cdef int32_t read_plan(TableView view, object strategy, const plan_in_t * p, int32_t * mark,
                       int32_t * plan_slot, int32_t * plan_n) except -1:
    """Run a Python strategy's ``plan()`` on ``view`` and validate it into ``plan_slot`` /
    ``plan_n`` (``mark``: scratch of a flag per slot); return its length. ``ValueError`` names
    the strategy and what is wrong."""
    cdef SlotRecord t = view.table()
    cdef int32_t n = 0, s
    cdef int64_t k, total = 0
    cdef str why
    name = strategy_name(strategy)
    result = strategy.plan(view, p.budget, p.chunk_size, p.queue_depth)
    try:
        it = iter(result)
    except TypeError:
        raise ValueError("strategy %r: plan() returned %r, not an iterable of (slot, n_tokens)"
                         % (name, type(result).__name__)) from None
    memset(mark, 0, t.n_parallel * sizeof(int32_t))
    for item in it:
        try:
            a, b = item
            a = operator.index(a)
            b = operator.index(b)
        except (TypeError, ValueError):
            raise ValueError("strategy %r: plan entry %r is not a (slot, n_tokens) pair of ints"
                             % (name, item)) from None
        if not (0 <= a < t.n_parallel):
            raise ValueError("strategy %r: slot %r out of range 0..%d" % (name, a, t.n_parallel - 1))
        if not (-2**62 < b < 2**62):
            raise ValueError("strategy %r: n_tokens %r out of range" % (name, b))
        s = a
        k = b
        why = violation(t, p, mark, s, k, total)
        if why is not None:
            raise ValueError("strategy %r: %s" % (name, why))
        mark[s] = 1
        plan_slot[n] = s
        plan_n[n] = <int32_t> k
        total += k
        n += 1
    return n


cdef int check_native_plan(SlotRecord t, object strategy, const plan_in_t * p, int32_t n, int32_t * mark,
                           const int32_t * plan_slot, const int32_t * plan_n) except -1:
    """Debug builds: raise ``RuntimeError`` if the ``n`` entries a built-in strategy planned
    break a rule a Python strategy's plan is held to."""
    cdef int32_t e
    cdef int64_t total = 0
    cdef str why
    memset(mark, 0, t.n_parallel * sizeof(int32_t))
    for e in range(n):
        why = violation(t, p, mark, plan_slot[e], plan_n[e], total)
        if why is not None:
            raise RuntimeError("built-in strategy %r: %s" % (strategy_name(strategy), why))
        mark[plan_slot[e]] = 1
        total += plan_n[e]
    return 0


cdef class TableView:
    """Read-only view of a :class:`~llamabatch._core.slots.SlotTable` (the ``view`` a
    strategy's plan receives)."""

    def __cinit__(self, *args):
        if not args or args[0] is not _CREATE:
            raise TypeError("TableView objects are made by SlotTable; they cannot be created from Python")

    cdef SlotRecord table(self):
        if self.t is None:
            raise RuntimeError("this view was only valid during plan()")
        return self.t

    @property
    def n_parallel(self):
        return self.table().n_parallel

    @property
    def decode_slots(self):
        """DECODE slots in round-robin order (the order the built-ins serve them)."""
        cdef SlotRecord t = self.table()
        cdef int32_t j, i
        out = []
        for j in range(t.n_parallel):
            i = (self.rr_cursor[0] + j) % t.n_parallel
            if t.slots[i].state == ST_DECODE:
                out.append(i)
        return out

    @property
    def prefill_slots(self):
        """PREFILL slots in arrival order (oldest first)."""
        self.table()
        cdef int32_t j
        return [self.fifo[j] for j in range(self.n_fifo[0])]

    def state(self, slot):
        return self.table().state(slot)

    def n_pending(self, slot):
        return self.table().n_pending(slot)

    def n_past(self, slot):
        return self.table().n_past(slot)

    def arrival(self, slot):
        return self.table().arrival(slot)

    def n_generated(self, slot):
        return self.table().n_generated(slot)
