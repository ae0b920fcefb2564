"""KV cache element types (``type_k`` / ``type_v``, llama.cpp's ``-ctk`` / ``-ctv``): their
names, ggml enum values and sizes, the bytes a model's KV cache takes per token, and the
combinations llama.cpp cannot run, refused with a ``ValueError`` before it sees them.

Facts from ggml (``ggml.h``'s ``enum ggml_type``, ``ggml.c``'s type traits): a quantized type
stores blocks of 32 values; q8_0 takes 34 bytes a block, q4_0 and iq4_nl 18, q4_1 20, q5_0
22, q5_1 24.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamabatch._ffi import lib

if TYPE_CHECKING:
    from llamabatch._ffi.model import Model

__all__ = ["KV_TYPES", "KVType", "check_kv_types", "kv_bytes_per_cell", "kv_type"]


@dataclass(frozen=True)
class KVType:
    """One KV cache element type: its llama.cpp name, ggml enum value and block size."""

    name: str
    ggml_type: int
    block_elems: int
    block_bytes: int

    @property
    def quantized(self) -> bool:
        return self.block_elems > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of ``n`` values (``n`` a multiple of the block size)."""
        return n // self.block_elems * self.block_bytes


#: the types llama.cpp's server accepts for ``-ctk`` / ``-ctv``, by name (as llama.cpp spells them)
KV_TYPES: dict[str, KVType] = {
    t.name: t
    for t in (
        KVType("f32", lib.GGML_TYPE_F32, 1, 4),
        KVType("f16", lib.GGML_TYPE_F16, 1, 2),
        KVType("bf16", lib.GGML_TYPE_BF16, 1, 2),
        KVType("q8_0", lib.GGML_TYPE_Q8_0, 32, 34),
        KVType("q4_0", lib.GGML_TYPE_Q4_0, 32, 18),
        KVType("q4_1", lib.GGML_TYPE_Q4_1, 32, 20),
        KVType("iq4_nl", lib.GGML_TYPE_IQ4_NL, 32, 18),
        KVType("q5_0", lib.GGML_TYPE_Q5_0, 32, 22),
        KVType("q5_1", lib.GGML_TYPE_Q5_1, 32, 24),
    )
}


def kv_type(field: str, name: object) -> KVType:
    """The type called ``name``; ``ValueError`` naming ``field`` and the choices otherwise."""
    if isinstance(name, str) and name.lower() in KV_TYPES:
        return KV_TYPES[name.lower()]
    raise ValueError(f"{field} must be one of {', '.join(KV_TYPES)}, got {name!r}")


def head_dims(model: Model) -> tuple[int, int]:
    """The K and V head sizes (GGUF ``attention.key_length`` / ``value_length``, else
    ``n_embd / n_head``)."""
    default = model.n_embd // model.n_head if model.n_head else 0

    def length(name: str) -> int:
        value = model.meta(f"{model.architecture}.attention.{name}")
        return int(value) if value is not None and value.isdigit() else default

    return length("key_length"), length("value_length")


def kv_bytes_per_cell(model: Model, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes one KV cell (one token of one sequence) takes over all layers: ``n_layer x
    n_head_kv x (head_k x size(type_k) + head_v x size(type_v))``. An upper bound for models
    whose layers differ (sliding-window layers keep fewer cells; recurrent models none)."""
    head_k, head_v = head_dims(model)
    k, v = kv_type("type_k", type_k), kv_type("type_v", type_v)
    n_head_kv = model.n_head_kv or model.n_head
    return model.n_layer * n_head_kv * (k.row_bytes(head_k) + v.row_bytes(head_v))


def check_kv_types(model: Model, type_k: object, type_v: object, flash_attn: object) -> tuple[int, int]:
    """The ggml enum values of ``type_k`` / ``type_v`` for ``model``, or a ``ValueError``
    for what llama.cpp cannot run:

    - a quantized V cache without flash attention (``flash_attn=False``): llama.cpp keeps
      V transposed then, which quantized blocks cannot be;
    - a quantized type whose blocks (32 values) do not divide the model's head size:
      ggml asserts (aborts the process) on such rows.
    """
    k, v = kv_type("type_k", type_k), kv_type("type_v", type_v)
    if v.quantized and flash_attn is False:
        raise ValueError(
            f"type_v={v.name}: a quantized V cache needs flash attention (flash_attn=False was "
            "given; use flash_attn=None/'auto' or True, or a type_v of f16, bf16 or f32)"
        )
    head_k, head_v = head_dims(model)
    for field, t, head in (("type_k", k, head_k), ("type_v", v, head_v)):
        if t.quantized and head % t.block_elems:
            raise ValueError(
                f"{field}={t.name}: the model's {field[-1].upper()} head size ({head}) is not a "
                f"multiple of {t.name}'s block of {t.block_elems} values"
            )
    return k.ggml_type, v.ggml_type
