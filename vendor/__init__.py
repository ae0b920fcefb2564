"""Locate and verify the vendored llama.cpp build.

The build comes from the pinned PyPI distribution ``llama-cpp-python`` (see
``vendor/README.md``): it compiles llama.cpp and installs ``llama_cpp/lib/libllama.so``
(plus the ``libggml*`` libraries) and the headers in ``<site-packages>/include``.
A user with their own llama.cpp build sets ``LLAMABATCH_LLAMA_PREFIX`` to its install
prefix (``include/`` and ``lib/`` below it).

This module is used twice: by ``setup.py`` (loaded by file path, so it must not import
anything from ``llamabatch``) to find the headers and libraries to compile against, and
at import time, installed as ``llamabatch._vendor``, to find and preload the shared
libraries the binding was linked to.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: The pinned distribution that builds llama.cpp for us.
LLAMA_CPP_PYTHON_DIST = "llama-cpp-python"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: The llama.cpp commit that llama-cpp-python 0.3.36 compiles.
LLAMA_CPP_COMMIT = "0c1e570"
#: Environment variable naming a custom llama.cpp install prefix.
PREFIX_ENV = "LLAMABATCH_LLAMA_PREFIX"

# Load order matters: each library needs the ones before it.
_LIBRARY_STEMS = ("ggml-base", "ggml-cpu", "ggml", "llama")

_HOW_TO_FIX = (
    f"Install the pinned build with `pip install {LLAMA_CPP_PYTHON_DIST}=="
    f"{LLAMA_CPP_PYTHON_VERSION}` (it compiles llama.cpp, ~7 minutes the first time), "
    f"or point {PREFIX_ENV} at the install prefix of your own llama.cpp build "
    "(the directory holding include/llama.h and lib/libllama.so)."
)


class LlamaBuildNotFound(ImportError):
    """The llama.cpp headers or shared libraries could not be found or do not match."""


@dataclass(frozen=True)
class LlamaBuild:
    """Where one llama.cpp build lives."""

    include_dir: Path
    lib_dir: Path
    #: "pinned" for llama-cpp-python's build, "custom" for LLAMABATCH_LLAMA_PREFIX.
    origin: str

    @property
    def header(self) -> Path:
        return self.include_dir / "llama.h"

    def library(self, stem: str) -> Path | None:
        for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
            path = self.lib_dir / name
            if path.exists():
                return path
        return None


def _custom_build(prefix: str) -> LlamaBuild:
    root = Path(prefix).expanduser().resolve()
    include_dir = root / "include"
    lib_dir = next((d for d in (root / "lib", root / "lib64") if d.is_dir()), root / "lib")
    build = LlamaBuild(include_dir, lib_dir, "custom")
    if not build.header.exists():
        raise LlamaBuildNotFound(f"{PREFIX_ENV}={prefix}: no {build.header}. {_HOW_TO_FIX}")
    if build.library("llama") is None:
        raise LlamaBuildNotFound(f"{PREFIX_ENV}={prefix}: no libllama in {lib_dir}. {_HOW_TO_FIX}")
    return build


def _pinned_build() -> LlamaBuild:
    try:
        version = importlib.metadata.version(LLAMA_CPP_PYTHON_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise LlamaBuildNotFound(f"{LLAMA_CPP_PYTHON_DIST} is not installed. {_HOW_TO_FIX}") from None
    if version != LLAMA_CPP_PYTHON_VERSION:
        raise LlamaBuildNotFound(
            f"{LLAMA_CPP_PYTHON_DIST} {version} is installed, llamabatch needs "
            f"{LLAMA_CPP_PYTHON_VERSION} (llama.cpp {LLAMA_CPP_COMMIT}). {_HOW_TO_FIX}"
        )
    # find_spec does not import llama_cpp (which would load the libraries itself).
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise LlamaBuildNotFound(f"{LLAMA_CPP_PYTHON_DIST} is installed but not importable. {_HOW_TO_FIX}")
    package_dir = Path(spec.origin).resolve().parent
    site_packages = package_dir.parent
    build = LlamaBuild(site_packages / "include", package_dir / "lib", "pinned")
    if not build.header.exists():
        raise LlamaBuildNotFound(f"{LLAMA_CPP_PYTHON_DIST} installed no {build.header}. {_HOW_TO_FIX}")
    if build.library("llama") is None:
        raise LlamaBuildNotFound(
            f"{LLAMA_CPP_PYTHON_DIST} installed no libllama in {build.lib_dir}. {_HOW_TO_FIX}"
        )
    return build


def find_build() -> LlamaBuild:
    """Return the llama.cpp build to use: ``$LLAMABATCH_LLAMA_PREFIX`` or the pinned one."""
    prefix = os.environ.get(PREFIX_ENV)
    return _custom_build(prefix) if prefix else _pinned_build()


_loaded: list[ctypes.CDLL] = []


def preload(build: LlamaBuild | None = None) -> LlamaBuild:
    """Load the build's shared libraries globally, before the binding's extension module.

    The extension is linked against ``libllama`` with an rpath into the runtime copy of
    llama-cpp-python; preloading by absolute path makes the same libraries win for an
    in-place or editable build and for a custom prefix, with no LD_LIBRARY_PATH.
    """
    build = build or find_build()
    if _loaded:
        return build
    mode = getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0)
    for stem in _LIBRARY_STEMS:
        path = build.library(stem)
        if path is None:
            continue  # some builds fold the ggml libraries into one
        try:
            _loaded.append(ctypes.CDLL(str(path), mode=mode))
        except OSError as exc:
            raise LlamaBuildNotFound(f"cannot load {path}: {exc}. {_HOW_TO_FIX}") from exc
    return build


def missing_symbols(names: list[str], build: LlamaBuild | None = None) -> list[str]:
    """Return the names the build's libllama does not export (for custom builds)."""
    build = preload(build)
    lib = _loaded[-1]
    return [name for name in names if not hasattr(lib, name)]


if __name__ == "__main__":  # pragma: no cover - a diagnostic for users
    b = find_build()
    print(f"origin={b.origin}\ninclude_dir={b.include_dir}\nlib_dir={b.lib_dir}", file=sys.stdout)
