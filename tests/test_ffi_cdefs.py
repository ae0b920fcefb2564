"""The hand-written cdef must only name what the vendored llama.h declares."""

from __future__ import annotations

import re

from llamabatch import _vendor
from llamabatch._ffi import _build

FUNCTION = re.compile(r"\b(llama_[a-z0-9_]+)\s*\(")
STRUCT = re.compile(r"\bstruct\s+(llama_[a-z0-9_]+)\s*\{")
ENUM = re.compile(r"\benum\s+(llama_[a-z0-9_]+)\s*\{")


def _cdef_names(pattern: re.Pattern[str]) -> set[str]:
    return set(pattern.findall(_build.cdef_source()))


def test_every_cdef_function_is_in_llama_h():
    header = _vendor.find_build().header.read_text()
    declared = set(re.findall(r"LLAMA_API[^;]*?\b(llama_[a-z0-9_]+)\s*\(", header, flags=re.S))
    names = _cdef_names(FUNCTION)
    assert names, "no functions parsed from _cdefs.h"
    missing = sorted(names - declared)
    assert not missing, f"cdef names missing from the vendored llama.h: {missing}"


def test_every_cdef_struct_and_enum_is_in_llama_h():
    header = _vendor.find_build().header.read_text()
    for pattern in (STRUCT, ENUM):
        for name in _cdef_names(pattern):
            assert re.search(rf"\b(struct|enum)\s+{name}\s*\{{", header), f"{name} not in llama.h"


def test_loaded_library_exports_every_function():
    names = sorted(_cdef_names(FUNCTION))
    assert _vendor.missing_symbols(names) == []
