"""Batching strategies: who gets how many tokens of the next ``llama_batch``.

Every tick, :meth:`SlotTable.fill` asks a strategy for a *plan*: a list of
``(slot, n_tokens)`` pairs, in batch order, within a token budget. Only two kinds of slot
can be planned: a DECODE slot (one token: its last sampled token) and a PREFILL slot (a
chunk of its remaining prompt). The table then writes the batch and records the outputs.

Built-in strategies (Cython; ``fill`` calls their C-level ``plan_c`` with no Python object
per token). With ``b`` the budget, ``nd`` the DECODE slots and ``P`` the prompt tokens the
PREFILL slots could take (each ``min(pending, chunk_size)``):

``decode_maximal`` (default)
    every DECODE slot's token first, then prompt chunks with the rest. If the decode
    tokens alone would fill the budget and a prompt is waiting, one token is left to the
    prompt (when ``b >= 2``), so prefill never starves.
``prefill_priority``
    prompt chunks first, then decode tokens with the rest; one token is kept for decode
    when a slot is decoding (when ``b >= 2``), so decode never starves.
``balanced``
    decode gets up to ``b // 2`` tokens, prefill the rest; budget unused by one side
    flows to the other.

Within a side, the order is fixed by the table: prompt chunks go to PREFILL slots in
arrival order (FIFO; the oldest prompt first, each at most ``chunk_size`` tokens), decode
tokens to DECODE slots in round-robin order (when not all of them fit, the next tick
starts with the first one left out). Built-ins lay the batch out decode entries first,
except ``prefill_priority`` (prompt chunks first).

User-defined strategies
-----------------------
Any object with this method (subclassing :class:`Strategy` is optional)::

    class MyStrategy:
        name = "mine"            # optional; used in error messages

        def plan(self, view, budget, chunk_size, queue_depth):
            # return an iterable of (slot, n_tokens) pairs, in batch order
            ...

``view`` is a read-only view of the table, valid during the call:

- ``view.decode_slots``: list of DECODE slots, in round-robin order;
- ``view.prefill_slots``: list of PREFILL slots, in arrival order (oldest first);
- ``view.n_parallel``; ``view.state(slot)`` (a ``SlotState``); ``view.n_pending(slot)``
  (prompt tokens still to compute); ``view.n_past(slot)`` (tokens in the KV cache);
  ``view.arrival(slot)`` (increasing start counter); ``view.n_generated(slot)``.

``budget`` is the tick's ``n_batch``; ``queue_depth`` the number of requests waiting for
a free slot (for adaptive strategies). The table validates the plan and raises
``ValueError`` naming the strategy and the violation unless: every slot is a DECODE or
PREFILL slot and appears at most once; a DECODE slot gets exactly 1 token; a PREFILL slot
gets ``1 .. min(n_pending, chunk_size)`` tokens; the total is at most ``budget``. An
exception raised by ``plan`` propagates from ``fill``; the table is left unchanged.
A plan may be empty. The table's starvation guarantees hold for the built-ins only.
"""

from libc.stdint cimport int32_t

from array import array


cdef inline int32_t _min(int32_t a, int32_t b) noexcept nogil:
    return a if a < b else b


cdef int32_t _prefill_tokens(const plan_in_t * p, int32_t limit) noexcept nogil:
    """Prompt tokens the FIFO would take within ``limit`` (the count of _emit_prefill)."""
    cdef int32_t i, t, taken = 0
    for i in range(p.n_prefill):
        if taken >= limit:
            break
        t = _min(_min(p.prefill_pending[i], p.chunk_size), limit - taken)
        if t > 0:
            taken += t
    return taken


cdef inline int32_t _emit_prefill(const plan_in_t * p, int32_t limit, int32_t * out_slot,
                                  int32_t * out_n, int32_t k) noexcept nogil:
    cdef int32_t i, t, taken = 0
    for i in range(p.n_prefill):
        if taken >= limit:
            break
        t = _min(_min(p.prefill_pending[i], p.chunk_size), limit - taken)
        if t <= 0:
            continue
        out_slot[k] = p.prefill_slots[i]
        out_n[k] = t
        k += 1
        taken += t
    return k


cdef inline int32_t _emit_decode(const plan_in_t * p, int32_t kd, int32_t * out_slot,
                                 int32_t * out_n, int32_t k) noexcept nogil:
    cdef int32_t i
    for i in range(kd):
        out_slot[k] = p.decode_slots[i]
        out_n[k] = 1
        k += 1
    return k


cdef class Strategy:
    """Base class of the strategies (optional for user strategies: see the module docstring)."""

    name = None

    def __cinit__(self, *args, **kwargs):
        self.native = type(self) in _NATIVE

    cdef int32_t plan_c(self, const plan_in_t * p, int32_t * out_slot, int32_t * out_n) noexcept nogil:
        return 0

    def plan(self, view, budget, chunk_size, queue_depth=0):
        """Return an iterable of ``(slot, n_tokens)`` pairs, in batch order."""
        raise NotImplementedError("%s.plan() is not implemented" % type(self).__name__)

    def __repr__(self):
        return "%s()" % type(self).__name__


