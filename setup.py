"""Build llamabatch: the cffi binding to llama.cpp and the Cython scheduler core.

Both compile against the vendored llama.cpp build found by ``vendor/__init__.py``
(``llama-cpp-python==0.3.36``, or ``$LLAMABATCH_LLAMA_PREFIX``). Set
``LLAMABATCH_DEBUG=1`` to build the Cython core with its debug checks (slot state
transition checks, bounds checks).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


vendor = _load("_llamabatch_vendor", ROOT / "vendor" / "__init__.py")
ffi_build = _load("_llamabatch_ffi_build", ROOT / "llamabatch" / "_ffi" / "_build.py")

build = vendor.find_build()
DEBUG = os.environ.get("LLAMABATCH_DEBUG", "") not in ("", "0")

# A custom prefix stays where it is, so an absolute rpath to it is safe.
extra_rpaths = [str(build.lib_dir)] if build.origin == "custom" else []
ffi_ext = ffi_build.make_ffi(build.include_dir, build.lib_dir, extra_rpaths).distutils_extension()
# libmtmd (images) is optional: a custom build without it still gets the text binding.
mtmd_exts = (
    [ffi_build.make_mtmd_ffi(build.include_dir, build.lib_dir, extra_rpaths).distutils_extension()]
    if build.library("mtmd") is not None and (build.include_dir / "mtmd.h").exists()
    else []
)


def core_extensions() -> list[Extension]:
    from Cython.Build import cythonize

    sources = sorted((ROOT / "llamabatch" / "_core").glob("*.pyx"))
    extensions = [
        Extension(
            f"llamabatch._core.{src.stem}",
            [str(src.relative_to(ROOT))],
            include_dirs=[str(build.include_dir), str(ROOT / "llamabatch" / "_core" / "includes")],
            extra_compile_args=["-O3", "-Wno-deprecated-declarations"] + ([] if not DEBUG else ["-O0", "-g"]),
            define_macros=[("LLAMABATCH_DEBUG", "1" if DEBUG else "0")],
        )
        for src in sources
    ]
    return cythonize(
        extensions,
        compiler_directives={
            "language_level": "3",
            "boundscheck": DEBUG,
            "wraparound": False,
            "initializedcheck": DEBUG,
            "cdivision": True,
        },
        compile_time_env={"LLAMABATCH_DEBUG": DEBUG},
        include_path=[str(ROOT / "llamabatch" / "_core")],
    )


setup(
    ext_modules=[ffi_ext, *mtmd_exts, *core_extensions()],
    package_dir={"llamabatch._vendor": "vendor"},
)
