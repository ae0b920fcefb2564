"""The KV record: which KV cells every sequence's positions occupy.

With a unified KV cache (``kv_unified=True``) all sequences draw cells from one pool of
``kv_size`` cells: a free list (a stack, cell 0 popped first), a reference count per cell
(``copy`` makes sequences share cells, as ``llama_memory_seq_cp`` does) and a count of
positions that got no cell (``n_overflow``: llama.cpp held more than the pool). With one
stream per sequence every sequence owns ``n_ctx_seq`` cells and nothing is shared or counted
here. An LRU clock per sequence orders eviction and slot choice.

The slot table (``slots.pyx``) owns how many positions each sequence holds and the tokens at
them; it calls this record when positions are added (``push``), dropped (``drop``) or copied
(``share``). All memory is allocated once, here.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport int32_t, int64_t

import numpy as np


cdef class KVRecord:
    """The cells of ``n_seq`` sequences of up to ``n_ctx_seq`` positions (see the module doc)."""

    def __cinit__(self, int32_t n_seq, int32_t n_ctx_seq, bint kv_unified=True, int32_t kv_size=0):
        cdef int32_t i
        if n_seq < 1:
            raise ValueError("n_seq must be >= 1, got %d" % n_seq)
        if n_ctx_seq < 1:
            raise ValueError("n_ctx_seq must be >= 1, got %d" % n_ctx_seq)
        if kv_size < 0:
            raise ValueError("kv_size must be >= 0, got %d" % kv_size)
        self.n_seq = n_seq
        self.n_ctx_seq = n_ctx_seq
        self.kv_unified = kv_unified
        # default pool: room for every sequence to fill its context (never overflows)
        self.kv_size = (kv_size or min(<int64_t> n_seq * n_ctx_seq, 2**30)) if kv_unified else n_ctx_seq
        self.last_used = <int64_t *> PyMem_Calloc(n_seq, sizeof(int64_t))
        if self.last_used == NULL:
            raise MemoryError("cannot allocate the LRU clock of %d sequences" % n_seq)
        if kv_unified:
            self.cell = <int32_t *> PyMem_Calloc(<size_t> n_seq * n_ctx_seq, sizeof(int32_t))
            self.refc = <int32_t *> PyMem_Calloc(self.kv_size, sizeof(int32_t))
            self.free_cell = <int32_t *> PyMem_Calloc(self.kv_size, sizeof(int32_t))
            if self.cell == NULL or self.refc == NULL or self.free_cell == NULL:
                raise MemoryError("cannot allocate the KV accounting of %d cells" % self.kv_size)
            for i in range(self.kv_size):  # pop order: cell 0 first
                self.free_cell[i] = self.kv_size - 1 - i
            self.n_free_cells = self.kv_size

    def __dealloc__(self):
        PyMem_Free(self.last_used)
        PyMem_Free(self.cell)
        PyMem_Free(self.refc)
        PyMem_Free(self.free_cell)

    cdef void push(self, int32_t seq, int32_t p0, int32_t n) noexcept nogil:
        """Give positions ``[p0, p0 + n)`` of ``seq`` a cell each (a decode)."""
        cdef int32_t p, c
        cdef int32_t * cells
        if not self.kv_unified:
            return
        cells = self.cell + <size_t> seq * self.n_ctx_seq
        for p in range(p0, p0 + n):
            if self.n_free_cells:
                self.n_free_cells -= 1
                c = self.free_cell[self.n_free_cells]
                self.refc[c] = 1
            else:
                c = -1
                self.n_overflow += 1
            cells[p] = c

    cdef void drop(self, int32_t seq, int32_t p0, int32_t end) noexcept nogil:
        """Drop positions ``[p0, end)`` of ``seq``; cells no sequence shares any more are freed."""
        cdef int32_t p, c
        cdef int32_t * cells
        if not self.kv_unified:
            return
        cells = self.cell + <size_t> seq * self.n_ctx_seq
        for p in range(p0, end):
            c = cells[p]
            if c < 0:
                self.n_overflow -= 1
                continue
            self.refc[c] -= 1
            if self.refc[c] == 0:
                self.free_cell[self.n_free_cells] = c
                self.n_free_cells += 1

    cdef void share(self, int32_t src, int32_t dst, int32_t n) noexcept nogil:
        """Make positions ``[0, n)`` of the empty ``dst`` share the cells of ``src``'s."""
        cdef int32_t p, c
        cdef int32_t * s_cells
        cdef int32_t * d_cells
        if not self.kv_unified:
            return
        s_cells = self.cell + <size_t> src * self.n_ctx_seq
        d_cells = self.cell + <size_t> dst * self.n_ctx_seq
        for p in range(n):
            c = s_cells[p]
            d_cells[p] = c
            if c >= 0:
                self.refc[c] += 1
            else:
                self.n_overflow += 1

    cdef int32_t owned(self, int32_t seq, int32_t length) noexcept nogil:
        """Cells only ``seq`` (holding ``length`` positions) occupies: what dropping it frees."""
        cdef int32_t p, n = 0
        cdef int32_t * cells
        if not self.kv_unified:
            return length
        cells = self.cell + <size_t> seq * self.n_ctx_seq
        for p in range(length):
            if cells[p] < 0 or self.refc[cells[p]] == 1:
                n += 1
        return n

    cdef void touch_seq(self, int32_t seq) noexcept nogil:
        self.clock += 1
        self.last_used[seq] = self.clock

    def last_use(self, int32_t seq):
        """The LRU clock of ``seq`` when it was last touched (0: never)."""
        if seq < 0 or seq >= self.n_seq:
            raise IndexError("sequence %d out of range 0..%d" % (seq, self.n_seq - 1))
        return self.last_used[seq]

    @property
    def cells_used(self):
        """Cells of the pool holding some position, plus positions without a cell (unified)."""
        return self.kv_size - self.n_free_cells + self.n_overflow

    def check(self, lengths):
        """Raise ``AssertionError`` unless every cell's reference count equals the number of
        positions that hold it (``lengths[seq]`` positions per sequence) and the free cells
        are exactly the unreferenced ones."""
        cdef int32_t i, p, c
        cdef int64_t overflow = 0
        if not self.kv_unified:
            return
        counts = np.zeros(self.kv_size, dtype=np.int64)
        for i in range(self.n_seq):
            for p in range(<int32_t> lengths[i]):
                c = self.cell[<size_t> i * self.n_ctx_seq + p]
                if c < 0:
                    overflow += 1
                else:
                    counts[c] += 1
        refc = np.array([self.refc[c] for c in range(self.kv_size)], dtype=np.int64)
        if not np.array_equal(counts, refc):
            raise AssertionError("KV cell reference counts differ from the sequences' positions")
        if overflow != self.n_overflow:
            raise AssertionError("overflow count %d != %d positions without a cell" % (self.n_overflow, overflow))
        free = sorted(self.free_cell[i] for i in range(self.n_free_cells))
        if free != sorted(np.flatnonzero(refc == 0).tolist()):
            raise AssertionError("the free cells are not exactly the unreferenced ones")

    def __repr__(self):
        return "<KVRecord n_seq=%d kv_unified=%s kv_size=%d used=%d>" % (
            self.n_seq, bool(self.kv_unified), self.kv_size,
            self.cells_used if self.kv_unified else -1,
        )
