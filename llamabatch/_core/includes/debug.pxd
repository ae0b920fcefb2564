# The LLAMABATCH_DEBUG C macro, set to 0 or 1 by setup.py (env LLAMABATCH_DEBUG=1 at
# build time). A C-level constant, so `if LLAMABATCH_DEBUG:` is folded away by the C
# compiler in release builds.

cdef extern from *:
    """
    #ifndef LLAMABATCH_DEBUG
    #define LLAMABATCH_DEBUG 0
    #endif
    """
    const int LLAMABATCH_DEBUG
