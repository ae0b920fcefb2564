"""Preallocated ``llama_batch`` buffers and the pool that lends them.

A :class:`Batch` owns one ``llama_batch`` struct and its arrays (``token``, ``pos``,
``n_seq_id``, ``seq_id``, ``logits``; ``embd`` is NULL), all of capacity ``n_batch``,
allocated once and reused every tick. ``Batch.address`` is the address of the struct;
the cffi layer does ``ffi.cast("llama_batch *", batch.address)[0]`` and passes it to
``llama_decode``. The address stays valid while the ``Batch`` object is alive.

:class:`BatchPool` lends batches (``acquire``) and takes them back (``release``),
counting both (``n_acquired``, ``n_released``, ``n_outstanding``): the tests check that
every acquired batch is released. ``live_batches()`` counts the C buffers alive in the
process (a leak counter for the tests).

``Batch`` cannot be constructed from Python: get one from ``BatchPool.acquire()``.
"""

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITABLE
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport int8_t, int32_t, int64_t, uintptr_t
from libc.string cimport memcpy

import numpy as np

cdef object _CREATE = object()
cdef Py_ssize_t _live_batches = 0
cdef int64_t _next_pool_serial = 1


def live_batches():
    """Number of ``Batch`` C buffers currently allocated in this process."""
    return _live_batches


cdef class CView:
    def __cinit__(self, *args):
        if not args or args[0] is not _CREATE:
            raise TypeError("CView objects are internal views; they cannot be created from Python")

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("read-only view")
        buffer.buf = self.ptr
        buffer.obj = self
        buffer.len = self.shape[0] * (self.shape[1] if self.ndim == 2 else 1) * self.itemsize
        buffer.readonly = 1
        buffer.itemsize = self.itemsize
        buffer.format = <char *> self.fmt if flags & PyBUF_FORMAT else NULL
        buffer.ndim = self.ndim
        buffer.shape = self.shape if flags & PyBUF_ND else NULL
        buffer.strides = self.strides if flags & PyBUF_STRIDES else NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer *buffer):
        pass


cdef CView _view(object owner, void * ptr, Py_ssize_t itemsize, bytes fmt, int ndim,
                 Py_ssize_t n0, Py_ssize_t s0, Py_ssize_t n1, Py_ssize_t s1):
    cdef CView v = CView.__new__(CView, _CREATE)
    v.owner = owner
    v.ptr = ptr
    v.itemsize = itemsize
    v.fmt = fmt
    v.ndim = ndim
    v.shape[0] = n0
    v.strides[0] = s0
    v.shape[1] = n1
    v.strides[1] = s1
    return v


cdef object int32_array(object owner, int32_t * ptr, Py_ssize_t n, Py_ssize_t stride):
    """Read-only int32 numpy array of ``n`` items, ``stride`` items apart, over C memory."""
    return np.asarray(_view(owner, ptr, 4, b"i", 1, n, stride * 4, 0, 0))


