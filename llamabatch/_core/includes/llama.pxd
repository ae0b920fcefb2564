# C declarations only: the part of llama.h the scheduler core needs (struct layout).
# The core never links libllama and never calls a llama_* function; it fills the arrays
# of a llama_batch that the cffi layer hands to llama_decode.

from libc.stdint cimport int8_t, int32_t


cdef extern from "llama.h" nogil:
    ctypedef int32_t llama_token
    ctypedef int32_t llama_pos
    ctypedef int32_t llama_seq_id

    ctypedef struct llama_batch:
        int32_t n_tokens
        llama_token * token
        float * embd
        llama_pos * pos
        int32_t * n_seq_id
        llama_seq_id ** seq_id
        int8_t * logits
