"""cffi builder for ``llamabatch._ffi._llama`` (API mode, out of line).

Used by ``setup.py`` through ``cffi_modules``-style ``build(build)``: compiles the
hand-written ``_cdefs.h`` against the vendored ``llama.h`` so that the C compiler checks
every declared struct field and signature, and links to the vendored ``libllama``.
"""

from __future__ import annotations

from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
MODULE_NAME = "llamabatch._ffi._llama"

# The installed extension lives in <site-packages>/llamabatch/_ffi/; the runtime copy of
# llama-cpp-python sits beside llamabatch in the same site-packages. An rpath into the
# build environment would break: pip deletes its isolated build env after the build.
RUNTIME_RPATH = "$ORIGIN/../../llama_cpp/lib"


C_SOURCE = """
#include "llama.h"

static bool llamabatch_abort_flag_cb(void * data) {
    return data != NULL && *(volatile int *) data != 0;
}
"""


def cdef_source() -> str:
    return (HERE / "_cdefs.h").read_text()


def make_ffi(include_dir: Path, lib_dir: Path, extra_rpaths: list[str] | None = None) -> cffi.FFI:
    ffibuilder = cffi.FFI()
    ffibuilder.cdef(cdef_source())
    rpaths = [RUNTIME_RPATH, *(extra_rpaths or [])]
    ffibuilder.set_source(
        MODULE_NAME,
        C_SOURCE,
        include_dirs=[str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=["llama"],
        extra_link_args=[f"-Wl,-rpath,{p}" for p in rpaths],
        extra_compile_args=["-O2", "-Wno-deprecated-declarations"],
    )
    return ffibuilder
