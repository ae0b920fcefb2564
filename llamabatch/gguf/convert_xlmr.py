"""XLM-RoBERTa encoders and cross-encoders (the bge-reranker shape) for :mod:`llamabatch.gguf.convert`.

llama.cpp runs them as architecture ``bert`` with three differences from BERT, which this
module supplies (facts of the format, shared with llama.cpp's own converter; the code is ours):

- **positions** start at ``pad_token_id + 1`` in RoBERTa: the first ``pad_token_id + 1`` rows of
  the position table are dropped and the context length shrinks by as many;
- **the tokenizer** is a SentencePiece Unigram model, llama.cpp's ``t5`` (UGM) tokenizer: pieces
  with their scores, token types, the normalizer's precompiled character map, ``<s>`` / ``</s>``
  added around the text;
- **the head** (``classifier.dense`` + tanh, then ``classifier.out_proj``, on ``<s>``) maps to
  llama.cpp's ``cls`` and ``cls.output`` (see :data:`llamabatch.gguf.convert_head.HEAD_TENSORS`).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MODEL_TYPE", "UnigramVocab", "position_offset", "read_unigram_vocab", "write_unigram_metadata"]

#: ``config.json``'s ``model_type`` of the models this module handles.
MODEL_TYPE = "xlm-roberta"

# gguf.TokenType values
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class UnigramVocab:
    """What the GGUF's ``t5`` tokenizer needs."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    ids: dict[str, int | None]  # bos, eos, unk, pad, mask
    add_space_prefix: bool
    remove_extra_whitespaces: bool
    charsmap: bytes | None


def position_offset(raw_config: dict[str, Any]) -> int:
    """Rows of the position table before position 0 (RoBERTa: ``pad_token_id + 1``)."""
    pad = raw_config.get("pad_token_id")
    return pad + 1 if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else 0


def _find(obj: Any, kind: str) -> dict[str, Any] | None:
    """The first component of ``kind`` in a tokenizer.json normalizer / pre-tokenizer (which may
    be a ``Sequence`` of them)."""
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == kind:
        return obj
    for part in obj.get("normalizers") or obj.get("pretokenizers") or []:
        found = _find(part, kind)
        if found is not None:
            return found
    return None


def read_unigram_vocab(model_dir: Path, n_vocab: int) -> UnigramVocab:
    """The Unigram vocabulary of ``model_dir/tokenizer.json`` (ids in order, padded to ``n_vocab``)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {str(path)!r} (XLM-R models need tokenizer.json)")
    raw = json.loads(path.read_text(encoding="utf-8"))
    model = raw.get("model") or {}
    if model.get("type") != "Unigram":
        raise ValueError(f"unsupported tokenizer model {model.get('type')!r} for xlm-roberta: only Unigram")
    entries = model.get("vocab") or []
    if len(entries) > n_vocab:
        raise ValueError(f"tokenizer.json has {len(entries)} pieces but config.json vocab_size is {n_vocab}")
    pieces = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [_UNUSED] * n_vocab
    for i, (piece, score) in enumerate(entries):
        pieces[i], scores[i], types[i] = str(piece), float(score), _NORMAL
    unk = model.get("unk_id")
    if isinstance(unk, int) and 0 <= unk < n_vocab:
        types[unk] = _UNKNOWN
    for added in raw.get("added_tokens") or []:
        i = int(added["id"])
        if 0 <= i < n_vocab and i != unk:
            pieces[i] = added["content"]
            types[i] = _CONTROL if added.get("special") else _USER_DEFINED
    if len(set(pieces)) != len(pieces):
        raise ValueError("tokenizer.json: duplicate pieces in the Unigram vocabulary")
    index = {p: i for i, p in enumerate(pieces)}
    ids: dict[str, int | None] = {
        name: index.get(text)
        for name, text in (
            ("bos", "<s>"),
            ("eos", "</s>"),
            ("unk", "<unk>"),
            ("pad", "<pad>"),
            ("mask", "<mask>"),
        )
    }
    if ids["bos"] is None or ids["eos"] is None:
        raise ValueError("tokenizer.json: an XLM-R vocabulary needs <s> and </s>")
    precompiled = _find(raw.get("normalizer"), "Precompiled")
    charsmap = base64.b64decode(precompiled["precompiled_charsmap"]) if precompiled else None
    metaspace = _find(raw.get("pre_tokenizer"), "Metaspace") or {}
    add_prefix = metaspace.get("prepend_scheme", "always") != "never" and metaspace.get(
        "add_prefix_space", True
    )
    return UnigramVocab(
        pieces=pieces,
        scores=scores,
        types=types,
        ids=ids,
        add_space_prefix=bool(add_prefix),
        # SentencePiece's default; XLM-R's normalizer collapses runs of spaces
        remove_extra_whitespaces=precompiled is not None,
        charsmap=charsmap or None,
    )


def write_unigram_metadata(writer: Any, vocab: UnigramVocab, type_count: int) -> None:
    """The ``tokenizer.ggml.*`` keys of llama.cpp's ``t5`` (UGM) tokenizer."""
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.pieces)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_token_type_count(type_count)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    writer.add_remove_extra_whitespaces(vocab.remove_extra_whitespaces)
    if vocab.charsmap:
        writer.add_precompiled_charsmap(vocab.charsmap)
    ids = vocab.ids
    writer.add_bos_token_id(ids["bos"])
    writer.add_eos_token_id(ids["eos"])
    writer.add_sep_token_id(ids["eos"])
    for name, add in (("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if ids[name] is not None:
            add(ids[name])
    if ids["mask"] is not None:
        writer.add_mask_token_id(ids["mask"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
