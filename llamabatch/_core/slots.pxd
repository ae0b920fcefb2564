from libc.stdint cimport int32_t, int64_t

from llamabatch._core.batch cimport Batch
from llamabatch._core.kv_record cimport KVRecord
from llamabatch._core.strategies cimport Strategy, plan_in_t


# Slot states (SlotState in Python). Ordered by progress, as vLLM's request status.
cdef enum:
    ST_IDLE = 0          # free
    ST_PREFILL = 1       # prompt tokens still to compute
    ST_AWAIT_SAMPLE = 2  # logits computed by the last commit; waiting for accept()/finish()
    ST_DECODE = 3        # holds a sampled token to decode (its next input)
    N_STATES = 4
    C_MAX_DRAFT = 64     # the most draft tokens a slot verifies in one tick


ctypedef struct slot_t:
    int32_t state
    int32_t n_prompt     # prompt length
    int32_t n_hist       # tokens in the history (prompt + accepted)
    int32_t n_past       # tokens already in the KV cache (next position)
    int32_t reused_tokens     # n_past given to start() (prefix reuse)
    int32_t fill_n       # tokens of this slot in the last fill (0: not in it)
    int32_t fill_first   # batch index of its first token in the last fill
    int32_t rank         # scratch: position in the round-robin decode order of this fill
    int64_t arrival      # start() counter, for FIFO prefill order
    int32_t n_draft      # speculative draft tokens set after the decode token (hist[n_hist:])
    int32_t fill_draft   # draft tokens of this slot in the last fill / commit


cdef class SlotTable:
    cdef readonly int32_t n_parallel
    cdef readonly int32_t n_ctx_seq
    cdef readonly int32_t chunk_size
    # KV accounting: the one record of what every sequence holds in the KV cache.
    # Sequences 0..n_parallel-1 are the slots; n_parallel..n_seq-1 hold pinned prefixes.
    # Lengths and tokens are here; the cells (pool, refcounts, free list, LRU) are in kv.
    cdef readonly int32_t n_seq
    cdef readonly KVRecord kv
    cdef slot_t * slots
    cdef int32_t * hist          # n_seq x n_ctx_seq token history
    cdef int32_t * pin_len       # KV length of each pinned-prefix sequence
    cdef int32_t * fifo          # PREFILL slots in arrival order
    cdef int32_t n_fifo
    cdef int32_t rr_cursor       # round-robin start for decode slots
    cdef int64_t next_arrival
    # scratch of one fill (never observable)
    cdef int32_t * s_decode
    cdef int32_t * s_pending
    cdef int32_t * s_plan_slot
    cdef int32_t * s_plan_n
    cdef int32_t * s_mark
    cdef int32_t * s_sorted      # plan entries by slot (per-stream batch order)
    cdef int32_t * s_order       # plan entries in batch order
    cdef int32_t * s_cut         # m + 1: where the cheapest split of the first j ends its last run
    cdef double * s_best         # m + 1: the cost of that split
    cdef double * s_ext          # each plan entry's stream after the fill, as llama.cpp pads it
    cdef public double ubatch_cost_cells  # per-stream: one more ubatch costs this many cell reads
    # the last fill (pending until commit()/rollback())
    cdef int32_t * plan_slot
    cdef int32_t * plan_n
    cdef int32_t n_plan
    cdef int32_t * out_slot_
    cdef int32_t * out_index_
    cdef readonly int32_t n_outputs
    cdef readonly bint fill_pending
    cdef bint empty_fill         # the last fill wrote 0 tokens (commit/rollback: no-ops)
    cdef int32_t next_cursor
    cdef int32_t n_decode_tokens
    cdef int32_t n_prefill_tokens
    cdef readonly int32_t n_draft_tokens   # draft tokens in the last fill (speculative decoding)
    # drafts keep a tick's query rows per KV stream under this (0: no bound): from 64 rows a
    # stream, CPU flash attention on an f16/f32 cache takes a tiled kernel that rounds otherwise
    # than the one-row kernel of a decode without drafts, and near-tie tokens would flip
    cdef public int32_t draft_rows_below
    cdef readonly int64_t n_commits
    cdef readonly int64_t n_rollbacks
    cdef bint in_plan            # a Python strategy's plan() is running: no mutation

    cdef int check_slot(self, int32_t slot) except -1
    cdef int check_seq(self, int32_t seq) except -1
    cdef int check_resting(self, int32_t seq) except -1
    cdef int32_t * kv_len(self, int32_t seq) noexcept nogil
    cdef void kv_push(self, int32_t seq, int32_t n) noexcept nogil
    cdef void kv_release(self, int32_t seq, int32_t p0) noexcept nogil
    cdef int check_not_planning(self) except -1

    cdef int transition(self, int32_t slot, int32_t new_state) except -1
    cdef int32_t gather(self, plan_in_t * p) noexcept nogil
    cdef void batch_order(self, int32_t n) noexcept nogil
    cdef int32_t apply_plan(self, Batch batch, int32_t n, int32_t n_decode_cand, int32_t budget) noexcept nogil
    cdef str violation(self, int32_t s, int64_t k, int64_t total, int32_t budget)
    cdef int32_t fill_python(self, Batch batch, object strategy, plan_in_t * p) except -1
    cdef int debug_check_plan(self, int32_t n, plan_in_t * p, object strategy) except -1
    cdef int32_t _common(self, int32_t seq, const int32_t * t, Py_ssize_t n, int32_t m) noexcept nogil
    cpdef int32_t fill(self, Batch batch, object strategy, int32_t n_batch, int32_t queue_depth=*) except -1
    cpdef commit(self)
    cpdef rollback(self)


cdef class TableView:
    cdef SlotTable t
    cdef SlotTable table(self)
