from libc.stdint cimport int32_t, int64_t


cdef class KVRecord:
    cdef readonly int32_t n_seq
    cdef readonly int32_t n_ctx_seq
    cdef readonly bint kv_unified    # one cell pool, shared cells (else one stream per sequence)
    cdef readonly int32_t kv_size    # cells in the pool (unified) or in each stream
    cdef int32_t * cell              # n_seq x n_ctx_seq: the (virtual) cell at each position (unified)
    cdef int32_t * refc              # kv_size: sequences sharing each cell (unified)
    cdef int32_t * free_cell         # stack of free cells (unified)
    cdef readonly int32_t n_free_cells
    cdef readonly int64_t n_overflow # positions without a cell (llama.cpp held more than the pool)
    cdef int64_t * last_used         # n_seq: LRU clock of each sequence
    cdef int64_t clock

    cdef void push(self, int32_t seq, int32_t p0, int32_t n) noexcept nogil
    cdef void drop(self, int32_t seq, int32_t p0, int32_t end) noexcept nogil
    cdef void share(self, int32_t src, int32_t dst, int32_t n) noexcept nogil
    cdef int32_t owned(self, int32_t seq, int32_t length) noexcept nogil
    cdef void touch_seq(self, int32_t seq) noexcept nogil
