from libc.stdint cimport int8_t, int32_t, int64_t

from llamabatch._core.includes.llama cimport llama_batch


cdef class CView:
    """Read-only buffer over C memory owned by ``owner`` (kept alive by the view)."""
    cdef object owner
    cdef void * ptr
    cdef Py_ssize_t shape[2]
    cdef Py_ssize_t strides[2]
    cdef int ndim
    cdef Py_ssize_t itemsize
    cdef bytes fmt


cdef object int32_array(object owner, int32_t * ptr, Py_ssize_t n, Py_ssize_t stride)
cdef const int32_t[::1] as_int32(object tokens) except *


cdef class Batch:
    cdef llama_batch c
    cdef int32_t capacity_
    cdef int32_t n_seq_max_
    cdef int32_t * seq_storage
    cdef int64_t pool_serial
    cdef bint outstanding

    cdef inline void clear_c(self) noexcept nogil:
        self.c.n_tokens = 0

    cdef int add_c(self, int32_t token, int32_t pos, int32_t seq_id, bint logits) except -1


cdef class BatchPool:
    cdef readonly int32_t n_batch
    cdef readonly int32_t n_seq_max
    cdef int64_t serial
    cdef list free
    cdef readonly Py_ssize_t n_acquired
    cdef readonly Py_ssize_t n_released
    cdef readonly Py_ssize_t n_allocated

    cdef Batch _new_batch(self)
    cpdef Batch acquire(self)
    cpdef release(self, Batch batch)