cdef class Batch:
    """One preallocated ``llama_batch`` (get it from :meth:`BatchPool.acquire`)."""

    def __cinit__(self, object create=None, int32_t capacity=0, int32_t n_seq_max=0):
        cdef int32_t i
        if create is not _CREATE:
            raise TypeError("Batch objects are created by BatchPool.acquire()")
        if capacity < 1 or n_seq_max < 1:
            raise ValueError("capacity and n_seq_max must be >= 1")
        self.capacity_ = capacity
        self.n_seq_max_ = n_seq_max
        self.c.n_tokens = 0
        self.c.embd = NULL
        self.c.token = <int32_t *> PyMem_Calloc(capacity, sizeof(int32_t))
        self.c.pos = <int32_t *> PyMem_Calloc(capacity, sizeof(int32_t))
        self.c.n_seq_id = <int32_t *> PyMem_Calloc(capacity, sizeof(int32_t))
        self.c.seq_id = <int32_t **> PyMem_Calloc(capacity + 1, sizeof(int32_t *))
        self.c.logits = <int8_t *> PyMem_Calloc(capacity, sizeof(int8_t))
        self.seq_storage = <int32_t *> PyMem_Calloc(<size_t> capacity * n_seq_max, sizeof(int32_t))
        if (self.c.token == NULL or self.c.pos == NULL or self.c.n_seq_id == NULL
                or self.c.seq_id == NULL or self.c.logits == NULL or self.seq_storage == NULL):
            raise MemoryError("cannot allocate a llama_batch of capacity %d" % capacity)
        for i in range(capacity):
            self.c.seq_id[i] = self.seq_storage + <Py_ssize_t> i * n_seq_max
        self.c.seq_id[capacity] = NULL  # sentinel, as llama_batch_init leaves one
        global _live_batches
        _live_batches += 1

    def __dealloc__(self):
        global _live_batches
        if self.c.token != NULL:  # a fully constructed batch
            _live_batches -= 1
        PyMem_Free(self.c.token)
        PyMem_Free(self.c.pos)
        PyMem_Free(self.c.n_seq_id)
        PyMem_Free(self.c.seq_id)
        PyMem_Free(self.c.logits)
        PyMem_Free(self.seq_storage)

    @property
    def address(self):
        """Address of the ``llama_batch`` struct (for ``ffi.cast("llama_batch *", ...)``)."""
        return <uintptr_t> &self.c

    @property
    def n_tokens(self):
        return self.c.n_tokens

    @property
    def capacity(self):
        return self.capacity_

    @property
    def n_seq_max(self):
        return self.n_seq_max_

    @property
    def n_free(self):
        """Entries still free (``capacity - n_tokens``)."""
        return self.capacity_ - self.c.n_tokens

    def clear(self):
        """Empty the batch (``n_tokens = 0``); the buffers are kept."""
        self.c.n_tokens = 0

    cdef int add_c(self, int32_t token, int32_t pos, int32_t seq_id, bint logits) except -1:
        cdef int32_t i = self.c.n_tokens
        if i >= self.capacity_:
            raise ValueError("batch is full (capacity %d)" % self.capacity_)
        self.c.token[i] = token
        self.c.pos[i] = pos
        self.c.n_seq_id[i] = 1
        self.c.seq_id[i][0] = seq_id
        self.c.logits[i] = logits
        self.c.n_tokens = i + 1
        return 0

    def add(self, int32_t token, int32_t pos, seq_id, bint logits=False):
        """Append one entry. ``seq_id`` is an int or a sequence of at most ``n_seq_max`` ints.

        Raises ``ValueError`` when the batch is full.
        """
        cdef int32_t i = self.c.n_tokens
        cdef int32_t k
        if isinstance(seq_id, int):
            self.add_c(token, pos, seq_id, logits)
            return
        ids = [int(s) for s in seq_id]
        if not 1 <= len(ids) <= self.n_seq_max_:
            raise ValueError("an entry needs 1..%d seq ids, got %d" % (self.n_seq_max_, len(ids)))
        self.add_c(token, pos, ids[0], logits)
        for k in range(len(ids)):
            self.c.seq_id[i][k] = ids[k]
        self.c.n_seq_id[i] = len(ids)

    def add_sequence(self, tokens, int32_t seq_id, int32_t pos0=0, bint output_all=False):
        """Append a whole sequence: ``tokens[j]`` at position ``pos0 + j`` in ``seq_id``.

        Every token requests an output when ``output_all`` (embeddings), else only the
        last one. ``tokens`` is any int32 buffer (``array('i')``, numpy int32) or a sequence
        of ints. Returns the batch index of the sequence's first token. Raises
        ``ValueError`` (and adds nothing) if the sequence is empty or does not fit.
        """
        cdef const int32_t[::1] toks = as_int32(tokens)
        cdef Py_ssize_t n = toks.shape[0]
        cdef int32_t start = self.c.n_tokens
        cdef int32_t i
        if n == 0:
            raise ValueError("empty sequence")
        if n > self.capacity_ - start:
            raise ValueError(
                "sequence of %d tokens does not fit: %d of %d entries free"
                % (n, self.capacity_ - start, self.capacity_)
            )
        memcpy(self.c.token + start, &toks[0], n * sizeof(int32_t))
        for i in range(<int32_t> n):
            self.c.pos[start + i] = pos0 + i
            self.c.n_seq_id[start + i] = 1
            self.c.seq_id[start + i][0] = seq_id
            self.c.logits[start + i] = output_all
        self.c.logits[start + n - 1] = 1
        self.c.n_tokens = start + <int32_t> n
        return start

    @property
    def tokens(self):
        """Read-only int32 view of the tokens of the first ``n_tokens`` entries."""
        return int32_array(self, self.c.token, self.c.n_tokens, 1)

    @property
    def pos(self):
        """Read-only int32 view of the positions of the first ``n_tokens`` entries."""
        return int32_array(self, self.c.pos, self.c.n_tokens, 1)

    @property
    def n_seq_id(self):
        """Read-only int32 view: how many seq ids each of the first ``n_tokens`` entries has."""
        return int32_array(self, self.c.n_seq_id, self.c.n_tokens, 1)

    @property
    def seq_ids(self):
        """Read-only int32 view of each entry's first seq id (the only one when n_seq_max=1)."""
        return int32_array(self, self.seq_storage, self.c.n_tokens, self.n_seq_max_)

    @property
    def seq_ids_all(self):
        """Read-only int32 view, shape ``(n_tokens, n_seq_max)``; row i is valid up to n_seq_id[i]."""
        return np.asarray(
            _view(self, self.seq_storage, 4, b"i", 2, self.c.n_tokens, self.n_seq_max_ * 4,
                  self.n_seq_max_, 4)
        )

    @property
    def logits(self):
        """Read-only int8 view of the output flags of the first ``n_tokens`` entries."""
        return np.asarray(_view(self, self.c.logits, 1, b"b", 1, self.c.n_tokens, 1, 0, 0))

    def entries(self):
        """The entries as a list of ``(token, pos, seq_id, logits)`` tuples (tests, tools).

        ``seq_id`` is an int when the entry has one seq id, else a tuple.
        """
        cdef int32_t i, k
        out = []
        for i in range(self.c.n_tokens):
            if self.c.n_seq_id[i] == 1:
                sid = self.c.seq_id[i][0]
            else:
                sid = tuple([self.c.seq_id[i][k] for k in range(self.c.n_seq_id[i])])
            out.append((self.c.token[i], self.c.pos[i], sid, bool(self.c.logits[i])))
        return out

    def __len__(self):
        return self.c.n_tokens

    def __repr__(self):
        return "<Batch n_tokens=%d capacity=%d n_seq_max=%d%s>" % (
            self.c.n_tokens, self.capacity_, self.n_seq_max_, " (acquired)" if self.outstanding else ""
        )


