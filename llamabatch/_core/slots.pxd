from libc.stdint cimport int32_t, int64_t

from llamabatch._core.batch cimport Batch
from llamabatch._core.slot_record cimport (
    N_STATES, ST_AWAIT_SAMPLE, ST_DECODE, ST_IDLE, ST_PREFILL, SlotRecord, slot_t,
)
from llamabatch._core.strategies cimport Strategy, plan_in_t


cdef enum:
    C_MAX_DRAFT = 64     # the most draft tokens a slot verifies in one tick


cdef class SlotTable(SlotRecord):
    cdef readonly int32_t chunk_size
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
    cdef readonly int32_t n_score_rows     # prompt rows with logits in the last fill (prompt log-probabilities)
    # drafts keep a tick's query rows per KV stream under this (0: no bound): from 64 rows a
    # stream, CPU flash attention on an f16/f32 cache takes a tiled kernel that rounds otherwise
    # than the one-row kernel of a decode without drafts, and near-tie tokens would flip
    cdef public int32_t draft_rows_below
    cdef readonly int64_t n_commits
    cdef readonly int64_t n_rollbacks
    cdef bint in_plan            # a Python strategy's plan() is running: no mutation

    cdef int check_not_planning(self) except -1
    cdef int check_quiet(self) except -1

    cdef int transition(self, int32_t slot, int32_t new_state) except -1
    cdef int32_t gather(self, plan_in_t * p) noexcept nogil
    cdef void batch_order(self, int32_t n) noexcept nogil
    cdef int32_t fill_python(self, object strategy, plan_in_t * p) except -1
    cdef int32_t apply_plan(self, Batch batch, int32_t n, int32_t n_decode_cand, int32_t budget) noexcept nogil
    cpdef int32_t fill(self, Batch batch, object strategy, int32_t n_batch, int32_t queue_depth=*) except -1
    cpdef commit(self)
    cpdef rollback(self)
