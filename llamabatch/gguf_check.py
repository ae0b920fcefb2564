"""Check a GGUF model file before llama.cpp sees it.

llama.cpp parses GGUF headers carefully, but some files that parse yet are inconsistent make it
abort the whole process (``GGML_ASSERT``, ``std::terminate``) while loading, at the first
tokenization or at the first decode: duplicate token texts, a ``block_count`` of 0, a NaN RMS
epsilon, a WordPiece tokenizer declared over a SentencePiece vocabulary, and so on. A model file
is input from the internet, so :func:`check_gguf` reads it first and raises
:class:`~llamabatch.errors.ModelLoadError` naming the file, the key or tensor, and what is wrong.

What is checked:

* the container: magic, version, counts, string and array lengths, value and tensor types,
  tensor dimensions and data ranges all within the file (every length is bounded by the bytes
  left, so a hostile header costs nothing);
* hyper-parameters: present, integers where counts are expected, consistent with each other
  (head counts dividing the embedding length, per-layer arrays as long as ``block_count``,
  expert counts), finite and positive where llama.cpp divides by them or takes their root;
* the vocabulary: a known tokenizer model, unique and non-empty token texts, token/score/type
  arrays of equal length with valid token types and finite scores, special token ids in range,
  byte tokens where the tokenizer falls back on them, well-formed BPE merges;
* tensors (for ``llama``-like and ``bert`` files, the architectures llamabatch writes and
  serves): every tensor the architecture needs is present once with the shape the
  hyper-parameters imply and a type llama.cpp can compute with.

Other architectures get the generic checks only (container, hyper-parameters present and sane,
vocabulary, tensor bounds): llama.cpp knows their tensor layouts, llamabatch does not.

Reading: the file is memory-mapped and only the header is read; tensor data is never touched,
so a 70 GB file costs what its header costs. The format's facts (value types, tensor types and
their block sizes, key names, token types) come from the ``gguf`` package's constants. The
header is parsed here rather than with ``gguf.GGUFReader``: that reader builds a numpy view per
array element (about 20 s for a 150k-token vocabulary with its merges) and trusts the counts it
reads (an array count of 2**60 keeps it looping). This parser bounds every count by the bytes
left in the file and reads a 150k-token vocabulary in well under a second.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
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
    PoolingType,
    RopeScalingType,
    TokenType,
)

from llamabatch.errors import ModelLoadError

__all__ = ["GGUFReport", "check_gguf", "tensor_names"]

# -- facts of the format and of llama.cpp (numbers, not code) --------------------------------

#: GGUF versions llama.cpp reads (v1 is no longer supported).
_VERSIONS = (2, GGUF_VERSION)
#: ggml tensors have at most 4 dimensions.
_MAX_DIMS = 4
#: ggml's backends need tensor data aligned to 32 bytes (llama.cpp maps the file in place).
_TENSOR_ALIGNMENT = 32
#: ggml's tensor names are at most 63 bytes.
_MAX_NAME = 63
#: llama.cpp's compile-time limits.
_MAX_LAYERS = 512
_MAX_EXPERTS = 1024
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
_INT_TYPES = frozenset(
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
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})

_Q = GGMLQuantizationType
#: Integer and double tensor types: llama.cpp's matrix products and norms do not take them.
_NON_WEIGHT_TYPES = frozenset({_Q.I8, _Q.I16, _Q.I32, _Q.I64, _Q.F64})
#: Intermediate quantizations (activations of dot products), never weights.
_INTERMEDIATE_TYPES = frozenset({_Q.Q8_1, _Q.Q8_K})
#: Types of 1-D tensors (norm weights, biases) that llama.cpp adds and multiplies by.
_VECTOR_TYPES = frozenset({_Q.F32})

#: 2-D tensors whose rows llama.cpp adds to the activations as they are (so F32, like 1-D ones).
_ADDED_AS_IS = frozenset({"token_types.weight"})
#: ``tokenizer.ggml.model`` values llama.cpp knows, and the vocabulary type each selects.
_TOKENIZERS = {
    "no_vocab": "none",
    "none": "none",
    "llama": "spm",
    "bert": "wpm",
    "gpt2": "bpe",
    "hybriddna": "bpe",
    "whitespace": "bpe",
    "gemma4": "bpe",
    "t5": "ugm",
    "rwkv": "rwkv",
    "plamo2": "plamo2",
    "test": "test",
}
#: Token types: gguf's TokenType plus 0, "undefined" in llama.h.
_TOKEN_TYPES = frozenset({0, *(int(t) for t in TokenType)})
#: Keys holding special token ids.
_SPECIAL_ID_KEYS = (
    Keys.Tokenizer.BOS_ID,
    Keys.Tokenizer.EOS_ID,
    Keys.Tokenizer.EOT_ID,
    Keys.Tokenizer.EOM_ID,
    Keys.Tokenizer.UNK_ID,
    Keys.Tokenizer.SEP_ID,
    Keys.Tokenizer.PAD_ID,
    Keys.Tokenizer.MASK_ID,
    Keys.Tokenizer.FIM_PRE_ID,
    Keys.Tokenizer.FIM_SUF_ID,
    Keys.Tokenizer.FIM_MID_ID,
    Keys.Tokenizer.FIM_PAD_ID,
    Keys.Tokenizer.FIM_REP_ID,
    Keys.Tokenizer.FIM_SEP_ID,
    Keys.Tokenizer.PREFIX_ID,
    Keys.Tokenizer.SUFFIX_ID,
    Keys.Tokenizer.MIDDLE_ID,
)
#: Architectures whose graph is llama's (same tensors and hyper-parameters).
LLAMA_LIKE = frozenset({"llama"})
#: Architectures whose tensors this module knows.
KNOWN_LAYOUTS = LLAMA_LIKE | {"bert"}
#: Architectures that need text tokenized (a "none" vocabulary cannot serve them).
_TEXT_ARCHS = KNOWN_LAYOUTS
#: WordPiece's word-start marker in llama.cpp's WPM vocabularies ("\u2581", as SentencePiece).
_PHANTOM_SPACE = "\u2581"


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


@dataclass(frozen=True)
class GGUFReport:
    """What :func:`check_gguf` read from a file that passed.

    ``n_vocab`` and ``tokenizer_model`` are None for files without a vocabulary; ``layout_checked``
    says whether the tensors were checked against the architecture (``llama`` and ``bert``),
    not only for bounds. ``notes`` lists what was accepted but looks unusual.
    """

    path: Path
    version: int
    architecture: str
    n_kv: int
    n_tensors: int
    n_vocab: int | None
    tokenizer_model: str | None
    layout_checked: bool
    notes: tuple[str, ...] = field(default=())


def check_gguf(path: str | os.PathLike[str], *, vocab_only: bool = False) -> GGUFReport:
    """Check that llama.cpp can load, tokenize with and run the GGUF at ``path``.

    ``vocab_only`` checks only what loading the vocabulary needs (the container and the
    vocabulary), as ``Model(vocab_only=True)`` loads no weights.

    Returns a :class:`GGUFReport`. Raises ``FileNotFoundError`` for a missing file and
    :class:`~llamabatch.errors.ModelLoadError` for anything wrong, naming the key or tensor.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(str(path), "not a regular file")
    header = _read_header(path)
    return _Checker(path, header, vocab_only).run()


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
    return [t.name for t in _read_header(path).tensors]


