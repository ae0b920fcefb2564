"""A sequence's saved state rewritten for another KV layout, so that a context rebuilt with
another layout (``layout_switch.py``) takes the cached prefixes of the one it replaces.

``llama_state_seq_get_data`` writes a sequence's cells for the context's own layout, and
``llama_state_seq_set_data`` refuses another one: the stream count differs between one
unified buffer (1) and a stream per sequence (``n_seq_max``), and V is stored transposed
(one row per embedding dimension) without flash attention, one row per cell with it. The
cells' values are the same either way, so the bytes are rewritten, never recomputed.

The format, as the pinned llama.cpp writes it for one sequence (little-endian): a magic
``u32`` and the source ``seq_id`` (``i32``); then per KV cache (two for sliding-window
models) the stream count (``u32``) and, per stream, its cell count (``u32``) and, when
non-zero, each cell's position (``i32``), ``n_seq_id`` (``u32``, 1 here) and seq id
(``i32``); ``v_trans`` and ``n_layer`` (``u32``); per layer K's type (``i32``), row size
(``u64``) and one row per cell; then per layer V: without ``v_trans`` as K, with it the type
(``i32``), element size (``u32``), embedding size (``u32``) and, per embedding dimension, one
element per cell. Anything that does not parse to the last byte (cells with extra position
data, models whose layers lack V) is refused: ``None``, and the prefix is computed again.

The same rewrite can also leave out the cells before a position (``from_pos``): a state
restored into one unified buffer next to a sequence holding the same prefix (a shared
system prompt) then loads only the cells after it, and takes the prefix's cells by
``seq_cp`` (``KVCache.load_state``), rather than writing the whole state and freeing its
prefix again, which would leave holes that spread the used cells (and so every tick's
attention span) over the buffer.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

__all__ = ["convert_seq_state", "drop_leading_cells"]

_MAGIC = 0xAF143CD8


class _Reader:
    def __init__(self, data: bytes | bytearray) -> None:
        self.data = memoryview(data)  # slices without copies: a state is tens of megabytes
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError("truncated state")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.take(4))[0])

    def i32(self) -> int:
        return int(struct.unpack_from("<i", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.take(8))[0])


def convert_seq_state(data: bytes | bytearray, n_stream: int, v_trans: bool, n_layer: int) -> bytes | None:
    """``data`` (one sequence's state from a context of ``n_layer`` layers) rewritten for a
    context of ``n_stream`` KV streams and V transposed or not (``v_trans``: flash attention
    off); the bytes unchanged when they already match; None when they do not parse."""
    try:
        return _convert(data, n_stream, v_trans, n_layer)
    except (ValueError, struct.error):
        return None


def drop_leading_cells(data: bytes | bytearray, from_pos: int, n_layer: int) -> bytes | None:
    """``data`` (a state of one unified buffer) without its cells at positions below
    ``from_pos``; None when it does not parse or would keep no cell."""
    try:
        return _convert(data, 1, None, n_layer, from_pos)
    except (ValueError, struct.error):
        return None


def _convert(
    data: bytes | bytearray, n_stream: int, v_trans: bool | None, n_layer: int, from_pos: int = 0
) -> bytes:
    if n_stream < 1 or n_layer < 1:
        raise ValueError("n_stream and n_layer must be >= 1")
    reader = _Reader(data)
    if reader.u32() != _MAGIC:
        raise ValueError("not a sequence state")
    out = [data[:8]]
    reader.i32()
    while reader.pos < len(data):
        out.append(_convert_cache(reader, n_stream, v_trans, n_layer, from_pos))
    return b"".join(out)


def _convert_cache(
    reader: _Reader, n_stream: int, v_trans: bool | None, n_layer: int, from_pos: int
) -> bytes:
    """One KV cache's part: its one non-empty stream, placed first of ``n_stream``."""
    streams = reader.u32()
    if streams < 1:
        raise ValueError("no streams")
    body = b""
    n_cells = 0
    for _ in range(streams):
        cells = reader.u32()
        if cells == 0:
            continue
        if body:
            raise ValueError("a sequence in two streams")
        body, n_cells = _convert_stream(reader, cells, v_trans, n_layer, from_pos)
    head = struct.pack("<II", n_stream, n_cells)
    rest = struct.pack("<I", 0) * (n_stream - 1)
    return head + body + rest if n_cells else struct.pack("<I", n_stream) + struct.pack("<I", 0) * n_stream


def _convert_stream(
    reader: _Reader, cells: int, v_trans: bool | None, n_layer: int, from_pos: int
) -> tuple[bytes, int]:
    """One stream's cells rewritten (``v_trans`` None: as they are), with the number kept."""
    meta = reader.take(12 * cells)  # per cell: pos, n_seq (1: one sequence's state), seq_id
    rows = np.frombuffer(meta, "<i4").reshape(cells, 3)
    if (rows[:, 1] != 1).any():
        raise ValueError("a cell of several sequences")  # (the first such row is read right)
    keep = rows[:, 0] >= from_pos if from_pos > 0 else None
    if keep is not None:
        meta = memoryview(rows[keep].tobytes())
        if not len(meta):
            raise ValueError("no cell kept")
    src_trans, layers = reader.u32(), reader.u32()
    if src_trans not in (0, 1) or layers != n_layer:
        raise ValueError("unexpected layer header")
    v_trans = bool(src_trans) if v_trans is None else v_trans
    parts: list[Any] = [meta, struct.pack("<II", int(v_trans), layers)]  # buffers, joined once
    for _ in range(layers):  # K: one row per cell, in every layout
        k_type, row = reader.i32(), reader.u64()
        k = reader.take(row * cells)
        parts += [
            struct.pack("<iQ", k_type, row),
            k if keep is None else np.frombuffer(k, np.uint8).reshape(cells, -1)[keep],
        ]
    for _ in range(layers):
        v_type = reader.i32()
        if src_trans:
            size, n_embd = reader.u32(), reader.u32()
            if size == 0:
                raise ValueError("zero element size")
            raw = reader.take(size * n_embd * cells)
        else:
            row = reader.u64()
            size = _element_size(v_type)
            if size == 0 or row % size:
                raise ValueError("V of a type that cannot be transposed")
            n_embd = row // size
            raw = reader.take(row * cells)
        header = (
            struct.pack("<iII", v_type, size, n_embd)
            if v_trans
            else struct.pack("<iQ", v_type, n_embd * size)
        )
        if keep is None and bool(src_trans) == v_trans:
            parts += [header, raw]
            continue
        values = _elements(raw, size)  # [n_embd][cells] or [cells][n_embd], per element
        if src_trans:
            values = values.reshape(n_embd, cells, -1)
            values = values if keep is None else values[:, keep]
        else:
            values = values.reshape(cells, n_embd, -1)
            values = values if keep is None else values[keep]
        if bool(src_trans) != v_trans:
            values = values.transpose(1, 0, 2)
        parts += [header, np.ascontiguousarray(values)]
    return b"".join(parts), len(meta) // 12


def _elements(data: memoryview, size: int) -> np.ndarray:
    """``data`` as an array of ``size``-byte elements (one integer each where numpy has one of
    that size: its transposes run several times faster than over byte triples)."""
    dtype = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(size)
    if dtype is None:
        return np.frombuffer(data, np.uint8).reshape(-1, size)
    return np.frombuffer(data, dtype).reshape(-1, 1)


def _element_size(ggml_type: int) -> int:
    """Bytes of one element of the unquantized V types (f32, f16, bf16); 0 for others (a
    quantized V cache needs flash attention, so it is never transposed)."""
    return {0: 4, 1: 2, 30: 2}.get(ggml_type, 0)
