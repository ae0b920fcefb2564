"""Giving freed C heap memory back to the system (glibc's ``malloc_trim``).

llama.cpp's grammars are many small C++ allocations. Once freed, glibc keeps them in its
arenas, and a flood of grammar requests would leave the process that much bigger for good;
``malloc_trim(0)`` returns the free pages of every arena. Elsewhere (musl, macOS, Windows)
there is nothing to call, and :func:`trim_heap` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

__all__ = ["trim_heap"]


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_malloc_trim = _find_malloc_trim()


def trim_heap() -> bool:
    """Return the C heap's free pages to the system; whether anything was returned (False
    where the C library has no ``malloc_trim``). Takes milliseconds on a large heap: call it
    when the process is quiet."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))
