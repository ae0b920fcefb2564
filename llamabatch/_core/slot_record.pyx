"""The slot record: what every slot and sequence holds, the base of ``SlotTable``.

Slot ``i`` is llama.cpp sequence ``seq_id == i``; sequences ``n_parallel`` on hold pinned
prefixes. For each, the record keeps its token history (a preallocated C array of
``n_ctx_seq`` tokens) and how many of those are in the KV cache (``seq_len``: a busy slot's
``n_past``, an idle slot's cached tokens, a pinned prefix); for each slot, its state and
lengths (``slot_t``). ``SlotTable`` (``slots.pyx``) changes the slots' states and runs the
tick; this record answers queries, matches prefixes (``best_prefix``) and changes resting
sequences (idle slots, pinned prefixes) between ticks: ``trim``, ``copy``, ``record_cached``.

This is the one record of the KV cache, which the engine's ``KVCache`` mirrors into
llama.cpp with ``seq_rm``/``seq_cp``. With a unified KV cache, sequences share cells after a
copy (per-cell reference counts over a pool of ``kv_size`` cells), so ``cells_used`` /
``cells_free`` are exact; with one KV stream per sequence (``kv_unified=False``) every
sequence owns ``n_ctx_seq`` cells and copies share nothing. The cells themselves (pool,
reference counts, free list, LRU clock) are the ``KVRecord`` of ``kv_record.pyx``
(``record.kv``).
"""

import enum

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcmp, memcpy, memset

import numpy as np

from llamabatch._core.batch cimport as_int32, int32_array
from llamabatch._core.kv_record cimport KVRecord

from llamabatch.errors import PromptTooLong


class SlotState(enum.IntEnum):
    """State of a slot (ordered by progress)."""

    IDLE = ST_IDLE
    PREFILL = ST_PREFILL
    AWAIT_SAMPLE = ST_AWAIT_SAMPLE
    DECODE = ST_DECODE


cdef tuple _STATE_BY_VALUE = tuple(SlotState)


