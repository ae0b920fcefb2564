from libc.stdint cimport int32_t


cdef void cheapest_runs(int32_t m, const int32_t * sorted_e, const int32_t * plan_slot,
                        const int32_t * plan_n, const double * ext_of, double f,
                        int32_t * cut, double * best, int32_t * order) noexcept nogil
