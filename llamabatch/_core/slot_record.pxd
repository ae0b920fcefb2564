from libc.stdint cimport int32_t, int64_t

from llamabatch._core.kv_record cimport KVRecord


# Slot states (SlotState in Python). Ordered by progress, as vLLM's request status.
cdef enum:
    ST_IDLE = 0          # free
    ST_PREFILL = 1       # prompt tokens still to compute
    ST_AWAIT_SAMPLE = 2  # logits computed by the last commit; waiting for accept()/finish()
    ST_DECODE = 3        # holds a sampled token to decode (its next input)
    N_STATES = 4


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
    int32_t score_chunk  # > 0: every prompt row is an output (prompt log-probabilities), this many a tick at most


cdef class SlotRecord:
    # KV accounting: the one record of what every sequence holds in the KV cache.
    # Sequences 0..n_parallel-1 are the slots; n_parallel..n_seq-1 hold pinned prefixes.
    # Lengths and tokens are here; the cells (pool, refcounts, free list, LRU) are in kv.
    cdef readonly int32_t n_parallel
    cdef readonly int32_t n_ctx_seq
    cdef readonly int32_t n_seq
    cdef readonly KVRecord kv
    cdef slot_t * slots
    cdef int32_t * hist          # n_seq x n_ctx_seq token history
    cdef int32_t * pin_len       # KV length of each pinned-prefix sequence

    cdef int init_record(self, int32_t n_parallel, int32_t n_ctx_seq, int32_t n_pinned,
                         bint kv_unified, int32_t kv_size) except -1
    cdef int check_quiet(self) except -1
    cdef int check_slot(self, int32_t slot) except -1
    cdef int check_seq(self, int32_t seq) except -1
    cdef int check_resting(self, int32_t seq) except -1
    cdef int32_t * kv_len(self, int32_t seq) noexcept nogil
    cdef void kv_push(self, int32_t seq, int32_t n) noexcept nogil
    cdef void kv_release(self, int32_t seq, int32_t p0) noexcept nogil
    cdef int32_t _common(self, int32_t seq, const int32_t * t, Py_ssize_t n, int32_t m) noexcept nogil
