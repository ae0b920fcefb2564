"""The vocabulary half of the BERT converter (:mod:`llamabatch.gguf.convert`): WordPiece tokens as
llama.cpp's WPM tokenizer expects them.

WordPiece in llama.cpp: its WPM tokenizer splits text into words, prefixes each word with the
phantom space ``"\u2581"`` and then matches the longest vocabulary entries from the left. So a
word-start piece ``"play"`` is stored as ``"\u2581play"`` and a continuation piece ``"##ing"`` as
``"ing"``; special and reserved tokens (``[CLS]``, ``[unused0]``) are stored unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__: list[str] = []

_PHANTOM_SPACE = "\u2581"
_CONTINUATION = "##"

# GGUF token types (gguf.TokenType); plain ints so this module imports without gguf.
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_UNUSED = 5


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from exc


@dataclass(frozen=True)
class HFVocab:
    pieces: list[str]
    types: list[int]
    cls_id: int
    sep_id: int
    unk_id: int
    pad_id: int | None
    mask_id: int | None


def _special_token_strings(model_dir: Path) -> dict[str, str]:
    names = {
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "mask_token": "[MASK]",
    }
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):  # the latter wins
        path = model_dir / fname
        if not path.is_file():
            continue
        raw = _load_json(path)
        for key in names:
            value = raw.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value:
                names[key] = value
    return names


def _vocab_tokens(model_dir: Path) -> tuple[list[str], set[str]]:
    """Tokens in id order, and the strings ``tokenizer.json`` marks as special added tokens."""
    special: set[str] = set()
    tok_json = model_dir / "tokenizer.json"
    tok_raw = _load_json(tok_json) if tok_json.is_file() else None
    if tok_raw is not None:
        for added in tok_raw.get("added_tokens", []):
            if added.get("special"):
                special.add(added["content"])
    vocab_txt = model_dir / "vocab.txt"
    if vocab_txt.is_file():
        text = vocab_txt.read_text(encoding="utf-8")
        tokens = text.split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        return [t.rstrip("\r") for t in tokens], special
    if tok_raw is not None:
        model = tok_raw.get("model", {})
        if model.get("type") != "WordPiece":
            raise ValueError(
                f"unsupported tokenizer model {model.get('type')!r}: only WordPiece is supported"
            )
        by_id = {int(i): t for t, i in model.get("vocab", {}).items()}
        for added in tok_raw.get("added_tokens", []):
            by_id.setdefault(int(added["id"]), added["content"])
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"{str(tok_json)!r}: vocabulary ids are not contiguous from 0")
        return [by_id[i] for i in range(len(by_id))], special
    raise FileNotFoundError(
        f"vocabulary not found: neither vocab.txt nor tokenizer.json in {str(model_dir)!r}"
    )


def read_vocab(model_dir: Path, n_vocab: int) -> HFVocab:
    tokens, special = _vocab_tokens(model_dir)
    if len(tokens) > n_vocab:
        raise ValueError(f"vocabulary has {len(tokens)} tokens but config.json vocab_size is {n_vocab}")
    names = _special_token_strings(model_dir)
    special |= set(names.values())
    index = {tok: i for i, tok in enumerate(tokens)}

    def find(key: str, required: bool) -> int | None:
        tok = names[key]
        if tok in index:
            return index[tok]
        if required:
            raise ValueError(f"special token {key} {tok!r} is not in the vocabulary")
        return None

    pieces: list[str] = []
    types: list[int] = []
    for tok in tokens:
        if tok in special:
            pieces.append(tok)
            types.append(_TOKEN_CONTROL)
        elif len(tok) > 2 and tok.startswith("[") and tok.endswith("]"):
            # reserved entries such as [unused17]: the pre-tokenizer splits brackets off, so they
            # can never be produced from text; keep them verbatim and out of the way
            pieces.append(tok)
            types.append(_TOKEN_UNUSED)
        elif tok.startswith(_CONTINUATION) and len(tok) > len(_CONTINUATION):
            pieces.append(tok[len(_CONTINUATION) :])
            types.append(_TOKEN_NORMAL)
        else:
            pieces.append(_PHANTOM_SPACE + tok)
            types.append(_TOKEN_NORMAL)
    # an embedding table larger than the vocabulary (padding rows): fill with unreachable names
    for i in range(len(tokens), n_vocab):
        pieces.append(f"[PAD{i}]")
        types.append(_TOKEN_UNUSED)
    if len(set(pieces)) != len(pieces):
        seen: set[str] = set()
        dups = [p for p in pieces if p in seen or seen.add(p)]  # type: ignore[func-returns-value]
        raise ValueError(f"vocabulary pieces collide after the WordPiece mapping: {dups[:5]}")

    cls_id = find("cls_token", True)
    sep_id = find("sep_token", True)
    unk_id = find("unk_token", True)
    assert cls_id is not None and sep_id is not None and unk_id is not None
    return HFVocab(
        pieces=pieces,
        types=types,
        cls_id=cls_id,
        sep_id=sep_id,
        unk_id=unk_id,
        pad_id=find("pad_token", False),
        mask_id=find("mask_token", False),
    )
