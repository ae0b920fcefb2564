"""The cheapest ubatch runs of a batch for a KV cache with one stream per sequence.

llama.cpp splits such a batch into ubatches of *consecutive* seq_ids, and a ubatch's
attention spans as many cells in every stream as its longest stream holds (see
``SlotTable.batch_order`` in ``slots.pyx``, which calls this). Here is the dynamic
programme that cuts the plan's entries, sorted by slot, into runs at least cost.
"""

from libc.stdint cimport int32_t


cdef void cheapest_runs(int32_t m, const int32_t * sorted_e, const int32_t * plan_slot,
                        const int32_t * plan_n, const double * ext_of, double f,
                        int32_t * cut, double * best, int32_t * order) noexcept nogil:
    """Write the ``m`` plan entries ``sorted_e`` (indices into ``plan_slot`` / ``plan_n`` /
    ``ext_of``, by slot) to ``order`` in runs of consecutive slots, last run first, at the
    least cost: ``f`` cell reads per ubatch, and each entry's tokens over its stream's
    padded extent ``ext_of``. ``cut`` and ``best`` are scratch of ``m + 1``."""
    cdef int32_t e, i, j, s, w = 0, k, mn_k, mx_k
    cdef double ext, mx_ext, sum_p, sum_kp, cost
    # best[j]: the cheapest runs of the first j entries; cut[j]: its last run's start.
    # A run costs a ubatch (two when its streams' tokens differ: the rest of the longer
    # ones go on alone), its streams' first tokens over its longest stream, and the rest
    # of each stream's tokens over its own cells.
    best[0] = 0.0
    for j in range(1, m + 1):
        best[j] = -1.0
        mx_ext = 0.0
        sum_p = 0.0
        sum_kp = 0.0
        mn_k = 2147483647
        mx_k = 0
        i = j - 1
        while i >= 0:
            e = sorted_e[i]
            s = plan_slot[e]
            if i < j - 1 and s + 1 != plan_slot[sorted_e[i + 1]]:
                break  # a missing slot: llama.cpp cuts here anyway
            k = plan_n[e]
            ext = ext_of[e]
            if ext > mx_ext:
                mx_ext = ext
            sum_p += ext
            sum_kp += k * ext
            if k < mn_k:
                mn_k = k
            if k > mx_k:
                mx_k = k
            cost = (best[i] + f * (2 if mx_k > mn_k else 1)
                    + (j - i) * mn_k * mx_ext + sum_kp - mn_k * sum_p)
            if best[j] < 0.0 or cost <= best[j]:  # ties: the longer run
                best[j] = cost
                cut[j] = i
            i -= 1
    j = m
    while j > 0:
        i = cut[j]
        for e in range(i, j):
            order[w] = sorted_e[e]
            w += 1
        j = i
