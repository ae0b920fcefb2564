"""What the loaded ggml CPU backend was built with, and the one choice that depends on it:
whether weights may go to llama.cpp's extra CPU buffer types.

llama.cpp places a quantized weight in an "extra" buffer type when one supports it: AMX tiles
on CPUs that have them, else ggml's repacked layouts (``use_extra_bufts`` in
``llama_model_params``). At the pinned commit the AMX kernels set up their tiles from a
configuration on the stack through GCC's ``_tile_loadconfig``, whose asm operand names only
the first 8 bytes, so GCC drops the stores of the tile shapes (``vmovdqa`` of zeros, then the
palette byte, then ``ldtilecfg``): the first AMX matrix product (a Q8_0/Q4_0 weight, two or
more tokens) dies with SIGILL on ``tilezero``. llama.cpp PR #26954 moves that configuration to
``.rodata``. A native build (``GGML_NATIVE``, llama-cpp-python's default) on an AMX CPU
(Sapphire Rapids and later) compiles that code, so there llamabatch keeps weights out of the
extra buffer types; ``LLAMABATCH_EXTRA_BUFTS=1`` gives them back for a build known to be good
(clang, or a llama.cpp with that fix), ``=0`` keeps them out anywhere.
"""

from __future__ import annotations

import functools
import os

from llamabatch._ffi import ensure_backend, ffi, lib

__all__ = ["EXTRA_BUFTS_ENV", "has_amx_build", "system_info", "use_extra_bufts"]

#: the environment variable that overrides :func:`use_extra_bufts` ("1": use them, "0": do not)
EXTRA_BUFTS_ENV = "LLAMABATCH_EXTRA_BUFTS"


@functools.cache
def system_info() -> str:
    """llama.cpp's system line: the CPU features its backends were built for (``AVX2 = 1 |
    ... | AMX_INT8 = 1 | ...``)."""
    ensure_backend()
    return ffi.string(lib.llama_print_system_info()).decode(errors="replace")


def has_amx_build() -> bool:
    """True when the CPU backend was compiled with AMX kernels (and so may run them)."""
    return "AMX_INT8 = 1" in system_info()


def use_extra_bufts() -> bool:
    """Whether models load with ``use_extra_bufts`` (see the module's docstring): the
    environment's choice when set, else True unless the build has AMX kernels."""
    setting = os.environ.get(EXTRA_BUFTS_ENV, "").strip()
    if setting:
        return setting not in ("0", "false", "no", "off")
    return not has_amx_build()
