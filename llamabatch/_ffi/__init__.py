"""The cffi binding to llama.cpp: the only code in llamabatch that calls ``llama_*``.

``ffi`` and ``lib`` come from the out-of-line API-mode module ``_llama`` compiled by
``setup.py`` against the vendored llama.h. Owners of the C objects live beside it:
``model.Model``, ``context.Context``, ``sampler.SamplerChain``.
"""

from __future__ import annotations

import threading

import llamabatch._vendor as _vendor

try:
    BUILD = _vendor.preload()
except _vendor.LlamaBuildNotFound as exc:
    raise ImportError(f"llamabatch cannot find its llama.cpp build: {exc}") from exc

try:
    from llamabatch._ffi._llama import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "llamabatch's compiled binding (llamabatch._ffi._llama) is missing or does not load "
        f"({exc}). Install the package with `pip install .` (or `pip install -e .`), which "
        "compiles it against the vendored llama.cpp build."
    ) from exc

__all__ = ["BUILD", "ensure_backend", "ffi", "lib", "llama_version"]

_backend_lock = threading.Lock()
_backend_ready = False


def llama_version() -> str:
    """The version string of the loaded libllama."""
    return ffi.string(lib.llama_version()).decode()


def ensure_backend() -> None:
    """Initialise llama.cpp's backends once per process, and route its log to ``logging``."""
    global _backend_ready
    if _backend_ready:
        return
    with _backend_lock:
        if _backend_ready:
            return
        from llamabatch._ffi import log

        log.install()
        lib.llama_backend_init()
        _backend_ready = True
