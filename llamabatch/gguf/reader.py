"""The GGUF container reader: the header of a GGUF file, memory-mapped, every count bounded.

Reading: the file is memory-mapped and only the header is read; tensor data is never touched,
so a 70 GB file costs what its header costs. The format's facts (value types, tensor types and
their block sizes, key names, token types) come from the ``gguf`` package's constants. The
header is parsed here rather than with ``gguf.GGUFReader``: that reader builds a numpy view per
array element (about 20 s for a 150k-token vocabulary with its merges) and trusts the counts it
reads (an array count of 2**60 keeps it looping). This parser bounds every count by the bytes
left in the file and reads a 150k-token vocabulary in well under a second.

``gguf/check.py`` checks what this module reads (``check_gguf``).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
)

from llamabatch.errors import ModelLoadError

__all__ = ["read_header", "tensor_names"]

# -- facts of the format and of llama.cpp (numbers, not code) --------------------------------

#: GGUF versions llama.cpp reads (v1 is no longer supported).
_VERSIONS = (2, GGUF_VERSION)
#: ggml tensors have at most 4 dimensions.
_MAX_DIMS = 4
#: ggml's backends need tensor data aligned to 32 bytes (llama.cpp maps the file in place).
_TENSOR_ALIGNMENT = 32
#: ggml's tensor names are at most 63 bytes.
_MAX_NAME = 63
#: llama.cpp refuses longer strings and arrays.
_MAX_STRING = 1 << 30
_MAX_ARRAY = 1 << 30

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})


@dataclass(frozen=True)
class _KV:
    type: GGUFValueType
    item_type: GGUFValueType | None  # arrays only
    count: int
    value: Any  # scalar: int/float/bool/bytes; array: numpy array, or list[bytes] of strings


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    type: GGMLQuantizationType
    offset: int  # relative to the data section
    nbytes: int


def tensor_names(path: str | os.PathLike[str]) -> list[str]:
    """The names of the tensors in the GGUF at ``path``, from its header alone (fast on any
    file: ``gguf.GGUFReader`` parses every vocabulary entry first, seconds on a large one).

    Raises ``FileNotFoundError`` or :class:`~llamabatch.errors.ModelLoadError` as :func:`check_gguf`
    does for a file that cannot be read.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(str(path), "not a regular file")
    return [t.name for t in read_header(path).tensors]


# -- the container ----------------------------------------------------------------------------


@dataclass
class Header:
    version: int
    file_size: int
    kv: dict[str, _KV]
    tensors: list[_TensorInfo]
    alignment: int
    data_offset: int