# -- the container ----------------------------------------------------------------------------


@dataclass
class _Header:
    version: int
    file_size: int
    kv: dict[str, _KV]
    tensors: list[_TensorInfo]
    alignment: int
    data_offset: int


class _Truncated(Exception):
    pass


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
            items = []
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


def _read_header(path: Path) -> _Header:
    size = path.stat().st_size
    if size < 24:
        raise ModelLoadError(str(path), f"not a GGUF file ({size} bytes, too small for a GGUF header)")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(path, buf)


def _parse(path: Path, buf: mmap.mmap) -> _Header:
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
    return _Header(version, p.size, kv, tensors, alignment, data_offset)


# -- semantics --------------------------------------------------------------------------------


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _type_name(entry: _KV) -> str:
    if entry.type == GGUFValueType.ARRAY:
        item = entry.item_type.name if entry.item_type is not None else "?"
        return f"an array of {entry.count} {item}"
    return f"a {entry.type.name}"


class _Checker:
    def __init__(self, path: Path, header: _Header, vocab_only: bool) -> None:
        self.path = path
        self.h = header
        self.kv = header.kv
        self.vocab_only = vocab_only
        self.notes: list[str] = []
        self.arch = ""
        self.n_vocab: int | None = None
        self.tokenizer: str | None = None
        self.texts: list[bytes] = []
        self.tensor_map = {t.name: t for t in header.tensors}

    # -- helpers ---------------------------------------------------------------------------

    def fail(self, key: str, what: str) -> ModelLoadError:
        return ModelLoadError(str(self.path), f"{key}: {what}")

    def k(self, template: str) -> str:
        return template.format(arch=self.arch)

    def get_int(self, key: str, *, required: bool = False) -> int | None:
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type not in _INT_TYPES:
            raise self.fail(key, f"must be an integer, is {_type_name(entry)}")
        return int(entry.value)

    def get_float(self, key: str, *, required: bool = False) -> float | None:
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type not in _FLOAT_TYPES:
            raise self.fail(key, f"must be a float, is {_type_name(entry)}")
        return float(entry.value)

    def get_str(self, key: str, *, required: bool = False) -> str | None:
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type != GGUFValueType.STRING:
            raise self.fail(key, f"must be a string, is {_type_name(entry)}")
        try:
            return entry.value.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(key, f"not valid UTF-8: {entry.value[:40]!r}") from None

    def get_bool(self, key: str) -> bool | None:
        entry = self.kv.get(key)
        if entry is None:
            return None
        if entry.type != GGUFValueType.BOOL:
            raise self.fail(key, f"must be a bool, is {_type_name(entry)}")
        return bool(entry.value)

    def get_per_layer(self, key: str, n_layer: int, *, required: bool = False) -> list[int] | None:
        """An integer, or an array of one integer per layer (llama.cpp accepts both)."""
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type == GGUFValueType.ARRAY:
            if entry.item_type not in _INT_TYPES:
                raise self.fail(key, f"must be integers, is {_type_name(entry)}")
            if entry.count != n_layer:
                raise self.fail(key, f"has {entry.count} values, one per layer expected ({n_layer})")
            values = [int(v) for v in entry.value]
            if any(v < 0 or v >= 1 << 32 for v in values):
                raise self.fail(key, f"values out of range: {values[:8]}")
            return values
        value = self.get_int(key)
        assert value is not None
        if not 0 <= value < 1 << 32:
            raise self.fail(key, f"{value} is out of range")
        return [value] * n_layer

    # -- run -------------------------------------------------------------------------------

    def run(self) -> GGUFReport:
        arch = self.get_str(Keys.General.ARCHITECTURE, required=True)
        assert arch is not None
        if not arch:
            raise self.fail(Keys.General.ARCHITECTURE, "empty")
        self.arch = arch
        self.check_vocab()
        layout_checked = False
        n_splits = self.get_int(Keys.Split.LLM_KV_SPLIT_COUNT) or 1
        if not self.vocab_only:
            self.check_generic_hparams()
            if n_splits > 1:
                # a split model: this part holds some of the tensors; llama.cpp checks the set
                self.notes.append(f"{Keys.Split.LLM_KV_SPLIT_COUNT}: part of a {n_splits}-file model")
            elif arch in KNOWN_LAYOUTS:
                self.check_layout()
                layout_checked = True
        return GGUFReport(
            path=self.path,
            version=self.h.version,
            architecture=arch,
            n_kv=len(self.kv),
            n_tensors=len(self.h.tensors),
            n_vocab=self.n_vocab,
            tokenizer_model=self.tokenizer,
            layout_checked=layout_checked,
            notes=tuple(self.notes),
        )

    # -- hyper-parameters (every architecture) ----------------------------------------------

    def check_generic_hparams(self) -> None:
        ctx_len = self.get_int(self.k(Keys.LLM.CONTEXT_LENGTH), required=True)
        if ctx_len is not None and not 1 <= ctx_len < 1 << 32:
            raise self.fail(self.k(Keys.LLM.CONTEXT_LENGTH), f"{ctx_len} must be positive")
        n_embd = self.get_int(self.k(Keys.LLM.EMBEDDING_LENGTH), required=True)
        if n_embd is not None and not 1 <= n_embd < 1 << 31:
            raise self.fail(self.k(Keys.LLM.EMBEDDING_LENGTH), f"{n_embd} must be positive")
        n_layer = self.get_int(self.k(Keys.LLM.BLOCK_COUNT), required=True)
        assert n_layer is not None
        if not 1 <= n_layer <= _MAX_LAYERS:
            raise self.fail(
                self.k(Keys.LLM.BLOCK_COUNT), f"{n_layer} layers: llama.cpp needs 1 to {_MAX_LAYERS}"
            )
        nextn = self.get_int(self.k(Keys.LLM.NEXTN_PREDICT_LAYERS))
        if nextn is not None and not 0 <= nextn <= n_layer:
            raise self.fail(self.k(Keys.LLM.NEXTN_PREDICT_LAYERS), f"{nextn} exceeds block_count {n_layer}")

        n_vocab_key = self.get_int(self.k(Keys.LLM.VOCAB_SIZE))
        if n_vocab_key is not None and self.n_vocab is not None and n_vocab_key != self.n_vocab:
            raise self.fail(
                self.k(Keys.LLM.VOCAB_SIZE),
                f"{n_vocab_key} but {Keys.Tokenizer.LIST} holds {self.n_vocab} tokens",
            )

        self.check_experts(n_layer)
        for key in (Keys.LLM.FEED_FORWARD_LENGTH, Keys.Attention.HEAD_COUNT, Keys.Attention.HEAD_COUNT_KV):
            self.get_per_layer(self.k(key), n_layer)

        scaling = self.get_str(self.k(Keys.Rope.SCALING_TYPE))
        known = [t.value for t in RopeScalingType]
        if scaling is not None and scaling not in known:
            raise self.fail(
                self.k(Keys.Rope.SCALING_TYPE), f"unknown RoPE scaling {scaling!r} (known: {known})"
            )

        pooling = self.get_int(self.k(Keys.LLM.POOLING_TYPE))
        if pooling is not None and pooling not in {int(t) for t in PoolingType}:
            raise self.fail(
                self.k(Keys.LLM.POOLING_TYPE),
                f"unknown pooling type {pooling} (known: {[f'{int(t)}={t.name}' for t in PoolingType]})",
            )
        causal = self.kv.get(self.k(Keys.Attention.CAUSAL))
        if causal is not None and causal.type != GGUFValueType.BOOL:
            raise self.fail(self.k(Keys.Attention.CAUSAL), f"must be a bool, is {_type_name(causal)}")

        self.check_floats()

    def check_experts(self, n_layer: int) -> None:
        n_expert = self.get_int(self.k(Keys.LLM.EXPERT_COUNT)) or 0
        if not 0 <= n_expert <= _MAX_EXPERTS:
            raise self.fail(
                self.k(Keys.LLM.EXPERT_COUNT), f"{n_expert} experts: llama.cpp allows 0 to {_MAX_EXPERTS}"
            )
        used = self.get_per_layer(self.k(Keys.LLM.EXPERT_USED_COUNT), n_layer) or [0]
        groups = self.get_int(self.k(Keys.LLM.EXPERT_GROUP_COUNT)) or 0
        group_used = self.get_int(self.k(Keys.LLM.EXPERT_GROUP_USED_COUNT)) or 0
        key_used = self.k(Keys.LLM.EXPERT_USED_COUNT)
        if max(used) > n_expert:
            raise self.fail(key_used, f"{max(used)} experts used per token, but only {n_expert} experts")
        if n_expert > 0:
            if max(used) == 0:
                raise self.fail(key_used, f"missing or 0, with {n_expert} experts")
            key_groups = self.k(Keys.LLM.EXPERT_GROUP_COUNT)
            if not 0 <= groups < n_expert:
                raise self.fail(key_groups, f"{groups} groups for {n_expert} experts")
            if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
                raise self.fail(
                    key_groups,
                    f"{groups} groups of {n_expert} experts with {group_used} used is inconsistent",
                )
        elif groups:
            raise self.fail(self.k(Keys.LLM.EXPERT_GROUP_COUNT), f"{groups} expert groups without experts")

    def check_floats(self) -> None:
        prefix = f"{self.arch}."
        for key, entry in self.kv.items():
            if not key.startswith(prefix):
                continue
            if entry.type in _FLOAT_TYPES:
                if not math.isfinite(entry.value):
                    raise self.fail(key, f"{entry.value:.7g} is not a finite number")
            elif entry.type == GGUFValueType.ARRAY and entry.item_type in _FLOAT_TYPES:
                if not np.isfinite(entry.value).all():
                    raise self.fail(key, "holds values that are not finite numbers")
        for template in (
            Keys.Attention.LAYERNORM_EPS,
            Keys.Attention.LAYERNORM_RMS_EPS,
            Keys.Attention.GROUPNORM_EPS,
            Keys.Rope.FREQ_BASE,
            Keys.Rope.FREQ_BASE_SWA,
        ):
            value = self.get_float(self.k(template))
            if value is not None and not value > 0:
                raise self.fail(self.k(template), f"{value:.7g} must be positive")
        for template in (Keys.Rope.SCALING_FACTOR, Keys.Rope.SCALING_ATTN_FACTOR):
            value = self.get_float(self.k(template))
            if value is not None and value < 0:
                raise self.fail(self.k(template), f"{value:.7g} must not be negative")

    # -- vocabulary --------------------------------------------------------------------------

    def check_vocab(self) -> None:
        key_model = Keys.Tokenizer.MODEL
        model = self.get_str(key_model)
        if model is None:
            if self.arch in _TEXT_ARCHS:
                raise self.fail(key_model, "missing: the file has no tokenizer")
            return  # llama.cpp reports it
        self.tokenizer = model
        kind = _TOKENIZERS.get(model)
        if kind is None:
            raise self.fail(key_model, f"unknown tokenizer {model!r} (known: {sorted(_TOKENIZERS)})")
        if kind == "none":
            if self.arch in _TEXT_ARCHS:
                raise self.fail(key_model, f"{model!r} (no vocabulary), but a {self.arch} model needs one")
            return

        key_list = Keys.Tokenizer.LIST
        tokens = self.kv.get(key_list)
        if tokens is None:
            raise self.fail(key_list, "missing: the vocabulary has no tokens")
        if tokens.type != GGUFValueType.ARRAY or tokens.item_type != GGUFValueType.STRING:
            raise self.fail(key_list, f"must be an array of strings, is {_type_name(tokens)}")
        n = tokens.count
        if n == 0:
            raise self.fail(key_list, "empty vocabulary")
        if n >= 1 << 31:
            raise self.fail(key_list, f"{n} tokens: more than token ids can address")
        self.n_vocab = n
        texts: list[bytes] = tokens.value

        types = self.check_token_types(n)
        # llama.cpp renames an empty text to "[EMPTY_<id>]" (the renamed text must still be
        # unique); a vocabulary of empty texts is no vocabulary.
        n_empty = sum(1 for text in texts if not text)
        if n_empty == n:
            raise self.fail(key_list, f"all {n} token texts are empty")
        if n_empty:
            self.notes.append(f"{key_list}: {n_empty} empty token text(s), renamed [EMPTY_<id>] by llama.cpp")
        seen: dict[bytes, int] = {}
        for i, text in enumerate(texts):
            if not text:
                text = f"[EMPTY_{i}]".encode()
            first = seen.setdefault(text, i)
            if first != i:
                raise self.fail(
                    key_list,
                    f"token {i} {_decode(text)!r} duplicates token {first} (token texts must be unique)",
                )
        self.texts = texts
        self.check_scores(n)
        self.check_special_ids(n)
        for key in (
            Keys.Tokenizer.ADD_BOS,
            Keys.Tokenizer.ADD_EOS,
            Keys.Tokenizer.ADD_SEP,
            Keys.Tokenizer.ADD_PREFIX,
        ):
            self.get_bool(key)
        if kind == "spm":
            self.check_byte_fallback(seen)
        elif kind == "wpm":
            self.check_wordpiece(texts, types)
        elif kind == "bpe":
            self.check_merges(model)
        elif kind == "rwkv":
            self.check_rwkv(texts)

    def check_token_types(self, n: int) -> np.ndarray | None:
        key = Keys.Tokenizer.TOKEN_TYPE
        entry = self.kv.get(key)
        if entry is None:
            return None
        if entry.type != GGUFValueType.ARRAY or entry.item_type != GGUFValueType.INT32:
            raise self.fail(key, f"must be an array of INT32, is {_type_name(entry)}")
        if entry.count != n:
            raise self.fail(key, f"has {entry.count} entries for {n} tokens")
        values = entry.value
        bad = ~np.isin(values, sorted(_TOKEN_TYPES))
        if bad.any():
            i = int(np.argmax(bad))
            raise self.fail(
                key, f"token {i} has type {int(values[i])}, not a token type ({sorted(_TOKEN_TYPES)})"
            )
        return values

    def check_scores(self, n: int) -> None:
        key = Keys.Tokenizer.SCORES
        entry = self.kv.get(key)
        if entry is None:
            return
        if entry.type != GGUFValueType.ARRAY or entry.item_type not in (
            GGUFValueType.FLOAT32,
            GGUFValueType.INT32,
        ):
            raise self.fail(key, f"must be an array of FLOAT32 (or INT32), is {_type_name(entry)}")
        if entry.count != n:
            raise self.fail(key, f"has {entry.count} entries for {n} tokens")
        if entry.item_type == GGUFValueType.FLOAT32 and not np.isfinite(entry.value).all():
            i = int(np.argmax(~np.isfinite(entry.value)))
            raise self.fail(key, f"token {i} has score {entry.value[i]}, not a finite number")

    def check_special_ids(self, n: int) -> None:
        for key in _SPECIAL_ID_KEYS:
            value = self.get_int(key)
            if value is not None and not 0 <= value < n:
                raise self.fail(key, f"token id {value} is out of range [0, {n})")
        count = self.get_int(Keys.Tokenizer.TOKEN_TYPE_COUNT)
        if count is not None and not 0 <= count < 1 << 16:
            raise self.fail(Keys.Tokenizer.TOKEN_TYPE_COUNT, f"{count} is out of range")

    def check_byte_fallback(self, seen: dict[bytes, int]) -> None:
        """SentencePiece falls back on byte tokens for text its pieces cannot cover; llama.cpp
        throws (and the process aborts) when the byte token it looks for does not exist."""
        for b in range(256):
            if f"<0x{b:02X}>".encode() not in seen and bytes([b]) not in seen:
                raise self.fail(
                    Keys.Tokenizer.LIST,
                    f"SentencePiece vocabulary without the byte token <0x{b:02X}> "
                    "(llama.cpp aborts tokenizing text its pieces do not cover)",
                )

    def check_wordpiece(self, texts: list[bytes], types: np.ndarray | None) -> None:
        """A WordPiece vocabulary as llama.cpp stores it: word-start pieces carry the phantom
        space, there are no byte tokens (llama.cpp aborts rendering one with WordPiece, which
        it does for every token while loading), and unknown words map to an UNK token."""
        if types is not None and (types == TokenType.BYTE).any():
            i = int(np.argmax(types == TokenType.BYTE))
            raise self.fail(
                Keys.Tokenizer.MODEL,
                f"'bert' (WordPiece), but token {i} {_decode(texts[i])!r} is a byte token, which "
                "WordPiece does not have (a SentencePiece vocabulary?)",
            )
        marker = _PHANTOM_SPACE.encode()
        if not any(t.startswith(marker) for t in texts):
            raise self.fail(
                Keys.Tokenizer.MODEL,
                "'bert' (WordPiece), but no token starts with the word marker '\u2581': "
                "not a WordPiece vocabulary as llama.cpp stores one",
            )
        if self.get_int(Keys.Tokenizer.UNK_ID) is None:
            raise self.fail(Keys.Tokenizer.UNK_ID, "missing: WordPiece maps unknown words to it")

    def check_rwkv(self, texts: list[bytes]) -> None:
        """RWKV's tokenizer matches the longest token from each position; when the first byte of
        some token is not a token itself, a text starting with that byte and matching no token
        makes llama.cpp loop forever."""
        tokens = {_unescape_rwkv(t) for t in texts}
        first_bytes = {t[:1] for t in tokens if t}
        missing = sorted(b for b in first_bytes if b not in tokens)
        if missing:
            raise self.fail(
                Keys.Tokenizer.LIST,
                f"RWKV vocabulary without the single-byte token {missing[0]!r}, which other tokens "
                "start with (llama.cpp's RWKV tokenizer never ends on such text)",
            )

    def check_merges(self, model: str) -> None:
        key = Keys.Tokenizer.MERGES
        entry = self.kv.get(key)
        if entry is None:
            if self.get_str(Keys.Tokenizer.PRE) == "kimi-k2":
                return
            raise self.fail(key, f"missing: a {model!r} (BPE) tokenizer needs merges")
        if entry.type != GGUFValueType.ARRAY or entry.item_type != GGUFValueType.STRING:
            raise self.fail(key, f"must be an array of strings, is {_type_name(entry)}")
        for i, merge in enumerate(entry.value):
            pos = merge.find(b" ", 1)
            if pos < 0 or pos == len(merge) - 1 or b" " in merge[pos + 1 :]:
                raise self.fail(key, f"merge {i} {_decode(merge)!r} is not two pieces separated by one space")

    # -- tensors -----------------------------------------------------------------------------

    def check_layout(self) -> None:
        arch = self.arch
        n_layer = self.get_int(self.k(Keys.LLM.BLOCK_COUNT))
        n_embd = self.get_int(self.k(Keys.LLM.EMBEDDING_LENGTH))
        assert n_layer is not None and n_embd is not None
        heads = self.get_per_layer(self.k(Keys.Attention.HEAD_COUNT), n_layer, required=True)
        heads_kv = self.get_per_layer(self.k(Keys.Attention.HEAD_COUNT_KV), n_layer) or heads
        n_ff = self.get_per_layer(self.k(Keys.LLM.FEED_FORWARD_LENGTH), n_layer, required=True)
        assert heads is not None and heads_kv is not None and n_ff is not None
        key_heads, key_heads_kv = self.k(Keys.Attention.HEAD_COUNT), self.k(Keys.Attention.HEAD_COUNT_KV)
        key_ff = self.k(Keys.LLM.FEED_FORWARD_LENGTH)
        if self.n_vocab is None:
            raise self.fail(Keys.Tokenizer.LIST, f"missing: a {arch} model needs a vocabulary")
        for il in range(n_layer):
            h, hkv = heads[il], heads_kv[il]
            if h < 1:
                raise self.fail(key_heads, f"layer {il} has {h} attention heads")
            if hkv < 1:
                raise self.fail(key_heads_kv, f"layer {il} has {hkv} key-value heads")
            if h % hkv:
                raise self.fail(key_heads_kv, f"layer {il}: {hkv} key-value heads do not divide {h} heads")
            if n_ff[il] < 1:
                raise self.fail(key_ff, f"layer {il} has a feed-forward length of {n_ff[il]}")
        if len(set(heads)) > 1 or len(set(heads_kv)) > 1:
            raise self.fail(
                key_heads, "per-layer head counts that vary are not supported for this architecture"
            )
        n_head, n_head_kv = heads[0], heads_kv[0]
        head_k = self.get_int(self.k(Keys.Attention.KEY_LENGTH))
        head_v = self.get_int(self.k(Keys.Attention.VALUE_LENGTH))
        if n_embd % n_head and (head_k is None or head_v is None):
            raise self.fail(key_heads, f"{n_head} heads do not divide embedding_length {n_embd}")
        head_k = n_embd // n_head if head_k is None else head_k
        head_v = n_embd // n_head if head_v is None else head_v
        if head_k < 1 or head_v < 1:
            raise self.fail(
                self.k(Keys.Attention.KEY_LENGTH), f"head sizes {head_k}, {head_v} must be positive"
            )
        if head_k != head_v:
            raise self.fail(
                self.k(Keys.Attention.VALUE_LENGTH), f"key length {head_k} and value length {head_v} differ"
            )
        n_rot = self.get_int(self.k(Keys.Rope.DIMENSION_COUNT))
        if arch in LLAMA_LIKE:
            if n_rot is not None and n_rot != head_k:
                raise self.fail(
                    self.k(Keys.Rope.DIMENSION_COUNT), f"{n_rot}, but llama needs the head size {head_k}"
                )
            if head_k % 2:
                raise self.fail(
                    self.k(Keys.Attention.HEAD_COUNT), f"head size {head_k} must be even for RoPE"
                )
            self.get_float(self.k(Keys.Attention.LAYERNORM_RMS_EPS), required=True)
            n_expert = self.get_int(self.k(Keys.LLM.EXPERT_COUNT)) or 0
            expected = self.llama_tensors(n_layer, n_embd, n_head, n_head_kv, head_k, n_ff[0], n_expert)
        else:
            self.get_float(self.k(Keys.Attention.LAYERNORM_EPS), required=True)
            if n_head_kv != n_head:
                raise self.fail(key_heads_kv, f"bert needs as many key-value heads as heads ({n_head})")
            n_types = self.get_int(Keys.Tokenizer.TOKEN_TYPE_COUNT)
            if not n_types:
                raise self.fail(Keys.Tokenizer.TOKEN_TYPE_COUNT, "missing or 0: bert needs token types")
            ctx_len = self.get_int(self.k(Keys.LLM.CONTEXT_LENGTH))
            assert ctx_len is not None
            expected = self.bert_tensors(n_layer, n_embd, head_k * n_head, n_ff[0], n_types, ctx_len)
        self.check_tensors(expected)

    def llama_tensors(
        self, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head: int, n_ff: int, n_expert: int
    ) -> dict[str, tuple[tuple[int, ...], bool]]:
        """Tensor name -> (ggml shape, required), as llama.cpp's llama graph uses them."""
        v = self.n_vocab
        assert v is not None
        q, kv = head * n_head, head * n_head_kv
        out: dict[str, tuple[tuple[int, ...], bool]] = {
            "token_embd.weight": ((n_embd, v), True),
            "output_norm.weight": ((n_embd,), True),
            "output.weight": ((n_embd, v), False),
            "rope_freqs.weight": ((head // 2,), False),
        }
        for i in range(n_layer):
            p = f"blk.{i}."
            out |= {
                p + "attn_norm.weight": ((n_embd,), True),
                p + "attn_output.weight": ((q, n_embd), True),
                p + "attn_output.bias": ((n_embd,), False),
                p + "ffn_norm.weight": ((n_embd,), True),
            }
            if p + "attn_qkv.weight" in self.tensor_map:
                out[p + "attn_qkv.weight"] = ((n_embd, q + 2 * kv), True)
                out[p + "attn_qkv.bias"] = ((q + 2 * kv,), False)
            else:
                for part, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                    out[p + part + ".weight"] = ((n_embd, size), True)
                    out[p + part + ".bias"] = ((size,), False)
            if n_expert == 0:
                out |= {
                    p + "ffn_gate.weight": ((n_embd, n_ff), True),
                    p + "ffn_up.weight": ((n_embd, n_ff), True),
                    p + "ffn_down.weight": ((n_ff, n_embd), True),
                    p + "ffn_gate.bias": ((n_ff,), False),
                    p + "ffn_up.bias": ((n_ff,), False),
                    p + "ffn_down.bias": ((n_embd,), False),
                }
            else:
                out |= {
                    p + "ffn_gate_inp.weight": ((n_embd, n_expert), True),
                    p + "ffn_gate_exps.weight": ((n_embd, n_ff, n_expert), False),
                    p + "ffn_up_exps.weight": ((n_embd, n_ff, n_expert), True),
                    p + "ffn_down_exps.weight": ((n_ff, n_embd, n_expert), True),
                }
        return out

    def bert_tensors(
        self, n_layer: int, n_embd: int, q: int, n_ff: int, n_types: int, ctx_len: int
    ) -> dict[str, tuple[tuple[int, ...], bool]]:
        v = self.n_vocab
        assert v is not None
        out: dict[str, tuple[tuple[int, ...], bool]] = {
            "token_embd.weight": ((n_embd, v), True),
            "token_types.weight": ((n_embd, n_types), False),
            "position_embd.weight": ((n_embd, ctx_len), True),
            "token_embd_norm.weight": ((n_embd,), True),
            "token_embd_norm.bias": ((n_embd,), True),
        }
        for i in range(n_layer):
            p = f"blk.{i}."
            for part in ("attn_q", "attn_k", "attn_v"):
                out[p + part + ".weight"] = ((n_embd, q), True)
                out[p + part + ".bias"] = ((q,), False)
            out |= {
                p + "attn_output.weight": ((q, n_embd), True),
                p + "attn_output.bias": ((n_embd,), False),
                p + "attn_output_norm.weight": ((n_embd,), True),
                p + "attn_output_norm.bias": ((n_embd,), True),
                p + "ffn_up.weight": ((n_embd, n_ff), True),
                p + "ffn_up.bias": ((n_ff,), False),
                p + "ffn_down.weight": ((n_ff, n_embd), True),
                p + "ffn_down.bias": ((n_embd,), False),
                p + "layer_output_norm.weight": ((n_embd,), True),
                p + "layer_output_norm.bias": ((n_embd,), True),
            }
        # -- a reranker's classification head (issue 25): llama.cpp's rank pooling asserts that
        # the pooler (cls) is there when any head is; the classifier (cls.output) is optional.
        if any(name.startswith("cls.") for name in self.tensor_map):
            labels = self.kv.get(self.k("{arch}.classifier.output_labels"))
            n_cls = labels.count if labels is not None and labels.count else 1
            out |= {
                "cls.weight": ((n_embd, n_embd), True),
                "cls.bias": ((n_embd,), True),
                "cls.output.weight": ((n_embd, n_cls), False),
                "cls.output.bias": ((n_cls,), False),
            }
        return out

    def check_tensors(self, expected: dict[str, tuple[tuple[int, ...], bool]]) -> None:
        tensors = self.tensor_map
        for name, (shape, required) in expected.items():
            t = tensors.get(name)
            if t is None:
                if required:
                    raise self.fail(f"tensor {name!r}", f"missing (a {self.arch} model needs it)")
                continue
            if _strip_ones(t.dims) != _strip_ones(shape):
                raise self.fail(
                    f"tensor {name!r}", f"has shape {list(t.dims)}, the hyper-parameters imply {list(shape)}"
                )
            if len(shape) == 1 or name in _ADDED_AS_IS:
                if t.type not in _VECTOR_TYPES:
                    raise self.fail(
                        f"tensor {name!r}",
                        f"type {t.type.name}: llama.cpp needs F32 for norm weights, biases and token types",
                    )
            elif t.type in _NON_WEIGHT_TYPES or t.type in _INTERMEDIATE_TYPES:
                raise self.fail(f"tensor {name!r}", f"type {t.type.name} cannot be a weight matrix")
        unknown = [name for name in tensors if name not in expected]
        if unknown:
            raise self.fail(
                f"tensor {unknown[0]!r}",
                f"not part of a {self.arch} model with these hyper-parameters "
                f"({len(unknown)} unexpected tensor(s))",
            )


def _unescape_rwkv(text: bytes) -> bytes:
    """An RWKV token's bytes: its text with ``\\t``, ``\\n``, ``\\r``, ``\\xNN`` and ``\\<c>`` escapes
    resolved (the RWKV world vocabulary's format)."""
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != 0x5C or i + 1 >= n:  # not a backslash (a trailing one is dropped by llama.cpp)
            if c != 0x5C:
                out.append(c)
            i += 1
            continue
        e = text[i + 1]
        if e == ord("x"):
            digits = text[i + 2 : i + 4]
            value = 0
            for d in digits:  # llama.cpp's lenient hex: a-f, else d - '0' (wrapping to a byte)
                value = ((value << 4) + ((d - 87) if d >= ord("a") else (d - 48))) & 0xFF
            if len(digits) == 2:
                out.append(value)
            i += 2 + len(digits)
            continue
        out.append({ord("t"): 9, ord("n"): 10, ord("r"): 13}.get(e, e))
        i += 2
    return bytes(out)


def _strip_ones(dims: tuple[int, ...]) -> tuple[int, ...]:
    """ggml pads shapes with 1s: (64,) and (64, 1) are the same tensor shape."""
    out = list(dims)
    while len(out) > 1 and out[-1] == 1:
        out.pop()
    return tuple(out)
