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
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["convert_seq_state"]

_MAGIC = 0xAF143CD8


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
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


def convert_seq_state(data: bytes, n_stream: int, v_trans: bool, n_layer: int) -> bytes | None:
    """``data`` (one sequence's state from a context of ``n_layer`` layers) rewritten for a
    context of ``n_stream`` KV streams and V transposed or not (``v_trans``: flash attention
    off); the bytes unchanged when they already match; None when they do not parse."""
    try:
        return _convert(data, n_stream, v_trans, n_layer)
    except (ValueError, struct.error):
        return None


def _convert(data: bytes, n_stream: int, v_trans: bool, n_layer: int) -> bytes:
    if n_stream < 1 or n_layer < 1:
        raise ValueError("n_stream and n_layer must be >= 1")
    reader = _Reader(data)
    if reader.u32() != _MAGIC:
        raise ValueError("not a sequence state")
    out = [data[:8]]
    reader.i32()
    while reader.pos < len(data):
        out.append(_convert_cache(reader, n_stream, v_trans, n_layer))
    return b"".join(out)


def _convert_cache(reader: _Reader, n_stream: int, v_trans: bool, n_layer: int) -> bytes:
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
        n_cells = cells
        body = _convert_stream(reader, cells, v_trans, n_layer)
    head = struct.pack("<II", n_stream, n_cells)
    rest = struct.pack("<I", 0) * (n_stream - 1)
    return head + body + rest if n_cells else struct.pack("<I", n_stream) + struct.pack("<I", 0) * n_stream


def _convert_stream(reader: _Reader, cells: int, v_trans: bool, n_layer: int) -> bytes:
    meta = []
    for _ in range(cells):
        pos, n_seq = reader.i32(), reader.u32()
        if n_seq != 1:
            raise ValueError("a cell of several sequences")
        meta.append(struct.pack("<iIi", pos, n_seq, reader.i32()))
    src_trans, layers = reader.u32(), reader.u32()
    if src_trans not in (0, 1) or layers != n_layer:
        raise ValueError("unexpected layer header")
    parts = [b"".join(meta), struct.pack("<II", int(v_trans), layers)]
    for _ in range(layers):  # K: one row per cell, in every layout
        k_type, row = reader.i32(), reader.u64()
        parts.append(struct.pack("<iQ", k_type, row) + reader.take(row * cells))
    for _ in range(layers):
        v_type = reader.i32()
        if src_trans:
            size, n_embd = reader.u32(), reader.u32()
            if size == 0:
                raise ValueError("zero element size")
            values = np.frombuffer(reader.take(size * n_embd * cells), np.uint8).reshape(n_embd, cells, size)
        else:
            row = reader.u64()
            size = _element_size(v_type)
            if size == 0 or row % size:
                raise ValueError("V of a type that cannot be transposed")
            n_embd = row // size
            values = np.frombuffer(reader.take(row * cells), np.uint8).reshape(cells, n_embd, size)
        if bool(src_trans) == v_trans:
            header = (
                struct.pack("<iII", v_type, size, n_embd)
                if v_trans
                else struct.pack("<iQ", v_type, n_embd * size)
            )
            parts.append(header + values.tobytes())
        elif v_trans:
            parts.append(struct.pack("<iII", v_type, size, n_embd) + values.transpose(1, 0, 2).tobytes())
        else:
            parts.append(struct.pack("<iQ", v_type, n_embd * size) + values.transpose(1, 0, 2).tobytes())
    return b"".join(parts)


def _element_size(ggml_type: int) -> int:
    """Bytes of one element of the unquantized V types (f32, f16, bf16); 0 for others (a
    quantized V cache needs flash attention, so it is never transposed)."""
    return {0: 4, 1: 2, 30: 2}.get(ggml_type, 0)
