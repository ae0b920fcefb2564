"""How a cross-encoder's (query, document) pair becomes model input, as its tokenizer builds it.

- **The pair.** BERT: ``[CLS] query [SEP] document [SEP]``, the query segment (with its
  ``[SEP]``) of token type 0, the document segment (with the last ``[SEP]``) of type 1.
  XLM-RoBERTa (one token type): ``<s> query </s></s> document </s>``. Over-long pairs are cut
  as Hugging Face's fast tokenizers cut them (``truncation="longest_first"``).
- **The token types.** llama.cpp's BERT graph adds only the first token-type row to every
  token. So the reranker feeds input vectors instead of token ids (``llama_batch.embd``): the
  token's embedding row plus ``type_row[t] - type_row[0]``, to which the graph then adds
  ``type_row[0]``: ``token + type_row[t]``, what transformers computes.

:class:`InputTable` reads the two tables from the GGUF (memory-mapped; rows dequantized as
llama.cpp's row lookup does), after ``gguf.check`` has validated the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from llamabatch.gguf.reader import read_header

__all__ = ["InputTable", "truncate_pair"]


def truncate_pair(n_query: int, n_document: int, budget: int) -> tuple[int, int]:
    """The lengths ``(query, document)`` are cut to so that they fit ``budget`` tokens
    (special tokens excluded), as Hugging Face's ``longest_first`` truncation cuts them: the
    longer segment first, down to an even split when both are long (the document keeps the
    odd token)."""
    if n_query + n_document <= budget:
        return n_query, n_document
    swap = n_query > n_document
    short, long = (n_document, n_query) if swap else (n_query, n_document)
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short = budget // 2
        long = short + budget % 2
    first, second = (long, short) if swap else (short, long)
    return min(first, n_query), min(second, n_document)


class InputTable:
    """Input vectors for token ids and token types, as llama.cpp's BERT graph must receive them.

    ``vectors(ids, types)`` returns float32 ``(n, n_embd)``: ``token_embd[id] + type[t] -
    type[0]`` (the graph adds ``type[0]`` itself).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        header = read_header(path)
        tensors = {t.name: t for t in header.tensors}
        info = tensors.get("token_embd.weight")
        if info is None or len(info.dims) != 2:
            raise ValueError(f"{path.name} has no 2-D token_embd.weight: cannot build input vectors")
        self.n_embd, self.n_vocab = int(info.dims[0]), int(info.dims[1])
        self._tok = self._map(path, header.data_offset, info)
        self._type = int(info.type)
        self._delta = np.zeros((1, self.n_embd), dtype=np.float32)
        types = tensors.get("token_types.weight")
        if types is not None:
            table = self._rows(self._map(path, header.data_offset, types), int(types.type), slice(None))
            table = table.reshape(-1, self.n_embd).astype(np.float64)
            self._delta = (table - table[0]).astype(np.float32)
        self.n_types = int(self._delta.shape[0])

    @staticmethod
    def _map(path: Path, data_offset: int, info: Any) -> np.ndarray:
        offset = data_offset + info.offset
        return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(info.nbytes,))

    def _rows(self, raw: np.ndarray, qtype: int, index: Any) -> np.ndarray:
        """Rows ``index`` of a tensor of ``qtype`` stored in ``raw`` bytes, as float32."""
        import gguf

        kind = gguf.GGMLQuantizationType(qtype)
        if kind == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(-1, self.n_embd)[index].astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(-1, self.n_embd)[index].astype(np.float32)
        if kind == gguf.GGMLQuantizationType.BF16:
            bits = raw.view(np.uint16).reshape(-1, self.n_embd)[index].astype(np.uint32) << 16
            return bits.view(np.float32)
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        row_bytes = self.n_embd // block * type_size
        rows = raw.reshape(-1, row_bytes)[index]
        return gguf.quants.dequantize(np.ascontiguousarray(rows), kind).reshape(-1, self.n_embd)

    def vectors(self, ids: np.ndarray, types: np.ndarray) -> np.ndarray:
        """``(len(ids), n_embd)`` float32 input vectors."""
        out = self._rows(self._tok, self._type, ids)
        if self.n_types > 1:
            out += self._delta[types]
        return out
