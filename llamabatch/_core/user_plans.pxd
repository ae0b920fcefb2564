from libc.stdint cimport int32_t

from llamabatch._core.slot_record cimport SlotRecord
from llamabatch._core.strategies cimport plan_in_t


cdef class TableView:
    cdef SlotRecord t                  # None once the plan() it was made for returned
    cdef const int32_t * rr_cursor     # the table's own fields, valid while t is set
    cdef const int32_t * fifo
    cdef const int32_t * n_fifo
    cdef SlotRecord table(self)


cdef TableView make_view(SlotRecord t, const int32_t * rr_cursor, const int32_t * fifo, const int32_t * n_fifo)
cdef int32_t read_plan(TableView view, object strategy, const plan_in_t * p, int32_t * mark,
                       int32_t * plan_slot, int32_t * plan_n) except -1
cdef int check_native_plan(SlotRecord t, object strategy, const plan_in_t * p, int32_t n, int32_t * mark,
                           const int32_t * plan_slot, const int32_t * plan_n) except -1