class _Parser:
    """A bounds-checked cursor over the mapped file."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def fail(self, where: str, what: str) -> ModelLoadError:
        return ModelLoadError(str(self.path), f"{where}: {what}")

    def take(self, n: int, where: str) -> int:
        """Reserve ``n`` bytes at the cursor; return their offset."""
        if n < 0 or n > self.size - self.pos:
            raise self.fail(
                where, f"needs {n} bytes at offset {self.pos} but the file ends at {self.size} (truncated?)"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, where: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, where))[0]

    def u64(self, where: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, where))[0]

    def string(self, where: str) -> bytes:
        """A string as llama.cpp reads it: a C string, so it ends at the first NUL byte."""
        n = self.u64(where)
        if n > _MAX_STRING:
            raise self.fail(where, f"string length {n} exceeds llama.cpp's limit of {_MAX_STRING} bytes")
        start = self.take(n, where)
        return _c_string(self.buf[start : start + n])

    def text(self, where: str) -> str:
        raw = self.string(where)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(where, f"not valid UTF-8: {raw[:40]!r}") from None

    def value_type(self, where: str) -> GGUFValueType:
        raw = self.u32(where)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(where, f"unknown GGUF value type {raw}") from None

    def scalar(self, vtype: GGUFValueType, where: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(where)
        fmt = _SCALAR_FORMATS[vtype]
        value = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), where))[0]
        return bool(value) if vtype == GGUFValueType.BOOL else value

    def array(self, where: str) -> _KV:
        item_type = self.value_type(where)
        if item_type == GGUFValueType.ARRAY:
            raise self.fail(where, "nested arrays are not supported")
        count = self.u64(where)
        if count > _MAX_ARRAY:
            raise self.fail(where, f"array length {count} exceeds llama.cpp's limit of {_MAX_ARRAY}")
        if item_type == GGUFValueType.STRING:
            # Each string needs at least its 8-byte length: bound the count before looping.
            if count * 8 > self.size - self.pos:
                raise self.fail(where, f"array of {count} strings does not fit in the file (truncated?)")
            items: list[Any] = []
            append = items.append
            unpack = struct.Struct("<Q").unpack_from
            buf, size, pos = self.buf, self.size, self.pos
            for _ in range(count):
                if pos + 8 > size:
                    self.pos = pos
                    raise self.fail(where, "array of strings runs past the end of the file (truncated?)")
                (n,) = unpack(buf, pos)
                pos += 8
                if n > size - pos:
                    self.pos = pos
                    raise self.fail(where, f"string length {n} runs past the end of the file")
                append(_c_string(buf[pos : pos + n]))
                pos += n
            self.pos = pos
            return _KV(GGUFValueType.ARRAY, item_type, count, items)
        dtype = np.dtype(_NUMPY_DTYPES[item_type])
        start = self.take(count * dtype.itemsize, where)
        values = np.frombuffer(self.buf[start : start + count * dtype.itemsize], dtype=dtype)
        if item_type == GGUFValueType.BOOL:
            values = values != 0
        return _KV(GGUFValueType.ARRAY, item_type, count, values)


def _c_string(raw: bytes) -> bytes:
    # llama.cpp hands strings around as C strings: "a\0b" is "a" to it (and may then collide).
    nul = raw.find(b"\0")
    return raw if nul < 0 else raw[:nul]


def read_header(path: Path) -> Header:
    size = path.stat().st_size
    if size < 24:
        raise ModelLoadError(str(path), f"not a GGUF file ({size} bytes, too small for a GGUF header)")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(path, buf)


def _parse(path: Path, buf: mmap.mmap) -> Header:
    p = _Parser(path, buf)
    magic = p.u32("GGUF header")
    if magic != GGUF_MAGIC:
        raise p.fail("GGUF header", f"not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    version = p.u32("GGUF header")
    if version & 0xFFFF == 0:
        raise p.fail(
            "GGUF header", f"version {version:#x}: a big-endian file, which llama.cpp cannot read here"
        )
    if version not in _VERSIONS:
        raise p.fail("GGUF header", f"unsupported GGUF version {version} (supported: {list(_VERSIONS)})")
    n_tensors = p.u64("GGUF header")
    n_kv = p.u64("GGUF header")
    # Each key-value pair takes at least 13 bytes, each tensor description at least 28.
    if n_kv > (p.size - p.pos) // 13:
        raise p.fail("GGUF header", f"claims {n_kv} key-value pairs, more than the file can hold")
    if n_tensors > (p.size - p.pos) // 28:
        raise p.fail("GGUF header", f"claims {n_tensors} tensors, more than the file can hold")

    kv: dict[str, _KV] = {}
    for i in range(n_kv):
        key = p.text(f"key-value pair {i}")
        if not key:
            raise p.fail(f"key-value pair {i}", "empty key")
        if key in kv:
            raise p.fail(key, "duplicate key")
        vtype = p.value_type(key)
        if vtype == GGUFValueType.ARRAY:
            kv[key] = p.array(key)
        else:
            kv[key] = _KV(vtype, None, 1, p.scalar(vtype, key))

    alignment = GGUF_DEFAULT_ALIGNMENT
    if Keys.General.ALIGNMENT in kv:
        entry = kv[Keys.General.ALIGNMENT]
        if entry.type != GGUFValueType.UINT32:
            raise p.fail(Keys.General.ALIGNMENT, f"must be a UINT32, is {entry.type.name}")
        alignment = entry.value
        if alignment == 0 or alignment & (alignment - 1):
            raise p.fail(Keys.General.ALIGNMENT, f"{alignment} is not a power of 2")

    tensors: list[_TensorInfo] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = p.text(f"tensor {i}")
        where = f"tensor {name!r}"
        if not name:
            raise p.fail(f"tensor {i}", "empty name")
        if len(name.encode()) > _MAX_NAME:
            raise p.fail(where, f"name longer than ggml's {_MAX_NAME} bytes")
        if name in seen:
            raise p.fail(where, "duplicate tensor (the name appears twice)")
        seen.add(name)
        n_dims = p.u32(where)
        if n_dims > _MAX_DIMS:
            raise p.fail(where, f"{n_dims} dimensions, ggml supports at most {_MAX_DIMS}")
        dims = tuple(p.u64(where) for _ in range(n_dims))
        if any(d >= 1 << 63 for d in dims):
            raise p.fail(where, f"negative dimension in {list(dims)}")
        raw_type = p.u32(where)
        try:
            ttype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise p.fail(where, f"unknown tensor type {raw_type} (not a gguf.GGMLQuantizationType)") from None
        offset = p.u64(where)
        n_elements = math.prod(dims)
        if dims and dims[0] % block:
            raise p.fail(
                where, f"row length {dims[0]} is not a multiple of {ttype.name}'s block size {block}"
            )
        if n_elements >= 1 << 63:
            raise p.fail(where, f"shape {list(dims)} has more elements than ggml can count")
        nbytes = n_elements // block * type_size
        tensors.append(_TensorInfo(name, dims, ttype, offset, nbytes))

    data_offset = -(-p.pos // alignment) * alignment if tensors else p.pos
    for t in tensors:
        where = f"tensor {t.name!r}"
        if t.offset % alignment:
            raise p.fail(where, f"data offset {t.offset} is not aligned to {alignment} bytes")
        if (data_offset + t.offset) % _TENSOR_ALIGNMENT:
            raise p.fail(
                where,
                f"data at file offset {data_offset + t.offset} is not {_TENSOR_ALIGNMENT}-byte aligned "
                f"(general.alignment {alignment}): llama.cpp maps tensors in place and needs that",
            )
        end = data_offset + t.offset + t.nbytes
        if end > p.size:
            raise p.fail(
                where,
                f"data [{data_offset + t.offset}, {end}) lies outside the file ({p.size} bytes; truncated?)",
            )
    return Header(version, p.size, kv, tensors, alignment, data_offset)


# -- semantics --------------------------------------------------------------------------------


def decode_text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def type_name(entry: _KV) -> str:
    if entry.type == GGUFValueType.ARRAY:
        item = entry.item_type.name if entry.item_type is not None else "?"
        return f"an array of {entry.count} {item}"
    return f"a {entry.type.name}"
