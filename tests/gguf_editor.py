"""An editable GGUF for the mutants of ``gguf_mutants.py``: key-value pairs and tensors with
its own serializer, so a mutant can hold what ``gguf.GGUFWriter`` refuses to write (duplicate
tensors, raw invalid types, offsets that overlap)."""

from __future__ import annotations

import copy
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

VT = GGUFValueType
Q = GGMLQuantizationType

# ---------------------------------------------------------------------------------------------
# An editable GGUF
# ---------------------------------------------------------------------------------------------

_FORMATS = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<?",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}


@dataclass
class KV:
    key: str
    type: int  # a GGUFValueType (or any u32, for invalid types)
    value: Any  # scalar, bytes/str for strings, list for arrays
    item_type: int | None = None  # arrays


@dataclass
class Tensor:
    name: str
    dims: list[int]  # ggml order: dims[0] is the row length
    type: int  # a GGMLQuantizationType (or any u32)
    data: bytes
    offset: int | None = None  # None: laid out after the previous tensor
    placed: bool = True  # False: the header points at ``offset``, but no data is written there


@dataclass
class Field:
    """A number in the serialized header that a byte mutant may overwrite."""

    offset: int
    size: int  # 4 or 8
    label: str


def nbytes(dims: list[int], ttype: int) -> int:
    block, size = GGML_QUANT_SIZES[Q(ttype)]
    return math.prod(dims) // block * size


@dataclass
class GGUF:
    kvs: list[KV]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32
    name_override: dict[int, bytes] = field(default_factory=dict)  # tensor index -> raw name

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> GGUF:
        """Read a (well-formed) GGUF with the ``gguf`` package's reader."""
        from gguf import GGUFReader

        reader = GGUFReader(path)
        kvs = []
        for f in reader.fields.values():
            if f.name.startswith("GGUF."):
                continue
            vtype = f.types[0]
            if vtype == VT.ARRAY:
                item = int(f.parts[3][0])
                if item == VT.STRING:
                    value = [bytes(f.parts[i]) for i in f.data]
                else:
                    value = [f.parts[i].tolist()[0] for i in f.data]
                kvs.append(KV(f.name, VT.ARRAY, value, item))
            elif vtype == VT.STRING:
                kvs.append(KV(f.name, vtype, bytes(f.parts[f.data[0]])))
            else:
                kvs.append(KV(f.name, vtype, f.parts[f.data[0]].tolist()[0]))
        tensors = [
            Tensor(t.name, [int(d) for d in t.shape], int(t.tensor_type), t.data.tobytes())
            for t in reader.tensors
        ]
        return cls(kvs, tensors)

    def copy(self) -> GGUF:
        return copy.deepcopy(self)

    # -- editing -------------------------------------------------------------------------

    def get(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def value(self, key: str) -> Any:
        kv = self.get(key)
        return None if kv is None else kv.value

    def set(self, key: str, vtype: int, value: Any, item_type: int | None = None) -> None:
        kv = self.get(key)
        if kv is None:
            self.kvs.append(KV(key, vtype, value, item_type))
        else:
            kv.type, kv.value, kv.item_type = vtype, value, item_type

    def drop(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv.key != key]

    def tensor(self, name: str) -> Tensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def arch(self) -> str:
        value = self.value(Keys.General.ARCHITECTURE)
        return value.decode() if isinstance(value, bytes) else str(value)

    def akey(self, template: str) -> str:
        return template.format(arch=self.arch)

    @property
    def tokens(self) -> list[bytes]:
        return self.value(Keys.Tokenizer.LIST)

    # -- writing -------------------------------------------------------------------------

    def to_bytes(self) -> tuple[bytes, list[Field]]:
        out = bytearray()
        fields: list[Field] = []

        def put(fmt: str, value: Any, label: str | None = None) -> None:
            if label is not None:
                fields.append(Field(len(out), struct.calcsize(fmt), label))
            out.extend(struct.pack(fmt, value))

        def put_str(value: bytes | str, label: str | None = None) -> None:
            raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
            put("<Q", len(raw), label)
            out.extend(raw)

        def put_scalar(vtype: int, value: Any, label: str) -> None:
            if vtype == VT.STRING:
                put_str(value, f"{label} length")
            else:
                put(_FORMATS[VT(vtype)], value)

        out.extend(b"GGUF")
        put("<I", self.version, "version")
        put("<Q", len(self.tensors), "tensor count")
        put("<Q", len(self.kvs), "key-value count")
        for kv in self.kvs:
            put_str(kv.key, f"{kv.key}: key length")
            put("<I", kv.type, f"{kv.key}: type")
            if kv.type == VT.ARRAY:
                assert kv.item_type is not None
                put("<I", kv.item_type, f"{kv.key}: item type")
                put("<Q", len(kv.value), f"{kv.key}: array length")
                for j, item in enumerate(kv.value):
                    label = f"{kv.key}[{j}]" if j < 4 else None
                    if kv.item_type == VT.STRING:
                        put_str(item, label and f"{label} length")
                    else:
                        put(_FORMATS[VT(kv.item_type)], item)
            elif kv.type in VT._value2member_map_:
                put_scalar(kv.type, kv.value, kv.key)
            else:  # an invalid type: some bytes where the value would be
                put("<Q", kv.value)
        offsets = []
        running = 0
        for t in self.tensors:
            offset = running if t.offset is None else t.offset
            offsets.append(offset)
            if t.placed:
                running = max(running, offset + len(t.data))
                running += -running % self.alignment
        for i, t in enumerate(self.tensors):
            put_str(self.name_override.get(i, t.name), f"tensor {t.name}: name length")
            put("<I", len(t.dims), f"tensor {t.name}: n_dims")
            for d, dim in enumerate(t.dims):
                put("<Q", dim, f"tensor {t.name}: dim {d}")
            put("<I", t.type, f"tensor {t.name}: type")
            put("<Q", offsets[i], f"tensor {t.name}: offset")
        out.extend(b"\0" * (-len(out) % self.alignment))
        data_start = len(out)
        for t, offset in zip(self.tensors, offsets, strict=True):
            if not t.placed:
                continue
            end = data_start + offset + len(t.data)
            if end > len(out):
                out.extend(b"\0" * (end - len(out)))
            out[data_start + offset : end] = t.data
        out.extend(b"\0" * (-len(out) % self.alignment))
        return bytes(out), fields
