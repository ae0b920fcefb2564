"""``EmbdBatch``: a preallocated ``llama_batch`` that carries input embeddings, not token ids.

llama.cpp computes a batch either from token ids (``batch.token``) or from input vectors
(``batch.embd``: ``n_tokens * n_embd`` floats, ``batch.token`` NULL), which its graphs take
in place of the token-embedding lookup. The reranker uses it to give a BERT cross-encoder's
second segment its own token-type row (:mod:`llamabatch.reranker`).

The arrays are allocated once (cffi owns them) and reused; ``address`` is what
``Context.encode_address`` / ``decode_address`` take.

An M-RoPE model (Qwen-VL) reads ``n_pos_per_embd`` position values per vector of an
embedding batch, section-major: ``pos[j * n_tokens + i]`` is section ``j`` of entry ``i``,
the stride being the batch's current ``n_tokens``; so every ``add`` lays the sections out anew.
"""

from __future__ import annotations

import numpy as np

from llamabatch._ffi import ffi

__all__ = ["EmbdBatch"]


class EmbdBatch:
    """One ``llama_batch`` of up to ``capacity`` input vectors of ``n_embd`` floats, each
    with ``n_pos_per_embd`` position values (4 for an M-RoPE model); every entry belongs to
    one sequence and is an output."""

    def __init__(self, capacity: int, n_embd: int, n_pos_per_embd: int = 1) -> None:
        if capacity < 1 or n_embd < 1 or n_pos_per_embd < 1:
            raise ValueError("capacity, n_embd and n_pos_per_embd must be >= 1")
        self.capacity = capacity
        self.n_embd = n_embd
        self.n_pos_per_embd = n_pos_per_embd
        self._struct = ffi.new("llama_batch *")
        self._embd = ffi.new("float[]", capacity * n_embd)
        self._pos = ffi.new("int32_t[]", capacity * n_pos_per_embd)
        self._n_seq_id = ffi.new("int32_t[]", capacity)
        self._seq_storage = ffi.new("int32_t[]", capacity)
        self._seq_id = ffi.new("int32_t *[]", capacity + 1)
        self._logits = ffi.new("int8_t[]", capacity)
        for i in range(capacity):
            self._seq_id[i] = self._seq_storage + i
        self._seq_id[capacity] = ffi.NULL
        b = self._struct
        b.n_tokens = 0
        b.token = ffi.NULL
        b.embd = self._embd
        b.pos = self._pos
        b.n_seq_id = self._n_seq_id
        b.seq_id = self._seq_id
        b.logits = self._logits
        # numpy views over the C arrays (written in place)
        self.embd = np.frombuffer(ffi.buffer(self._embd), dtype=np.float32).reshape(capacity, n_embd)
        self.pos = np.frombuffer(ffi.buffer(self._pos), dtype=np.int32)
        #: every entry's position values, entry-major (laid out section-major into ``pos``)
        self._sections = np.zeros((n_pos_per_embd, capacity), dtype=np.int32)
        self.seq = np.frombuffer(ffi.buffer(self._seq_storage), dtype=np.int32)
        np.frombuffer(ffi.buffer(self._n_seq_id), dtype=np.int32)[:] = 1
        self._logits_view = np.frombuffer(ffi.buffer(self._logits), dtype=np.int8)
        self._logits_view[:] = 1

    @property
    def address(self) -> int:
        """The address of the ``llama_batch`` struct."""
        return int(ffi.cast("uintptr_t", self._struct))

    @property
    def n_tokens(self) -> int:
        return int(self._struct.n_tokens)

    def clear(self) -> None:
        """Empty the batch."""
        self._struct.n_tokens = 0

    def add(
        self,
        vectors: np.ndarray,
        seq_id: int,
        pos0: int = 0,
        outputs: bool = True,
        positions: np.ndarray | None = None,
    ) -> None:
        """Append one sequence: ``vectors`` ``(n, n_embd)`` at positions ``pos0..pos0+n-1``,
        or at ``positions`` ``(n_pos_per_embd, n)`` (required when ``n_pos_per_embd`` > 1);
        ``outputs`` False: no output rows for them (an image's embeddings computed into the
        KV cache only)."""
        n = int(vectors.shape[0])
        start = self.n_tokens
        if start + n > self.capacity:
            raise ValueError(f"batch is full (capacity {self.capacity})")
        if positions is None:
            if self.n_pos_per_embd > 1:
                raise ValueError(f"this batch takes {self.n_pos_per_embd} position values per vector")
            self._sections[0, start : start + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        else:
            if positions.shape != (self.n_pos_per_embd, n):
                raise ValueError(f"positions must be ({self.n_pos_per_embd}, {n}), not {positions.shape}")
            self._sections[:, start : start + n] = positions
        end = start + n
        self.pos[: self.n_pos_per_embd * end] = self._sections[:, :end].ravel()
        self.embd[start : start + n] = vectors
        self.seq[start : start + n] = seq_id
        self._logits_view[start : start + n] = 1 if outputs else 0
        self._struct.n_tokens = start + n