cdef class BatchPool:
    """Lends preallocated batches of capacity ``n_batch`` (seq ids per token: ``n_seq_max``).

    ``prealloc`` batches are allocated up front; ``acquire`` allocates another only when
    all are lent, so a steady tick loop allocates nothing.
    """

    def __cinit__(self, int32_t n_batch=512, int32_t n_seq_max=1, int prealloc=1):
        global _next_pool_serial
        if n_batch < 1:
            raise ValueError("n_batch must be >= 1, got %d" % n_batch)
        if n_seq_max < 1:
            raise ValueError("n_seq_max must be >= 1, got %d" % n_seq_max)
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.serial = _next_pool_serial
        _next_pool_serial += 1
        self.free = []
        for _ in range(max(prealloc, 0)):
            self.free.append(self._new_batch())

    cdef Batch _new_batch(self):
        cdef Batch b = Batch.__new__(Batch, _CREATE, self.n_batch, self.n_seq_max)
        b.pool_serial = self.serial
        self.n_allocated += 1
        return b

    cpdef Batch acquire(self):
        """Lend an empty batch (``n_tokens == 0``)."""
        cdef Batch b
        if self.free:
            b = <Batch> self.free.pop()
        else:
            b = self._new_batch()
        b.c.n_tokens = 0
        b.outstanding = True
        self.n_acquired += 1
        return b

    cpdef release(self, Batch batch):
        """Take back a batch lent by this pool. Raises ``ValueError`` on a foreign or double release."""
        if batch is None or batch.pool_serial != self.serial:
            raise ValueError("this batch does not belong to this pool")
        if not batch.outstanding:
            raise ValueError("this batch was already released")
        batch.outstanding = False
        batch.c.n_tokens = 0
        self.free.append(batch)
        self.n_released += 1

    @property
    def n_outstanding(self):
        """Batches acquired and not yet released (0 when nothing leaks)."""
        return self.n_acquired - self.n_released

    @property
    def n_free(self):
        return len(self.free)

    def __repr__(self):
        return "<BatchPool n_batch=%d n_seq_max=%d outstanding=%d free=%d>" % (
            self.n_batch, self.n_seq_max, self.n_outstanding, len(self.free)
        )


cdef const int32_t[::1] as_int32(object tokens) except *:
    """Any int32 buffer as a typed memoryview; other sequences are converted (a copy)."""
    cdef const int32_t[::1] view
    try:
        view = tokens
    except (TypeError, ValueError, BufferError):
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError("tokens must be one-dimensional")
        if arr.size and arr.dtype.kind not in "iub":
            raise TypeError("tokens must be integers, got dtype %s" % arr.dtype)
        if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
            raise OverflowError("token id out of int32 range")
        view = np.ascontiguousarray(arr, dtype=np.int32)
    return view
