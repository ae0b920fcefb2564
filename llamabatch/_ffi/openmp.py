"""Give back a thread's OpenMP workers when it goes idle.

ggml's CPU backend runs every graph in an OpenMP parallel region (the pinned build links
GCC's libgomp), and libgomp keeps each calling thread's team of workers after the region
ends. Once the process holds more OpenMP threads than CPUs, libgomp throttles the spin-wait
of every thread at a barrier (100 spins instead of 300,000, ``GOMP_SPINCOUNT``'s documented
fallback), so the workers of a busy team sleep in the kernel between ggml's barriers, and the
CPUs sit idle. An ``LLM`` and an ``Embedder`` in one process are two worker threads with a
team each: the one with work ran slower because the other had worked once
(measured: 8 streams decoding after an ``Embedder`` in the process had worked once ran at
0.84-0.89x of their speed alone; README, "Running it safely").

A llamabatch worker thread that is about to sleep calls :func:`release_openmp_threads`:
``omp_pause_resource_all(omp_pause_soft)`` frees the calling thread's pool (libgomp touches
no other thread's), and its next parallel region makes a new one (a thread start or two).
With another OpenMP runtime (LLVM's libomp pauses the whole process) or none, it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

__all__ = ["release_openmp_threads"]

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft
_LIBGOMP = "libgomp.so.1"

_lock = threading.Lock()
_pause: Callable[[int], int] | None = None
_resolved = False


def _find_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the libgomp already in the process, else None."""
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:  # not a dlopen platform
        return None
    try:
        lib = ctypes.CDLL(_LIBGOMP, mode=no_load)  # only if ggml loaded it: never load it here
    except OSError:
        return None
    fn = getattr(lib, "omp_pause_resource_all", None)  # OpenMP 5.0 (GCC 9)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads; True when libgomp did.

    Call it from a thread that has computed with llama.cpp and is about to wait, never from
    inside a computation."""
    global _pause, _resolved
    if not _resolved:
        with _lock:
            if not _resolved:
                _pause = _find_pause()
                _resolved = True
    return _pause is not None and _pause(_OMP_PAUSE_SOFT) == 0
