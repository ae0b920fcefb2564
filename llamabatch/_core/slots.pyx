"""The slot table: per-sequence scheduling state and the per-tick batch fill.

``n_parallel`` slots; slot ``i`` is llama.cpp sequence ``seq_id == i``. Each slot holds
its token history (prompt + accepted tokens, a preallocated C array of ``n_ctx_seq``
tokens), how many of those are in the KV cache (``n_past``, the next position) and its
state::

    IDLE --start--> PREFILL --commit (last prompt token decoded)--> AWAIT_SAMPLE
    AWAIT_SAMPLE --accept(token)--> DECODE --commit--> AWAIT_SAMPLE
    PREFILL / AWAIT_SAMPLE / DECODE --finish--> IDLE

Every state change goes through one transition function; in a debug build
(``LLAMABATCH_DEBUG=1`` at build time) it raises ``RuntimeError`` on an edge not in
``EDGES``, and ``fill``/``commit`` check the table's invariants.

One tick, as the engine runs it::

    n = table.fill(batch, strategy, n_batch, queue_depth)  # writes the batch, nothing else
    rc = llama_decode(ctx, batch)                         # (cffi)
    if rc == 0:
        table.commit()       # progress: n_past advances; slots with logits -> AWAIT_SAMPLE
        for slot, idx in table.outputs():
            tok = sample(slot, idx)                       # llama_sampler_sample(..., idx)
            table.accept(slot, tok)  # or table.finish(slot) when the request is done
    else:
        table.rollback()     # forget the fill; fill again with a smaller n_batch

``fill`` only writes the batch and records the plan; ``commit`` applies it and
``rollback`` drops it, so a failed decode leaves the table exactly as before the fill.
A fill must be committed or rolled back before the next one; a fill that returns 0
leaves nothing pending (``commit()``/``rollback()`` right after it are no-ops).

What each slot and sequence holds (states, lengths, token histories, the KV cells, prefix
matching, the edits of resting sequences between ticks) is the table's base class,
``SlotRecord`` of ``slot_record.pyx``; this module is the state machine and the tick.
``finish(slot, keep=True)`` leaves an idle slot holding its tokens for reuse.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport int8_t, int32_t
from libc.string cimport memcmp, memcpy, memset

from llamabatch._core.batch cimport Batch, as_int32, int32_array
from llamabatch._core.includes.debug cimport LLAMABATCH_DEBUG
from llamabatch._core.strategies cimport Strategy, plan_in_t
from llamabatch._core.ubatch_runs cimport cheapest_runs
from llamabatch._core.user_plans cimport TableView, check_native_plan, make_view, read_plan

from llamabatch._core.slot_record import SlotState
from llamabatch._core.strategies import get_strategy
from llamabatch.errors import PromptTooLong

#: True when the core was built with LLAMABATCH_DEBUG=1 (transition and invariant checks).
DEBUG = bool(LLAMABATCH_DEBUG)

#: The most draft tokens a slot can verify in one tick (speculative decoding).
MAX_DRAFT = C_MAX_DRAFT

cdef Py_ssize_t _live_tables = 0


def live_tables():
    """Number of ``SlotTable`` C buffers currently allocated in this process."""
    return _live_tables


#: The allowed state transitions, as (from, to) pairs.
EDGES = frozenset(
    {
        (SlotState.IDLE, SlotState.PREFILL),
        (SlotState.PREFILL, SlotState.AWAIT_SAMPLE),
        (SlotState.PREFILL, SlotState.IDLE),
        (SlotState.AWAIT_SAMPLE, SlotState.DECODE),
        (SlotState.AWAIT_SAMPLE, SlotState.IDLE),
        (SlotState.DECODE, SlotState.AWAIT_SAMPLE),
        (SlotState.DECODE, SlotState.IDLE),
    }
)

cdef bint _EDGE[N_STATES][N_STATES]
memset(_EDGE, 0, sizeof(_EDGE))
for _a, _b in EDGES:
    _EDGE[<int> _a][<int> _b] = True

cdef tuple _STATE_BY_VALUE = tuple(SlotState)

# Built-in strategies are stateless: one shared instance per name for fill(batch, "name", ...).
cdef dict _BY_NAME = {name: get_strategy(name) for name in ("decode_maximal", "prefill_priority", "balanced")}


cdef class SlotTable(SlotRecord):
    """``n_parallel`` slots of up to ``n_ctx_seq`` tokens; prompt chunks of ``chunk_size``.

    All memory is allocated here, once: token histories, the FIFO of prompts, the plan,
    the outputs. ``fill``/``commit`` allocate nothing.
    """

    def __cinit__(self, int32_t n_parallel, int32_t n_ctx_seq, int32_t chunk_size=512,
                  int32_t n_pinned=0, bint kv_unified=True, int32_t kv_size=0):
        cdef size_t n = n_parallel
        self.init_record(n_parallel, n_ctx_seq, n_pinned, kv_unified, kv_size)
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1, got %d" % chunk_size)
        self.chunk_size = chunk_size
        self.fifo = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_decode = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_pending = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_plan_slot = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_plan_n = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_mark = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_sorted = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_order = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.s_cut = <int32_t *> PyMem_Calloc(n + 1, sizeof(int32_t))
        self.s_best = <double *> PyMem_Calloc(n + 1, sizeof(double))
        self.s_ext = <double *> PyMem_Calloc(n, sizeof(double))
        self.plan_slot = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        self.plan_n = <int32_t *> PyMem_Calloc(n, sizeof(int32_t))
        # one output per slot, plus one per draft token (speculative decoding)
        self.out_slot_ = <int32_t *> PyMem_Calloc(n * (1 + C_MAX_DRAFT), sizeof(int32_t))
        self.out_index_ = <int32_t *> PyMem_Calloc(n * (1 + C_MAX_DRAFT), sizeof(int32_t))
        if (self.fifo == NULL or self.s_decode == NULL
                or self.s_pending == NULL or self.s_plan_slot == NULL or self.s_plan_n == NULL
                or self.s_mark == NULL or self.plan_slot == NULL or self.plan_n == NULL
                or self.s_sorted == NULL or self.s_order == NULL or self.s_cut == NULL or self.s_best == NULL
                or self.s_ext == NULL
                or self.out_slot_ == NULL or self.out_index_ == NULL):
            raise MemoryError(
                "cannot allocate a slot table of %d x %d tokens" % (n_parallel, n_ctx_seq)
            )
        global _live_tables
        _live_tables += 1

    def __dealloc__(self):
        global _live_tables
        if self.out_index_ != NULL:
            _live_tables -= 1
        PyMem_Free(self.fifo)
        PyMem_Free(self.s_decode)
        PyMem_Free(self.s_pending)
        PyMem_Free(self.s_plan_slot)
        PyMem_Free(self.s_plan_n)
        PyMem_Free(self.s_mark)
        PyMem_Free(self.s_sorted)
        PyMem_Free(self.s_order)
        PyMem_Free(self.s_cut)
        PyMem_Free(self.s_best)
        PyMem_Free(self.s_ext)
        PyMem_Free(self.plan_slot)
        PyMem_Free(self.plan_n)
        PyMem_Free(self.out_slot_)
        PyMem_Free(self.out_index_)

    # ------------------------------------------------------------------ state machine

    cdef int transition(self, int32_t slot, int32_t new_state) except -1:
        """The only place a slot's state changes (plus the FIFO of PREFILL slots)."""
        cdef slot_t * s = &self.slots[slot]
        cdef int32_t old = s.state, i, j
        if LLAMABATCH_DEBUG:
            if not _EDGE[old][new_state]:
                raise RuntimeError(
                    "illegal slot state transition %s -> %s (slot %d)"
                    % (_STATE_BY_VALUE[old].name, _STATE_BY_VALUE[new_state].name, slot)
                )
        if old == ST_PREFILL:  # leave the FIFO
            j = 0
            for i in range(self.n_fifo):
                if self.fifo[i] != slot:
                    self.fifo[j] = self.fifo[i]
                    j += 1
            self.n_fifo = j
        if new_state == ST_PREFILL:  # join the FIFO, last
            s.arrival = self.next_arrival
            self.next_arrival += 1
            self.fifo[self.n_fifo] = slot
            self.n_fifo += 1
        elif new_state == ST_IDLE:
            s.n_prompt = 0
            s.n_hist = 0
            s.n_past = 0
            s.reused_tokens = 0
        s.state = new_state
        return 0

    cdef int check_not_planning(self) except -1:
        if self.in_plan:
            raise RuntimeError("the slot table cannot be changed from inside a strategy's plan()")
        return 0

    cdef int check_quiet(self) except -1:
        self.check_not_planning()
        if self.fill_pending:
            raise RuntimeError("the KV record cannot change while a fill is pending")
        return 0

    def start(self, int32_t slot, prompt_tokens, int32_t n_past=0, int32_t score_chunk=0):
        """Start a request in an IDLE slot: IDLE -> PREFILL.

        ``prompt_tokens``: any int32 buffer or sequence of ints. ``n_past > 0``: tokens
        ``[0:n_past)`` are already in this sequence's KV cache (a copied prefix); positions
        continue at ``n_past`` and only ``prompt_tokens[n_past:]`` is computed. At least the
        last prompt token is always computed (``0 <= n_past <= len - 1``). Raises
        ``PromptTooLong`` (a ``ValueError``) if the prompt exceeds ``n_ctx_seq``.
        ``score_chunk > 0``: each prompt row computed has logits (``n_score_rows``), <= that a tick.
        """
        self.check_not_planning()
        self.check_slot(slot)
        cdef slot_t * s = &self.slots[slot]
        if s.state != ST_IDLE:
            raise ValueError("slot %d is busy (%s)" % (slot, _STATE_BY_VALUE[s.state].name))
        cdef const int32_t[::1] toks = as_int32(prompt_tokens)
        cdef Py_ssize_t n = toks.shape[0]
        if n == 0:
            raise ValueError("empty prompt")
        if n > self.n_ctx_seq:
            raise PromptTooLong(
                "prompt of %d tokens does not fit the %d-token context of a slot" % (n, self.n_ctx_seq)
            )
        if score_chunk < 0:
            raise ValueError("score_chunk must be >= 0, got %d" % score_chunk)
        if n_past < 0 or n_past > n - 1:
            raise ValueError("n_past must be in 0..%d (the last prompt token is always computed), got %d"
                             % (n - 1, n_past))
        if s.n_past != n_past:
            raise ValueError("slot %d holds %d tokens in the KV cache, not n_past=%d (trim or copy first)"
                             % (slot, s.n_past, n_past))
        if n_past and memcmp(self.hist + <size_t> slot * self.n_ctx_seq, &toks[0], n_past * sizeof(int32_t)):
            raise ValueError("slot %d's cached tokens are not the prompt's first %d tokens" % (slot, n_past))
        memcpy(self.hist + <size_t> slot * self.n_ctx_seq, &toks[0], n * sizeof(int32_t))
        s.n_prompt = <int32_t> n
        s.n_hist = <int32_t> n
        s.n_past = n_past
        s.reused_tokens = n_past
        s.score_chunk = score_chunk
        s.fill_n = 0
        self.kv.touch_seq(slot)
        self.transition(slot, ST_PREFILL)

    def accept(self, int32_t slot, int32_t token):
        """Append a sampled token: AWAIT_SAMPLE -> DECODE; it is the slot's next decode input.

        Raises ``ValueError`` if the slot is not awaiting a sample or its history already
        holds ``n_ctx_seq`` tokens (no room to decode another: finish the request instead).
        """
        self.check_not_planning()
        self.check_slot(slot)
        cdef slot_t * s = &self.slots[slot]
        if s.state != ST_AWAIT_SAMPLE:
            raise ValueError("slot %d is not awaiting a sample (%s)" % (slot, _STATE_BY_VALUE[s.state].name))
        if s.n_hist >= self.n_ctx_seq:
            raise ValueError("slot %d is full: its %d tokens fill n_ctx_seq" % (slot, s.n_hist))
        self.hist[<size_t> slot * self.n_ctx_seq + s.n_hist] = token
        s.n_hist += 1
        s.n_draft = 0
        self.transition(slot, ST_DECODE)

    def set_draft(self, int32_t slot, tokens):
        """Speculative decoding: draft tokens to verify after a DECODE slot's decode token.

        They are written after the history (not part of it) and join the next fill only as
        far as the budget left after the strategy's plan allows, each with its logits; the
        slot's outputs are then its decode token's row and one row per draft token, in
        order. ``commit`` makes the decoded drafts part of the history and the KV record;
        ``reject`` removes the ones the sampler did not accept. At most ``MAX_DRAFT`` and
        what fits the slot's context; returns how many were set (0 clears the draft).
        """
        self.check_not_planning()
        self.check_slot(slot)
        cdef slot_t * s = &self.slots[slot]
        if s.state != ST_DECODE:
            raise ValueError("slot %d is not decoding (%s)" % (slot, _STATE_BY_VALUE[s.state].name))
        if self.fill_pending:
            raise RuntimeError("set_draft() while a fill is pending")
        cdef const int32_t[::1] toks = as_int32(tokens)
        cdef Py_ssize_t n = min(toks.shape[0], <Py_ssize_t> C_MAX_DRAFT, <Py_ssize_t> (self.n_ctx_seq - s.n_hist))
        if n > 0:
            memcpy(self.hist + <size_t> slot * self.n_ctx_seq + s.n_hist, &toks[0], n * sizeof(int32_t))
        s.n_draft = <int32_t> max(n, 0)
        return s.n_draft

    def draft_in_fill(self, int32_t slot):
        """Draft tokens of ``slot`` in the last fill (after ``commit``: the ones decoded)."""
        self.check_slot(slot)
        return self.slots[slot].fill_draft if self.slots[slot].fill_n else 0

    def reject(self, int32_t slot, int32_t n):
        """Remove the last ``n`` decoded draft tokens of an AWAIT_SAMPLE slot from its history
        and the KV record (mirror it with ``llama_memory_seq_rm(slot, n_past, -1)``)."""
        self.check_not_planning()
        self.check_slot(slot)
        cdef slot_t * s = &self.slots[slot]
        if s.state != ST_AWAIT_SAMPLE:
            raise ValueError("slot %d is not awaiting a sample (%s)" % (slot, _STATE_BY_VALUE[s.state].name))
        if n < 0 or n > s.fill_draft:
            raise ValueError("slot %d decoded %d draft tokens, cannot reject %d" % (slot, s.fill_draft, n))
        if n:
            self.kv_release(slot, s.n_past - n)
            s.n_hist = s.n_past
            s.fill_draft -= n

    def finish(self, int32_t slot, bint keep=False):
        """End the slot's request (done, cancelled or preempted), from any busy state: -> IDLE.

        ``keep``: the idle slot goes on holding the tokens that are in its KV cache
        (``n_past`` of them) for prefix reuse; otherwise its cells are released (the
        caller removes them from llama.cpp's cache). If a fill is pending, the slot drops
        out of its commit (its output is skipped).
        """
        self.check_not_planning()
        self.check_slot(slot)
        cdef slot_t * s = &self.slots[slot]
        cdef int32_t n = s.n_past
        if s.state == ST_IDLE:
            raise ValueError("slot %d is already idle" % slot)
        if not keep:
            self.kv_release(slot, 0)
            n = 0
        s.fill_n = 0
        s.n_draft = 0
        s.fill_draft = 0
        s.score_chunk = 0
        self.transition(slot, ST_IDLE)
        s.n_past = n
        s.n_hist = n

    def _transition(self, int32_t slot, state):
        """Test hook: call the transition function directly (checked in debug builds only)."""
        self.check_slot(slot)
        self.transition(slot, int(state))

    # ------------------------------------------------------------------ the tick

    cdef int32_t gather(self, plan_in_t * p) noexcept nogil:
        """Schedulable slots in order: DECODE round-robin from the cursor, PREFILL FIFO."""
        cdef int32_t j, i = self.rr_cursor, nd = 0
        for j in range(self.n_parallel):
            if self.slots[i].state == ST_DECODE:
                self.s_decode[nd] = i
                self.slots[i].rank = nd
                nd += 1
            i += 1
            if i == self.n_parallel:
                i = 0
        for j in range(self.n_fifo):
            i = self.fifo[j]
            self.s_pending[j] = self.slots[i].n_prompt - self.slots[i].n_past
            if self.slots[i].score_chunk and self.s_pending[j] > self.slots[i].score_chunk:
                self.s_pending[j] = self.slots[i].score_chunk  # its rows' logits are bounded
        p.n_decode = nd
        p.decode_slots = self.s_decode
        p.n_prefill = self.n_fifo
        p.prefill_slots = self.fifo
        p.prefill_pending = self.s_pending
        return nd

    cdef void batch_order(self, int32_t n) noexcept nogil:
        """Order the plan's entries (k tokens each in s_plan_n) into s_order, the batch order.

        A unified cache keeps the plan's order. With one stream per sequence llama.cpp
        splits a batch into ubatches of *consecutive* seq_ids (it scans the batch in order
        and takes a sequence only if its seq_id is the last one's + 1), and a ubatch's
        attention spans as many cells in every stream as its longest stream holds. So the
        entries go by slot, in runs: one more ubatch reads the weights once more
        (``ubatch_cost_cells``, in cell reads), a run of r streams reads r x its longest
        stream. The cheapest runs (``ubatch_runs.pyx``: dynamic programming over the slots in
        order, cut at least wherever a slot is missing) are written last run first, which is what makes
        llama.cpp cut between them: a run's lowest seq_id never follows the next run's
        highest. One long stream among short ones then costs its own ubatch instead of
        making every short stream attend over its length (a decode tick of 7 short streams
        and one of 6,000 tokens: 214 ms in one ubatch, 70 ms in two, 135M, 2 threads)."""
        cdef int32_t e, j, m = 0
        cdef double ext, mx_ext, mn_ext, sum_k, f = self.ubatch_cost_cells
        cdef double pad = 256.0, size = self.kv.kv_size  # llama.cpp pads n_kv to 256 cells
        if self.kv.kv_unified or n < 2:
            for e in range(n):
                self.s_order[e] = e
            return
        for j in range(self.n_parallel):
            self.s_mark[j] = 0
        for e in range(n):
            self.s_mark[self.s_plan_slot[e]] = e + 1
        for j in range(self.n_parallel):
            if self.s_mark[j]:
                self.s_sorted[m] = self.s_mark[j] - 1
                m += 1
        # No cuts of ours when none is allowed, or none can pay: a cut spares each token at
        # most the longest stream's cells less the shortest's.
        mx_ext, mn_ext, sum_k = 0.0, size, 0.0
        for e in range(n if f > 0.0 else 0):
            ext = min(size, (self.slots[self.s_plan_slot[e]].n_past + self.s_plan_n[e] + pad - 1) // pad * pad)
            self.s_ext[e] = ext
            mx_ext = max(mx_ext, ext)
            mn_ext = min(mn_ext, ext)
            sum_k += self.s_plan_n[e]
        if f <= 0.0 or sum_k * (mx_ext - mn_ext) <= f:  # consecutive slots share a ubatch
            for e in range(m):
                self.s_order[e] = self.s_sorted[e]
            return
        cheapest_runs(m, self.s_sorted, self.s_plan_slot, self.s_plan_n, self.s_ext, f,
                      self.s_cut, self.s_best, self.s_order)

    cdef int32_t apply_plan(self, Batch batch, int32_t n, int32_t n_decode_cand, int32_t budget) noexcept nogil:
        """Write the (valid) plan in s_plan_* to the batch, in ``batch_order``, and record it
        as the pending fill; DECODE slots with a draft get draft tokens from the budget the
        plan left spare."""
        cdef int32_t e, w, j, s, k, idx = 0, n_out = 0, nd = 0, npf = 0, max_rank = -1, p0, d, ndr = 0, nsc = 0
        cdef int32_t spare = budget, below = self.draft_rows_below, d_max = C_MAX_DRAFT
        cdef slot_t * sl
        cdef int32_t * tok = batch.c.token
        cdef int32_t * pos = batch.c.pos
        cdef int32_t * nsid = batch.c.n_seq_id
        cdef int32_t ** sid = batch.c.seq_id
        cdef int8_t * lg = batch.c.logits
        cdef int32_t * storage = batch.seq_storage
        cdef int32_t nseq = batch.n_seq_max_
        for j in range(self.n_parallel):
            self.slots[j].fill_n = 0
            self.slots[j].fill_draft = 0
        for e in range(n):
            k = self.slots[self.s_plan_slot[e]].score_chunk  # (a Python strategy's plan too)
            if k and self.s_plan_n[e] > k:
                self.s_plan_n[e] = k
            spare -= self.s_plan_n[e]
        if below > 0:  # drafts must not move a stream's rows onto the tiled kernel (see .pxd)
            d_max = max(below - 2, 0)  # a decode row and its drafts
            if self.kv.kv_unified and budget - spare < below:  # one stream: all rows count
                spare = min(spare, below - 1 - (budget - spare))
        for e in range(n):  # drafts take the spare budget in the plan's order
            s = self.s_plan_slot[e]
            d = 0
            if self.slots[s].state == ST_DECODE and self.slots[s].n_draft > 0 and spare > 0:
                d = min(self.slots[s].n_draft, spare, d_max)
                spare -= d
                ndr += d
            self.slots[s].fill_draft = d
            self.s_plan_n[e] += d
        self.batch_order(n)
        for w in range(n):
            e = self.s_order[w]
            s = self.s_plan_slot[e]
            k = self.s_plan_n[e]
            sl = &self.slots[s]
            d = sl.fill_draft
            self.plan_slot[w] = s
            self.plan_n[w] = k
            sl.fill_n = k
            sl.fill_first = idx
            p0 = sl.n_past
            memcpy(tok + idx, self.hist + <size_t> s * self.n_ctx_seq + p0, k * sizeof(int32_t))
            memset(lg + idx, 0, k)
            for j in range(k):
                pos[idx + j] = p0 + j
                nsid[idx + j] = 1
            if nseq == 1:  # seq_id[i] points at storage[i] (set up by the pool, never moved)
                for j in range(k):
                    storage[idx + j] = s
            else:
                for j in range(k):
                    sid[idx + j][0] = s
            if sl.state == ST_DECODE:
                nd += 1
                if sl.rank > max_rank:
                    max_rank = sl.rank
                for j in range(1 + d):  # the decode token's row, then one per draft token
                    lg[idx + j] = 1
                    self.out_slot_[n_out] = s
                    self.out_index_[n_out] = idx + j
                    n_out += 1
            else:
                npf += k
                if sl.score_chunk:  # every row: the log-probability of the prompt's next token
                    memset(lg + idx, 1, k)
                    nsc += k
                if p0 + k == sl.n_prompt:  # the last prompt token: its logits start sampling
                    lg[idx + k - 1] = 1
                    self.out_slot_[n_out] = s
                    self.out_index_[n_out] = idx + k - 1
                    n_out += 1
            idx += k
        batch.c.n_tokens = idx
        self.n_plan = n
        self.n_outputs = n_out
        self.n_decode_tokens = nd
        self.n_prefill_tokens = npf
        self.n_draft_tokens = ndr
        self.n_score_rows = nsc
        self.next_cursor = self.rr_cursor
        if nd < n_decode_cand and max_rank >= 0:  # some left out: they come first next tick
            self.next_cursor = self.s_decode[max_rank] + 1
            if self.next_cursor == self.n_parallel:
                self.next_cursor = 0
        self.fill_pending = idx > 0  # an empty fill leaves nothing to commit
        self.empty_fill = idx == 0
        return idx

    cdef int32_t fill_python(self, object strategy, plan_in_t * p) except -1:
        """Run a Python strategy's plan() on a view valid only meanwhile, with the table
        frozen, and validate it into s_plan_* (``user_plans.pyx``); returns its length."""
        cdef TableView view = make_view(self, &self.rr_cursor, self.fifo, &self.n_fifo)
        self.in_plan = True
        try:
            return read_plan(view, strategy, p, self.s_mark, self.s_plan_slot, self.s_plan_n)
        finally:
            self.in_plan = False
            view.t = None

    cpdef int32_t fill(self, Batch batch, object strategy, int32_t n_batch, int32_t queue_depth=0) except -1:
        """Build this tick's batch in place (cleared first); return its ``n_tokens``.

        ``strategy``: a built-in (fast C path), a name, or any object with ``plan()``.
        At most ``n_batch`` tokens (``1 <= n_batch <= batch.capacity``). Records the plan
        and the outputs (``n_outputs``, ``out_slot``, ``out_index``); the slots do not
        change until ``commit()``. If it raises (a strategy error, an invalid plan), the
        table and the last fill's record are left unchanged.
        """
        cdef plan_in_t p
        cdef int32_t n, nd
        cdef Strategy st
        self.check_not_planning()
        if self.fill_pending:
            raise RuntimeError("fill() while the last fill is pending: commit() or rollback() it first")
        self.empty_fill = False
        if batch is None:
            raise TypeError("fill() needs a Batch")
        if n_batch < 1 or n_batch > batch.capacity_:
            raise ValueError("n_batch must be in 1..%d (the batch capacity), got %d" % (batch.capacity_, n_batch))
        if type(strategy) is str:
            strategy = _BY_NAME.get(strategy) or get_strategy(strategy)
        p.budget = n_batch
        p.chunk_size = self.chunk_size
        p.queue_depth = queue_depth
        nd = self.gather(&p)
        if isinstance(strategy, Strategy) and (<Strategy> strategy).native:
            st = <Strategy> strategy
            n = st.plan_c(&p, self.s_plan_slot, self.s_plan_n)
            if LLAMABATCH_DEBUG:
                check_native_plan(self, strategy, &p, n, self.s_mark, self.s_plan_slot, self.s_plan_n)
        else:
            n = self.fill_python(strategy, &p)
        self.apply_plan(batch, n, nd, n_batch)
        if LLAMABATCH_DEBUG:
            self.check_invariants()
        return batch.c.n_tokens

    cpdef commit(self):
        """The decode of the last fill succeeded: apply it.

        Positions advance; a DECODE slot and a PREFILL slot whose last prompt token was in
        the batch move to AWAIT_SAMPLE (their logits are at ``out_index``). The
        round-robin cursor moves past the last decode slot served if some were left out.
        """
        cdef int32_t e, s
        cdef slot_t * sl
        self.check_not_planning()
        if not self.fill_pending:
            if self.empty_fill:  # nothing was decoded: nothing to apply
                self.empty_fill = False
                return
            raise RuntimeError("commit() without a pending fill")
        for e in range(self.n_plan):
            s = self.plan_slot[e]
            sl = &self.slots[s]
            if sl.fill_n == 0:  # finished (maybe restarted) since the fill
                continue
            if sl.state == ST_DECODE:
                self.kv_push(s, 1 + sl.fill_draft)
                sl.n_past += 1 + sl.fill_draft
                sl.n_hist += sl.fill_draft  # decoded drafts join the history until reject()
                sl.n_draft = 0
                self.transition(s, ST_AWAIT_SAMPLE)
            else:
                self.kv_push(s, self.plan_n[e])
                sl.n_past += self.plan_n[e]
                if sl.n_past == sl.n_prompt:
                    self.transition(s, ST_AWAIT_SAMPLE)
        self.rr_cursor = self.next_cursor
        self.fill_pending = False
        self.n_commits += 1
        if LLAMABATCH_DEBUG:
            self.check_invariants()

    cpdef rollback(self):
        """The decode of the last fill failed: forget the fill (the slots never changed)."""
        cdef int32_t j
        self.check_not_planning()
        if not self.fill_pending:
            if self.empty_fill:
                self.empty_fill = False
                return
            raise RuntimeError("rollback() without a pending fill")
        for j in range(self.n_parallel):
            self.slots[j].fill_n = 0
            self.slots[j].fill_draft = 0
        self.n_plan = 0
        self.n_outputs = 0
        self.n_draft_tokens = 0
        self.n_score_rows = 0
        self.n_decode_tokens = 0
        self.n_prefill_tokens = 0
        self.fill_pending = False
        self.n_rollbacks += 1

    # ------------------------------------------------------------------ outputs, telemetry

    @property
    def out_slot(self):
        """int32 view: ``out_slot[i]`` is the slot whose logits are at ``out_index[i]``."""
        return int32_array(self, self.out_slot_, self.n_outputs, 1)

    @property
    def out_index(self):
        """int32 view: batch index of each output's logits (for ``llama_sampler_sample``)."""
        return int32_array(self, self.out_index_, self.n_outputs, 1)

    def outputs(self):
        """The last fill's outputs as a list of ``(slot, batch_index)``, in batch order."""
        cdef int32_t i
        return [(self.out_slot_[i], self.out_index_[i]) for i in range(self.n_outputs)]

    @property
    def last_fill_stats(self):
        """``(n_decode_tokens, n_prefill_tokens)`` of the last fill."""
        return (self.n_decode_tokens, self.n_prefill_tokens)

    def tokens_in_batch(self, int32_t slot):
        """Tokens of ``slot`` in the last fill (0 if none)."""
        self.check_slot(slot)
        return self.slots[slot].fill_n

    def batch_index(self, int32_t slot):
        """Batch index of the slot's first token in the last fill, or -1."""
        self.check_slot(slot)
        return self.slots[slot].fill_first if self.slots[slot].fill_n else -1

    def last_plan(self):
        """The last fill's plan: ``[(slot, n_tokens), ...]`` in batch order."""
        cdef int32_t e
        return [(self.plan_slot[e], self.plan_n[e]) for e in range(self.n_plan)]

    @property
    def decode_cursor(self):
        """Slot where the round-robin order of decode slots starts next fill."""
        return self.rr_cursor

    # ------------------------------------------------------------------ prompt order


    def order_prefill(self, order):
        """Serve the PREFILL slots' prompts in ``order`` (every PREFILL slot once): their
        start counters are dealt out again in that order, so the FIFO stays sorted by them."""
        cdef int32_t j, slot
        order = [int(s) for s in order]
        if sorted(order) != sorted(self.fifo[j] for j in range(self.n_fifo)):
            raise ValueError("order %r is not a permutation of the PREFILL slots" % (order,))
        arrivals = sorted(self.slots[s].arrival for s in order)
        for j, slot in enumerate(order):
            self.fifo[j] = slot
            self.slots[slot].arrival = arrivals[j]



    def view(self):
        """A read-only view of the table (what a user strategy's ``plan`` receives)."""
        return make_view(self, &self.rr_cursor, self.fifo, &self.n_fifo)

    def check_invariants(self):
        """Raise ``AssertionError`` if the table is inconsistent (tests; debug builds check
        after every fill and commit)."""
        cdef int32_t i, j
        cdef slot_t * s
        in_fifo = [self.fifo[j] for j in range(self.n_fifo)]
        prefill = [i for i in range(self.n_parallel) if self.slots[i].state == ST_PREFILL]
        if sorted(in_fifo) != prefill:
            raise AssertionError("FIFO %r != PREFILL slots %r" % (in_fifo, prefill))
        arrivals = [self.slots[i].arrival for i in in_fifo]
        if arrivals != sorted(arrivals):
            raise AssertionError("FIFO not in arrival order: %r" % arrivals)
        for i in range(self.n_parallel):
            s = &self.slots[i]
            ok = (
                (s.state == ST_IDLE and s.n_hist == s.n_past and s.n_prompt == 0)
                or (s.state == ST_PREFILL and s.n_hist == s.n_prompt and 0 <= s.n_past < s.n_prompt)
                or (s.state == ST_AWAIT_SAMPLE and s.n_past == s.n_hist and s.n_hist >= s.n_prompt > 0)
                or (s.state == ST_DECODE and s.n_past == s.n_hist - 1 and s.n_hist > s.n_prompt > 0)
            )
            if not ok or s.n_hist > self.n_ctx_seq:
                raise AssertionError(
                    "slot %d inconsistent: state=%s n_prompt=%d n_hist=%d n_past=%d"
                    % (i, _STATE_BY_VALUE[s.state].name, s.n_prompt, s.n_hist, s.n_past)
                )
        self.check_kv()

    def __repr__(self):
        return "<SlotTable n_parallel=%d n_ctx_seq=%d chunk_size=%d busy=%d>" % (
            self.n_parallel, self.n_ctx_seq, self.chunk_size, self.busy_slots
        )
