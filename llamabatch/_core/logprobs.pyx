"""One logits row's log-probabilities: the ``n`` most likely tokens and a chosen one.

Two passes over the row (its maximum, then the sum of ``exp(logit - max)`` in double
precision) and a top-``n`` kept by insertion while scanning: no copy of the row, no sort of
the vocabulary, no Python object per token. ``n`` is at most 20 in the server (OpenAI's
bound) but any ``n`` works (the insertion costs ``n`` per token that enters the top).
"""

from libc.math cimport exp, log
from cpython.mem cimport PyMem_Malloc, PyMem_Free


def row_top_logprobs(const float[::1] logits, Py_ssize_t n, Py_ssize_t token):
    """``{token id: log-probability}`` of the ``n`` most likely tokens of ``logits``, best
    first (of equal logits, the lower id first), then ``token`` (``-1``: none) if not among
    them."""
    cdef Py_ssize_t n_vocab = logits.shape[0]
    cdef Py_ssize_t i, j, k = 0
    cdef float peak, x
    cdef double total = 0.0, lse
    cdef Py_ssize_t *ids
    cdef float *vals
    if n_vocab == 0:
        raise ValueError("an empty logits row")
    if token >= n_vocab:
        raise ValueError(f"token {token} is outside the vocabulary of {n_vocab}")
    if n > n_vocab:
        n = n_vocab
    if n < 0:
        n = 0
    peak = logits[0]
    for i in range(1, n_vocab):
        if logits[i] > peak:
            peak = logits[i]
    for i in range(n_vocab):
        total += exp(<double>logits[i] - <double>peak)
    lse = <double>peak + log(total)
    out = {}
    if n > 0:
        ids = <Py_ssize_t *>PyMem_Malloc(n * sizeof(Py_ssize_t))
        vals = <float *>PyMem_Malloc(n * sizeof(float))
        if ids == NULL or vals == NULL:
            PyMem_Free(ids)
            PyMem_Free(vals)
            raise MemoryError()
        try:
            for i in range(n_vocab):
                x = logits[i]
                if k == n:
                    if not x > vals[n - 1]:
                        continue
                    j = n - 1
                else:
                    j = k
                    k += 1
                while j > 0 and vals[j - 1] < x:  # after equals: the lower id stays first
                    vals[j] = vals[j - 1]
                    ids[j] = ids[j - 1]
                    j -= 1
                vals[j] = x
                ids[j] = i
            for j in range(k):
                out[ids[j]] = <double>vals[j] - lse
        finally:
            PyMem_Free(ids)
            PyMem_Free(vals)
    if token >= 0:
        out[token] = <double>logits[token] - lse
    return out
