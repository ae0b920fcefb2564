"""Byte-level GGUF mutations (``BYTE``): bit flips, truncations, huge counts, lengths and
offsets, on a serialized file and its parsed fields."""

from __future__ import annotations

import random
from collections.abc import Callable

from gguf_editor import Field

# ---------------------------------------------------------------------------------------------
# Byte-level mutations
# ---------------------------------------------------------------------------------------------

ByteMutation = Callable[[bytes, list[Field], random.Random], tuple[bytes, str]]
BYTE: dict[str, ByteMutation] = {}


def byte_mutation(name: str) -> Callable[[ByteMutation], ByteMutation]:
    def register(fn: ByteMutation) -> ByteMutation:
        BYTE[name] = fn
        return fn

    return register


def _header_end(fields: list[Field]) -> int:
    return max(f.offset + f.size for f in fields)


@byte_mutation("bytes.truncate")
def _(data: bytes, fields: list[Field], rng: random.Random) -> tuple[bytes, str]:
    end = _header_end(fields)
    n = rng.choice(
        [0, 3, 4, 8, 23, 24, rng.randrange(24, end), end, rng.randrange(end, len(data)), len(data) - 1]
    )
    return data[:n], f"truncated to {n} of {len(data)} bytes"


@byte_mutation("bytes.bit_flips")
def _(data: bytes, fields: list[Field], rng: random.Random) -> tuple[bytes, str]:
    out = bytearray(data)
    end = _header_end(fields) if rng.random() < 0.8 else len(data)
    n = rng.choice([1, 2, 4, 16, 64])
    for _ in range(n):
        pos = rng.randrange(end)
        out[pos] ^= 1 << rng.randrange(8)
    return bytes(out), f"{n} bit flips in the first {end} bytes"


@byte_mutation("bytes.field")
def _(data: bytes, fields: list[Field], rng: random.Random) -> tuple[bytes, str]:
    f = rng.choice(fields)
    out = bytearray(data)
    old = int.from_bytes(out[f.offset : f.offset + f.size], "little")
    top = (1 << (8 * f.size)) - 1
    value = rng.choice([0, 1, old + 1, old - 1 if old else 1, old * 2, top, top // 2, top // 2 + 1, 1 << 31])
    value &= top
    out[f.offset : f.offset + f.size] = value.to_bytes(f.size, "little")
    return bytes(out), f"{f.label}: {old} -> {value}"


@byte_mutation("bytes.counts")
def _(data: bytes, fields: list[Field], rng: random.Random) -> tuple[bytes, str]:
    f = rng.choice([f for f in fields if f.label in ("tensor count", "key-value count", "version")])
    out = bytearray(data)
    value = rng.choice([0, 1, 2, 3, 4, 2**32 - 1, 2**63, 2**64 - 1, 10**6]) & ((1 << (8 * f.size)) - 1)
    out[f.offset : f.offset + f.size] = value.to_bytes(f.size, "little")
    return bytes(out), f"{f.label} = {value}"


@byte_mutation("bytes.splice")
def _(data: bytes, fields: list[Field], rng: random.Random) -> tuple[bytes, str]:
    end = _header_end(fields)
    a = rng.randrange(end)
    b = min(len(data), a + rng.choice([1, 8, 64, 512]))
    c = rng.randrange(end)
    if rng.random() < 0.5:
        return data[:c] + data[a:b] + data[c:], f"inserted [{a}, {b}) at {c}"
    return data[:a] + data[b:], f"deleted [{a}, {b})"


@byte_mutation("bytes.magic_version")
def _(data: bytes, fields: list[Field], rng: random.Random) -> tuple[bytes, str]:
    choice = rng.choice(
        [b"GGUF\x01\0\0\0", b"GGUF\x02\0\0\0", b"GGUF\x04\0\0\0", b"GGUF\0\0\0\x03", b"GGML\x03\0\0\0"]
    )
    return choice + data[8:], f"header {choice!r}"