cdef list _plan_from_view(Strategy s, view, int32_t budget, int32_t chunk_size, int32_t queue_depth):
    """Run a built-in's C plan over any object with the view protocol (tests, subclasses)."""
    cdef plan_in_t p
    cdef int32_t n, i
    if budget < 1 or chunk_size < 1:
        raise ValueError("budget and chunk_size must be >= 1")
    dec = array("i", view.decode_slots)
    pre = array("i", view.prefill_slots)
    pend = array("i", [view.n_pending(x) for x in pre])
    out_slot = array("i", bytes(4 * (len(dec) + len(pre) + 1)))
    out_n = array("i", bytes(4 * (len(dec) + len(pre) + 1)))
    cdef int32_t[::1] dv = dec
    cdef int32_t[::1] pv = pre
    cdef int32_t[::1] qv = pend
    cdef int32_t[::1] os_ = out_slot
    cdef int32_t[::1] on = out_n
    p.budget = budget
    p.chunk_size = chunk_size
    p.queue_depth = queue_depth
    p.n_decode = len(dec)
    p.decode_slots = &dv[0] if len(dec) else NULL
    p.n_prefill = len(pre)
    p.prefill_slots = &pv[0] if len(pre) else NULL
    p.prefill_pending = &qv[0] if len(pre) else NULL
    n = s.plan_c(&p, &os_[0], &on[0])
    return [(out_slot[i], out_n[i]) for i in range(n)]


cdef class DecodeMaximal(Strategy):
    """Every decoding slot's token first, then prompt chunks (FIFO) with the rest."""

    name = "decode_maximal"

    cdef int32_t plan_c(self, const plan_in_t * p, int32_t * out_slot, int32_t * out_n) noexcept nogil:
        cdef int32_t b = p.budget
        cdef int32_t kd = _min(p.n_decode, b)
        if kd == b and b >= 2 and p.n_prefill > 0:
            kd = b - 1  # leave one token to the oldest prompt: prefill never starves
        cdef int32_t k = _emit_decode(p, kd, out_slot, out_n, 0)
        return _emit_prefill(p, b - kd, out_slot, out_n, k)

    def plan(self, view, budget, chunk_size, queue_depth=0):
        return _plan_from_view(self, view, budget, chunk_size, queue_depth)


cdef class PrefillPriority(Strategy):
    """Prompt chunks (FIFO) first, then decode tokens with the rest."""

    name = "prefill_priority"

    cdef int32_t plan_c(self, const plan_in_t * p, int32_t * out_slot, int32_t * out_n) noexcept nogil:
        cdef int32_t b = p.budget
        cdef int32_t reserve = 1 if (p.n_decode > 0 and b >= 2) else 0
        cdef int32_t tp = _prefill_tokens(p, b - reserve)
        cdef int32_t k = _emit_prefill(p, b - reserve, out_slot, out_n, 0)
        return _emit_decode(p, _min(p.n_decode, b - tp), out_slot, out_n, k)

    def plan(self, view, budget, chunk_size, queue_depth=0):
        return _plan_from_view(self, view, budget, chunk_size, queue_depth)


cdef class Balanced(Strategy):
    """Decode up to half the budget, prefill the rest; unused budget flows both ways."""

    name = "balanced"

    cdef int32_t plan_c(self, const plan_in_t * p, int32_t * out_slot, int32_t * out_n) noexcept nogil:
        cdef int32_t b = p.budget
        cdef int32_t kd = _min(p.n_decode, b // 2)
        cdef int32_t tp = _prefill_tokens(p, b - kd)
        kd += _min(p.n_decode - kd, b - kd - tp)
        cdef int32_t k = _emit_decode(p, kd, out_slot, out_n, 0)
        return _emit_prefill(p, b - kd, out_slot, out_n, k)

    def plan(self, view, budget, chunk_size, queue_depth=0):
        return _plan_from_view(self, view, budget, chunk_size, queue_depth)


cdef tuple _NATIVE = (DecodeMaximal, PrefillPriority, Balanced)

#: Built-in strategies by name.
STRATEGIES = {
    "decode_maximal": DecodeMaximal,
    "prefill_priority": PrefillPriority,
    "balanced": Balanced,
}


def get_strategy(spec="decode_maximal"):
    """A strategy from its name (``"decode_maximal"``, ``"prefill_priority"``, ``"balanced"``)
    or an instance (a built-in or any object with a ``plan`` method), returned as is."""
    if isinstance(spec, str):
        key = spec.strip().lower().replace("-", "_")
        try:
            return STRATEGIES[key]()
        except KeyError:
            raise ValueError(
                "unknown strategy %r; choose one of %s or pass an object with a plan() method"
                % (spec, ", ".join(STRATEGIES))
            ) from None
    if isinstance(spec, type):
        raise TypeError("pass a strategy instance, not the class %s" % spec.__name__)
    if not callable(getattr(spec, "plan", None)):
        raise TypeError("a strategy needs a plan(view, budget, chunk_size, queue_depth) method: %r" % (spec,))
    return spec


def strategy_name(strategy):
    """The name used for ``strategy`` in messages."""
    name = getattr(strategy, "name", None)
    return name if isinstance(name, str) and name else type(strategy).__name__