cdef class SlotRecord:
    """The slots' and sequences' states, lengths and tokens (see the module doc); made only
    as a :class:`~llamabatch._core.slots.SlotTable`."""

    def __cinit__(self, *args, **kwargs):
        if type(self) is SlotRecord:
            raise TypeError("SlotRecord is the base of SlotTable: make a SlotTable")

    cdef int init_record(self, int32_t n_parallel, int32_t n_ctx_seq, int32_t n_pinned,
                         bint kv_unified, int32_t kv_size) except -1:
        """Allocate the record (``SlotTable.__cinit__``, once)."""
        if n_parallel < 1:
            raise ValueError("n_parallel must be >= 1, got %d" % n_parallel)
        if n_ctx_seq < 1:
            raise ValueError("n_ctx_seq must be >= 1, got %d" % n_ctx_seq)
        if n_pinned < 0:
            raise ValueError("n_pinned must be >= 0, got %d" % n_pinned)
        if kv_size < 0:
            raise ValueError("kv_size must be >= 0, got %d" % kv_size)
        self.n_seq = n_parallel + n_pinned
        self.kv = KVRecord(self.n_seq, n_ctx_seq, kv_unified, kv_size)
        self.n_parallel = n_parallel
        self.n_ctx_seq = n_ctx_seq
        self.slots = <slot_t *> PyMem_Calloc(n_parallel, sizeof(slot_t))
        self.hist = <int32_t *> PyMem_Calloc(<size_t> self.n_seq * n_ctx_seq, sizeof(int32_t))
        self.pin_len = <int32_t *> PyMem_Calloc(n_pinned + 1, sizeof(int32_t))
        if self.slots == NULL or self.hist == NULL or self.pin_len == NULL:
            raise MemoryError("cannot allocate a slot table of %d x %d tokens" % (n_parallel, n_ctx_seq))
        return 0

    def __dealloc__(self):
        PyMem_Free(self.slots)
        PyMem_Free(self.hist)
        PyMem_Free(self.pin_len)

    cdef int check_slot(self, int32_t slot) except -1:
        if slot < 0 or slot >= self.n_parallel:
            raise IndexError("slot %d out of range 0..%d" % (slot, self.n_parallel - 1))
        return 0

    # ------------------------------------------------------------------ per-slot state

    def state(self, int32_t slot):
        self.check_slot(slot)
        return _STATE_BY_VALUE[self.slots[slot].state]

    def n_past(self, int32_t slot):
        """Tokens of the slot already in the KV cache (= its next position)."""
        self.check_slot(slot)
        return self.slots[slot].n_past

    def n_pending(self, int32_t slot):
        """Prompt tokens still to compute (0 unless PREFILL)."""
        self.check_slot(slot)
        cdef slot_t * s = &self.slots[slot]
        return s.n_prompt - s.n_past if s.state == ST_PREFILL else 0

    def n_prompt(self, int32_t slot):
        self.check_slot(slot)
        return self.slots[slot].n_prompt

    def n_generated(self, int32_t slot):
        """Tokens accepted after the prompt."""
        self.check_slot(slot)
        return self.slots[slot].n_hist - self.slots[slot].n_prompt

    def reused_tokens(self, int32_t slot):
        """Prompt tokens that were already in the KV cache at start (``n_past`` of start())."""
        self.check_slot(slot)
        return self.slots[slot].reused_tokens

    def room(self, int32_t slot):
        """How many more tokens the slot's history can hold (``n_ctx_seq - len(history)``)."""
        self.check_slot(slot)
        return self.n_ctx_seq - self.slots[slot].n_hist

    def arrival(self, int32_t slot):
        """Start counter of the slot's request (FIFO order of prompts)."""
        self.check_slot(slot)
        return self.slots[slot].arrival

    def history(self, int32_t slot):
        """A copy of the slot's prompt + accepted tokens (int32 numpy array)."""
        self.check_slot(slot)
        return np.array(int32_array(self, self.hist + <size_t> slot * self.n_ctx_seq,
                                    self.slots[slot].n_hist, 1))

    def common_prefix(self, int32_t seq, tokens):
        """Length of the common prefix of ``tokens`` and what sequence ``seq`` holds in the
        KV cache (a slot, busy or idle, or a pinned prefix)."""
        self.check_seq(seq)
        cdef const int32_t[::1] t = as_int32(tokens)
        return self._common(seq, &t[0] if t.shape[0] else NULL, t.shape[0], self.kv_len(seq)[0])

    def common_history(self, int32_t slot, tokens):
        """Length of the common prefix of ``tokens`` and the slot's whole history (prompt and
        accepted tokens, computed or not)."""
        self.check_slot(slot)
        cdef const int32_t[::1] t = as_int32(tokens)
        return self._common(slot, &t[0] if t.shape[0] else NULL, t.shape[0], self.slots[slot].n_hist)

    cdef int32_t _common(self, int32_t seq, const int32_t * t, Py_ssize_t n, int32_t m) noexcept nogil:
        cdef int32_t i
        cdef const int32_t * h = self.hist + <size_t> seq * self.n_ctx_seq
        if n < m:
            m = <int32_t> n
        for i in range(m):
            if h[i] != t[i]:
                return i
        return m

    def best_prefix(self, tokens):
        """``(seq, n)``: the sequence (slot, busy or idle, or pinned prefix) whose KV cache
        shares the longest prefix with ``tokens`` (``n`` tokens), or ``(-1, 0)``. On a tie an
        idle slot wins (its cache is reused in place, with no copy), then the lowest seq."""
        cdef const int32_t[::1] t = as_int32(tokens)
        cdef int32_t i, c, best = -1, best_n = 0
        cdef bint best_idle = False, idle
        cdef Py_ssize_t n = t.shape[0]
        if n == 0:
            return (-1, 0)
        for i in range(self.n_seq):
            c = self._common(i, &t[0], n, self.kv_len(i)[0])
            idle = i < self.n_parallel and self.slots[i].state == ST_IDLE
            if c > best_n or (c == best_n and c > 0 and idle and not best_idle):
                best, best_n, best_idle = i, c, idle
        return (best, best_n)

    # ------------------------------------------------------------------ the KV record

    cdef int check_seq(self, int32_t seq) except -1:
        if seq < 0 or seq >= self.n_seq:
            raise IndexError("sequence %d out of range 0..%d" % (seq, self.n_seq - 1))
        return 0

    cdef int32_t * kv_len(self, int32_t seq) noexcept nogil:
        if seq < self.n_parallel:
            return &self.slots[seq].n_past
        return &self.pin_len[seq - self.n_parallel]

    cdef void kv_push(self, int32_t seq, int32_t n) noexcept nogil:
        """Record cells for ``n`` new positions after the sequence's last (a decode)."""
        self.kv.push(seq, self.kv_len(seq)[0], n)

    cdef void kv_release(self, int32_t seq, int32_t p0) noexcept nogil:
        """Drop the sequence's positions ``[p0, end)``; cells no sequence shares are freed."""
        cdef int32_t * length = self.kv_len(seq)
        if p0 < length[0]:
            self.kv.drop(seq, p0, length[0])
            length[0] = p0

    cdef int check_quiet(self) except -1:
        """Raise unless the record may change now (``SlotTable``: not inside a strategy's
        ``plan()``, no fill pending)."""
        return 0

    cdef int check_resting(self, int32_t seq) except -1:
        """Only idle slots and pinned-prefix sequences change outside a tick."""
        self.check_quiet()
        self.check_seq(seq)
        if seq < self.n_parallel and self.slots[seq].state != ST_IDLE:
            raise ValueError("slot %d is busy (%s)" % (seq, _STATE_BY_VALUE[self.slots[seq].state].name))
        return 0

    def seq_len(self, int32_t seq):
        """Positions ``seq`` holds in the KV cache (a slot's ``n_past``; an idle slot's cached
        tokens; a pinned prefix's length)."""
        self.check_seq(seq)
        return self.kv_len(seq)[0]

    def seq_tokens(self, int32_t seq):
        """A copy of the tokens ``seq`` holds in the KV cache (int32 numpy array)."""
        self.check_seq(seq)
        return np.array(int32_array(self, self.hist + <size_t> seq * self.n_ctx_seq, self.kv_len(seq)[0], 1))

    def trim(self, int32_t seq, int32_t n):
        """Keep the first ``n`` positions of an idle slot or pinned prefix, drop the rest
        (mirror it with ``llama_memory_seq_rm(seq, n, -1)``)."""
        self.check_resting(seq)
        if n < 0:
            raise ValueError("n must be >= 0, got %d" % n)
        self.kv_release(seq, n)
        if seq < self.n_parallel:
            self.slots[seq].n_hist = self.slots[seq].n_past

    def copy(self, int32_t src, int32_t dst, int32_t n):
        """Make the empty idle slot or pinned prefix ``dst`` hold positions ``[0, n)`` of
        ``src`` (mirror it with ``llama_memory_seq_cp``): shared cells with a unified KV
        cache, a copy in ``dst``'s own stream otherwise."""
        self.check_resting(dst)
        self.check_seq(src)
        if src == dst:
            raise ValueError("cannot copy sequence %d onto itself" % src)
        if self.kv_len(dst)[0]:
            raise ValueError("sequence %d is not empty (trim it first)" % dst)
        if n < 0 or n > self.kv_len(src)[0]:
            raise ValueError("sequence %d holds %d positions, cannot copy %d" % (src, self.kv_len(src)[0], n))
        memcpy(self.hist + <size_t> dst * self.n_ctx_seq, self.hist + <size_t> src * self.n_ctx_seq,
               n * sizeof(int32_t))
        self.kv.share(src, dst, n)
        self.kv_len(dst)[0] = n
        if dst < self.n_parallel:
            self.slots[dst].n_hist = n

    def move(self, int32_t src, int32_t dst):
        """Move the DECODE slot ``src``'s sequence (its state, lengths, tokens and KV record)
        into the empty idle slot ``dst``; ``src`` becomes idle and empty. A draft set on
        ``src`` is dropped (drafts are planned each tick). Mirror it with a whole-stream
        ``llama_memory_seq_cp(src, dst)`` and ``llama_memory_seq_rm(src)`` (``compaction.py``:
        closing a gap among busy KV streams)."""
        self.check_quiet()
        self.check_slot(src)
        self.check_slot(dst)
        if src == dst:
            raise ValueError("cannot move slot %d onto itself" % src)
        cdef slot_t * s = &self.slots[src]
        cdef slot_t * d = &self.slots[dst]
        if s.state != ST_DECODE:
            raise ValueError("slot %d is not decoding (%s)" % (src, _STATE_BY_VALUE[s.state].name))
        if d.state != ST_IDLE or d.n_past:
            raise ValueError("slot %d is not idle and empty (trim it first)" % dst)
        memcpy(self.hist + <size_t> dst * self.n_ctx_seq, self.hist + <size_t> src * self.n_ctx_seq,
               s.n_hist * sizeof(int32_t))
        self.kv.share(src, dst, s.n_past)
        self.kv.drop(src, 0, s.n_past)
        d[0] = s[0]
        d.n_draft = 0
        d.fill_n = 0
        d.fill_draft = 0
        memset(s, 0, sizeof(slot_t))  # ST_IDLE, holding nothing
        self.kv.touch_seq(dst)

    def record_cached(self, int32_t seq, tokens):
        """Record that the idle slot or pinned sequence ``seq`` holds ``tokens`` at positions
        ``0..len-1`` (computed outside a tick, or restored from a saved state). ``seq`` is empty,
        or already holds the first of ``tokens`` (a prefix shared with ``copy``): only the rest
        are recorded as its own new cells."""
        self.check_resting(seq)
        cdef const int32_t[::1] toks = as_int32(tokens)
        cdef int32_t n = <int32_t> toks.shape[0]
        cdef int32_t have = self.kv_len(seq)[0]
        cdef int32_t * h = self.hist + <size_t> seq * self.n_ctx_seq
        if have and (have > n or memcmp(h, &toks[0], have * sizeof(int32_t)) != 0):
            raise ValueError("sequence %d holds tokens that do not start these (trim it first)" % seq)
        if n > self.n_ctx_seq:
            raise PromptTooLong("%d tokens do not fit the %d-token context of a sequence" % (n, self.n_ctx_seq))
        if n > have:
            memcpy(h + have, &toks[have], (n - have) * sizeof(int32_t))
        self.kv_push(seq, n - have)
        self.kv_len(seq)[0] = n
        if seq < self.n_parallel:
            self.slots[seq].n_hist = n

    def touch(self, int32_t seq):
        """Mark ``seq`` as just used (LRU order of eviction and slot choice)."""
        self.check_seq(seq)
        self.kv.touch_seq(seq)

    def lru_slot(self, bint cached_only=False, int32_t exclude=-1):
        """The least recently used idle slot (holding cached tokens, if ``cached_only``; not
        ``exclude``), or -1."""
        cdef int32_t i, best = -1
        for i in range(self.n_parallel):
            if i != exclude and self.slots[i].state == ST_IDLE and (self.slots[i].n_past or not cached_only):
                if best < 0 or self.kv.last_used[i] < self.kv.last_used[best]:
                    best = i
        return best

    def admission_slot(self):
        """The idle slot a new request takes when no cached prefix decides it, or -1.

        One KV stream per sequence: llama.cpp decodes each run of *consecutive* busy seq_ids
        as a separate forward pass (every pass reads all the weights), so the slot that joins
        or extends a run of busy slots goes first (seqs 0, 3, 6 decode ~1.5x slower than 0,
        1, 2 on a 2-core CPU); ties, and a unified cache, go to the least recently used."""
        cdef int32_t i, best = -1, score, best_score = -1
        if self.kv.kv_unified:
            return self.lru_slot()
        for i in range(self.n_parallel):
            if self.slots[i].state != ST_IDLE:
                continue
            score = 0
            if i > 0 and self.slots[i - 1].state != ST_IDLE:
                score += 1
            if i + 1 < self.n_parallel and self.slots[i + 1].state != ST_IDLE:
                score += 1
            if score > best_score or (score == best_score and self.kv.last_used[i] < self.kv.last_used[best]):
                best, best_score = i, score
        return best

    @property
    def kv_unified(self):
        """One cell pool for all sequences (else one KV stream per sequence)."""
        return self.kv.kv_unified

    @property
    def kv_size(self):
        """Cells in the pool (unified) or in each stream."""
        return self.kv.kv_size

    @property
    def n_overflow(self):
        """Positions without a cell: llama.cpp held more than the pool (accounting drift)."""
        return self.kv.n_overflow

    @property
    def cells_total(self):
        """KV cells: the pool (unified) or all streams together."""
        return self.kv.kv_size if self.kv.kv_unified else self.kv.kv_size * self.n_seq

    @property
    def cells_used(self):
        """Cells holding some sequence's position (shared cells counted once)."""
        cdef int32_t i
        cdef int64_t n = 0
        if self.kv.kv_unified:
            return self.kv.cells_used
        for i in range(self.n_seq):
            n += self.kv_len(i)[0]
        return n

    @property
    def cells_free(self):
        """Free cells of the pool (unified; 0 when overcommitted), or of all streams."""
        return max(0, self.cells_total - self.cells_used)

    def cells_owned(self, int32_t seq):
        """Cells only ``seq`` holds: what dropping it frees."""
        self.check_seq(seq)
        return self.kv.owned(seq, self.kv_len(seq)[0])

    def check_kv(self):
        """Raise ``AssertionError`` unless every cell's reference count equals the number of
        sequence positions that hold it, and the free cells are exactly the unreferenced ones."""
        self.kv.check([self.kv_len(i)[0] for i in range(self.n_seq)])

    def free_slot(self):
        """The lowest IDLE slot, or -1."""
        cdef int32_t i
        for i in range(self.n_parallel):
            if self.slots[i].state == ST_IDLE:
                return i
        return -1

    def count(self, state):
        """How many slots are in ``state``."""
        cdef int32_t i, c = 0, st = int(state)
        for i in range(self.n_parallel):
            if self.slots[i].state == st:
                c += 1
        return c

    @property
    def busy_slots(self):
        return self.n_parallel - self.count(ST_IDLE)

    def states(self):
        """A list of every slot's state."""
        cdef int32_t i
        return [_STATE_BY_VALUE[self.slots[i].state] for i in range(self.n_parallel)]
