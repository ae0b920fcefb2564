from libc.stdint cimport int32_t


# What a built-in strategy sees: the schedulable slots, already ordered.
ctypedef struct plan_in_t:
    int32_t budget          # tokens allowed this tick (n_batch)
    int32_t chunk_size      # max prompt tokens per slot this tick
    int32_t queue_depth     # requests waiting for a slot (adaptive strategies)
    int32_t n_decode
    const int32_t * decode_slots     # DECODE slots, round-robin order
    int32_t n_prefill
    const int32_t * prefill_slots    # PREFILL slots, arrival (FIFO) order
    const int32_t * prefill_pending  # prompt tokens still to compute, per prefill_slots entry


cdef class Strategy:
    cdef readonly bint native  # True for the exact built-in classes: fill uses plan_c

    # Writes the plan, in batch order, to out_slot/out_n (room for n_decode + n_prefill
    # entries) and returns its length. Decode entries get 1 token.
    cdef int32_t plan_c(self, const plan_in_t * p, int32_t * out_slot, int32_t * out_n) noexcept nogil


cdef class DecodeMaximal(Strategy):
    pass


cdef class PrefillPriority(Strategy):
    pass


cdef class Balanced(Strategy):
    pass
