"""Merge one LoRA adapter into its base model's weights: a new GGUF with ``W + s * B @ A``.

The delta is the one llama.cpp adds at run time (facts from its graph code at the pinned
commit): for a base matrix ``W`` (ggml ``[n_in, n_out]``, numpy ``(n_out, n_in)``) with
``lora_a`` (numpy ``(r, n_in)``) and ``lora_b`` (numpy ``(n_out, r)``), the output is
``W x + s * B (A x)`` with ``s = scale * alpha / r`` (``s = scale`` when the adapter has no
``alpha`` or alpha 0), ``r`` being ``lora_b``'s ggml ``ne[0]``. For ``token_embd.weight``
(numpy ``(n_vocab, n_embd)``) the pair is stored the other way round (``lora_a`` numpy
``(n_vocab, r)``, ``lora_b`` numpy ``(n_embd, r)``) and a token's row gains
``s * B @ A[token]``. So the merged weights are ``W + s * B @ A`` and ``E + s * A @ B.T``.

The adapter is checked first (:func:`~llamabatch.gguf.check_lora.check_lora`). The output is
written tensor by tensor, rows in bounded chunks, so memory stays near one chunk whatever the
model's size: the key-value section is copied byte for byte (two ``llamabatch.merged_lora.*``
keys added, so that the merged file never shares an identity with its base: prefix files keyed
on the model stay apart), every tensor the adapter leaves alone is copied as it is, and each
adapted tensor is dequantized (``gguf.quants``), summed with its delta in float32 and written
as F16 (``out_type="f16"``: F16 keeps the dequantized weights within F16 rounding, about 2^-11
relative, so the merged model matches base + adapter closely; it is larger than a 4-bit base)
or re-quantized to the base tensor's type (``out_type="base"``, where ``gguf.quants`` can
quantize that type, else F16: the size of the base, but the quantization grid rounds away a
delta smaller than its step). F32, F16 and BF16 base tensors keep their type either way.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from llamabatch.errors import LoraLoadError, ModelLoadError
from llamabatch.gguf.check_lora import LoraReport, check_lora
from llamabatch.gguf.reader import Header, read_header

__all__ = ["MERGE_FORMAT", "MergeReport", "lora_scale", "merge_lora"]

_Q = GGMLQuantizationType
#: bumped when the merged file's content for the same inputs changes (cache keys include it)
MERGE_FORMAT = 1
#: the key naming the merged adapter's SHA-256 and the key holding the scale it was merged at
ADAPTER_KEY = "llamabatch.merged_lora.adapter_sha256"
SCALE_KEY = "llamabatch.merged_lora.scale"
_FLOAT_TYPES = frozenset({_Q.F32, _Q.F16, _Q.BF16})
_OUT_TYPES = ("f16", "base")
#: float32 values of one chunk of rows (64 MiB)
_CHUNK_VALUES = 1 << 24
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


@dataclass(frozen=True)
class MergeReport:
    """What :func:`merge_lora` wrote."""

    path: Path
    adapter: LoraReport
    #: the factor each delta was multiplied by, per adapted tensor (``scale * alpha / rank``)
    factors: dict[str, float]
    #: adapted tensor -> the type it was written as
    types: dict[str, str]
    nbytes: int


def lora_scale(alpha: float, rank: int, scale: float) -> float:
    """The factor of ``B @ A``: ``scale * alpha / rank``, or ``scale`` when ``alpha`` is 0."""
    return scale * alpha / rank if alpha else scale


def merge_lora(
    base_path: str | os.PathLike[str],
    adapter_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    scale: float = 1.0,
    out_type: str = "f16",
) -> MergeReport:
    """Write ``base_path`` with the adapter ``adapter_path`` merged in (at ``scale``) to
    ``out_path``; the file appears atomically. See the module for the arithmetic and types.

    Raises ``FileNotFoundError``, :class:`~llamabatch.errors.LoraLoadError` naming the adapter
    (a file llama.cpp would refuse, or an adapted ``token_embd.weight`` on a model whose output
    layer shares it), ``ModelLoadError`` for a base model this cannot read, ``ValueError`` for a
    bad ``scale`` or ``out_type``, ``OSError`` (disk full included) while writing.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if out_type not in _OUT_TYPES:
        raise ValueError(f"out_type must be one of {', '.join(_OUT_TYPES)}, got {out_type!r}")
    base_path, adapter_path, out = Path(base_path), Path(adapter_path), Path(out_path)
    base = read_header(base_path)
    report = check_lora(adapter_path, base)
    names = {t.name for t in base.tensors}
    if "token_embd.weight" in report.ranks and "output.weight" not in names:
        raise LoraLoadError(
            str(adapter_path),
            "tensor 'token_embd.weight': the base model's output layer shares the token embeddings, "
            "so merging would change the output layer too (llama.cpp adapts the input side only); "
            "load this adapter unmerged",
        )
    kv_end = _kv_end(base_path, base)
    adapter = read_header(adapter_path)
    pairs = {t.name: t for t in adapter.tensors}
    plan = [_Planned(t.name, t.dims, t.type, t.offset, t.nbytes) for t in base.tensors]
    factors: dict[str, float] = {}
    for item in plan:
        if item.name in report.ranks:
            rank = report.ranks[item.name]
            factors[item.name] = lora_scale(report.alpha, rank, float(scale))
            item.out = _out_type(item.type, out_type)
    offset = 0
    for item in plan:
        item.new_offset = offset
        offset += -(-item.out_nbytes // base.alignment) * base.alignment
    extra = _kv_string(ADAPTER_KEY, _sha256(adapter_path)) + _kv_f32(SCALE_KEY, float(scale))
    infos = b"".join(item.info() for item in plan)
    head_len = 24 + (kv_end - 24) + len(extra) + len(infos)
    data_start = -(-head_len // base.alignment) * base.alignment
    total = data_start + offset
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if total + (1 << 20) > free:
        raise OSError(f"merging needs {total} bytes in {str(out.parent)!r}, only {free} are free")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with base_path.open("rb") as bf, mmap.mmap(bf.fileno(), 0, access=mmap.ACCESS_READ) as bmap, \
                adapter_path.open("rb") as af, mmap.mmap(af.fileno(), 0, access=mmap.ACCESS_READ) as amap, \
                tmp.open("wb") as fh:  # fmt: skip
            n_kv = len(base.kv) + 2
            fh.write(bmap[:8] + struct.pack("<QQ", len(plan), n_kv))
            fh.write(bmap[24:kv_end])
            fh.write(extra + infos)
            fh.write(b"\0" * (data_start - head_len))
            for item in plan:
                start = base.data_offset + item.offset
                if item.name in factors:
                    la, lb = pairs[item.name + ".lora_a"], pairs[item.name + ".lora_b"]
                    a = _matrix(amap, adapter.data_offset + la.offset, la.type, la.dims)
                    b = _matrix(amap, adapter.data_offset + lb.offset, lb.type, lb.dims)
                    for chunk in _merged_rows(bmap, start, item, a, b, factors[item.name]):
                        fh.write(chunk)
                else:
                    _copy(bmap, start, item.nbytes, fh)
                pad = item.padded(base.alignment) - item.out_nbytes
                fh.write(b"\0" * pad)
        if tmp.stat().st_size != total:  # pragma: no cover - a bug in the sizes above
            raise RuntimeError(f"merged file is {tmp.stat().st_size} bytes, expected {total}")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    types = {item.name: item.out.name for item in plan if item.name in factors}
    return MergeReport(out, report, factors, types, total)


class _Planned:
    """One tensor of the output: where it comes from and what it becomes."""

    def __init__(self, name: str, dims: tuple[int, ...], qtype: _Q, offset: int, nbytes: int) -> None:
        self.name, self.dims, self.type, self.offset, self.nbytes = name, dims, qtype, offset, nbytes
        self.out = qtype
        self.new_offset = 0

    @property
    def out_nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.out]
        return math.prod(self.dims) // block * size

    def padded(self, alignment: int) -> int:
        return -(-self.out_nbytes // alignment) * alignment

    def info(self) -> bytes:
        name = self.name.encode()
        dims = struct.pack(f"<I{len(self.dims)}Q", len(self.dims), *self.dims)
        return struct.pack("<Q", len(name)) + name + dims + struct.pack("<IQ", int(self.out), self.new_offset)


def _out_type(base_type: _Q, out_type: str) -> _Q:
    if base_type in _FLOAT_TYPES:
        return base_type
    if out_type == "base" and _can_quantize(base_type):
        return base_type
    return _Q.F16


def _can_quantize(qtype: _Q) -> bool:
    from gguf import quants

    block = GGML_QUANT_SIZES[qtype][0]
    try:
        quants.quantize(np.zeros((1, block), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def _kv_end(path: Path, header: Header) -> int:
    """The file offset where the key-value section ends (the tensor descriptions start),
    from the sizes of the entries the reader parsed; checked against the first tensor's name."""
    pos = 24
    for key, entry in header.kv.items():
        pos += 8 + len(key.encode()) + 4
        if entry.type == GGUFValueType.ARRAY:
            pos += 4 + 8
            if entry.item_type == GGUFValueType.STRING:
                pos += sum(8 + len(item) for item in entry.value)
            elif entry.item_type in _SCALAR_SIZES:
                pos += _SCALAR_SIZES[entry.item_type] * entry.count
            else:
                raise ModelLoadError(str(path), f"{key}: nested arrays are not supported for merging")
        elif entry.type == GGUFValueType.STRING:
            pos += 8 + len(entry.value)
        else:
            pos += _SCALAR_SIZES[entry.type]
    first = header.tensors[0].name.encode() if header.tensors else b""
    with path.open("rb") as fh:
        fh.seek(pos)
        found = fh.read(8 + len(first))
    if first and found != struct.pack("<Q", len(first)) + first:
        raise ModelLoadError(str(path), "cannot locate the tensor descriptions for merging")
    return pos


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", GGUFValueType.STRING, len(v)) + v


def _kv_f32(key: str, value: float) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<If", GGUFValueType.FLOAT32, value)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _rows(buf: mmap.mmap, start: int, qtype: _Q, n_cols: int, row0: int, row1: int) -> np.ndarray:
    """Rows ``row0:row1`` of a 2-D tensor (numpy order) at ``start``, as float32."""
    from gguf import quants

    block, size = GGML_QUANT_SIZES[qtype]
    row_bytes = n_cols // block * size
    raw = np.frombuffer(buf, np.uint8, (row1 - row0) * row_bytes, start + row0 * row_bytes)
    values = np.array(quants.dequantize(raw.reshape(row1 - row0, row_bytes), qtype), dtype=np.float32)
    del raw  # a view of the mapping
    return values


def _matrix(buf: mmap.mmap, start: int, qtype: _Q, dims: tuple[int, ...]) -> np.ndarray:
    """A whole 2-D adapter tensor (numpy order) as float32."""
    return _rows(buf, start, qtype, dims[0], 0, dims[1] if len(dims) > 1 else 1)


def _merged_rows(
    buf: mmap.mmap, start: int, item: _Planned, a: np.ndarray, b: np.ndarray, factor: float
) -> Iterator[bytes]:
    """The adapted tensor's bytes in its output type, a bounded chunk of rows at a time."""
    from gguf import quants

    n_cols, n_rows = item.dims[0], item.dims[1]
    embedding = item.name.endswith("token_embd.weight")
    step = max(1, _CHUNK_VALUES // max(n_cols, 1))
    for row0 in range(0, n_rows, step):
        row1 = min(n_rows, row0 + step)
        w = _rows(buf, start, item.type, n_cols, row0, row1)
        # embeddings: A is (n_vocab, r), B is (n_embd, r); projections: A (r, n_in), B (n_out, r)
        delta = a[row0:row1] @ b.T if embedding else b[row0:row1] @ a
        w += np.float32(factor) * delta
        yield np.ascontiguousarray(quants.quantize(w, item.out)).tobytes()


def _copy(buf: mmap.mmap, start: int, nbytes: int, fh: BinaryIO) -> None:
    for pos in range(start, start + nbytes, 1 << 24):
        fh.write(buf[pos : min(start + nbytes, pos + (1 << 24))])
