"""The vocabulary checks of ``check_gguf``: tokenizer model, token texts, scores and types,
special ids, byte fallback, WordPiece and RWKV vocabularies, BPE merges."""

from __future__ import annotations

import numpy as np
from gguf.constants import GGUFValueType, Keys, TokenType

from llamabatch.gguf.check_base import (
    PHANTOM_SPACE,
    SPECIAL_ID_KEYS,
    TEXT_ARCHS,
    TOKEN_TYPES,
    TOKENIZERS,
    CheckerBase,
)
from llamabatch.gguf.reader import decode_text, type_name


class VocabChecks(CheckerBase):
    """``check_vocab`` and its parts."""

    def check_vocab(self) -> None:
        key_model = Keys.Tokenizer.MODEL
        model = self.get_str(key_model)
        if model is None:
            if self.arch in TEXT_ARCHS:
                raise self.fail(key_model, "missing: the file has no tokenizer")
            return  # llama.cpp reports it
        self.tokenizer = model
        kind = TOKENIZERS.get(model)
        if kind is None:
            raise self.fail(key_model, f"unknown tokenizer {model!r} (known: {sorted(TOKENIZERS)})")
        if kind == "none":
            if self.arch in TEXT_ARCHS:
                raise self.fail(key_model, f"{model!r} (no vocabulary), but a {self.arch} model needs one")
            return

        key_list = Keys.Tokenizer.LIST
        tokens = self.kv.get(key_list)
        if tokens is None:
            raise self.fail(key_list, "missing: the vocabulary has no tokens")
        if tokens.type != GGUFValueType.ARRAY or tokens.item_type != GGUFValueType.STRING:
            raise self.fail(key_list, f"must be an array of strings, is {type_name(tokens)}")
        n = tokens.count
        if n == 0:
            raise self.fail(key_list, "empty vocabulary")
        if n >= 1 << 31:
            raise self.fail(key_list, f"{n} tokens: more than token ids can address")
        self.n_vocab = n
        texts: list[bytes] = tokens.value

        types = self.check_token_types(n)
        # llama.cpp renames an empty text to "[EMPTY_<id>]" (the renamed text must still be
        # unique); a vocabulary of empty texts is no vocabulary.
        n_empty = sum(1 for text in texts if not text)
        if n_empty == n:
            raise self.fail(key_list, f"all {n} token texts are empty")
        if n_empty:
            self.notes.append(f"{key_list}: {n_empty} empty token text(s), renamed [EMPTY_<id>] by llama.cpp")
        seen: dict[bytes, int] = {}
        for i, text in enumerate(texts):
            if not text:
                text = f"[EMPTY_{i}]".encode()
            first = seen.setdefault(text, i)
            if first != i:
                raise self.fail(
                    key_list,
                    f"token {i} {decode_text(text)!r} duplicates token {first} (token texts must be unique)",
                )
        self.texts = texts
        self.check_scores(n)
        self.check_special_ids(n)
        for key in (
            Keys.Tokenizer.ADD_BOS,
            Keys.Tokenizer.ADD_EOS,
            Keys.Tokenizer.ADD_SEP,
            Keys.Tokenizer.ADD_PREFIX,
        ):
            self.get_bool(key)
        if kind == "spm":
            self.check_byte_fallback(seen)
        elif kind == "wpm":
            self.check_wordpiece(texts, types)
        elif kind == "bpe":
            self.check_merges(model)
        elif kind == "rwkv":
            self.check_rwkv(texts)

    def check_token_types(self, n: int) -> np.ndarray | None:
        key = Keys.Tokenizer.TOKEN_TYPE
        entry = self.kv.get(key)
        if entry is None:
            return None
        if entry.type != GGUFValueType.ARRAY or entry.item_type != GGUFValueType.INT32:
            raise self.fail(key, f"must be an array of INT32, is {type_name(entry)}")
        if entry.count != n:
            raise self.fail(key, f"has {entry.count} entries for {n} tokens")
        values = entry.value
        bad = ~np.isin(values, sorted(TOKEN_TYPES))
        if bad.any():
            i = int(np.argmax(bad))
            raise self.fail(
                key, f"token {i} has type {int(values[i])}, not a token type ({sorted(TOKEN_TYPES)})"
            )
        return values

    def check_scores(self, n: int) -> None:
        key = Keys.Tokenizer.SCORES
        entry = self.kv.get(key)
        if entry is None:
            return
        if entry.type != GGUFValueType.ARRAY or entry.item_type not in (
            GGUFValueType.FLOAT32,
            GGUFValueType.INT32,
        ):
            raise self.fail(key, f"must be an array of FLOAT32 (or INT32), is {type_name(entry)}")
        if entry.count != n:
            raise self.fail(key, f"has {entry.count} entries for {n} tokens")
        if entry.item_type == GGUFValueType.FLOAT32 and not np.isfinite(entry.value).all():
            i = int(np.argmax(~np.isfinite(entry.value)))
            raise self.fail(key, f"token {i} has score {entry.value[i]}, not a finite number")

    def check_special_ids(self, n: int) -> None:
        for key in SPECIAL_ID_KEYS:
            value = self.get_int(key)
            if value is not None and not 0 <= value < n:
                raise self.fail(key, f"token id {value} is out of range [0, {n})")
        count = self.get_int(Keys.Tokenizer.TOKEN_TYPE_COUNT)
        if count is not None and not 0 <= count < 1 << 16:
            raise self.fail(Keys.Tokenizer.TOKEN_TYPE_COUNT, f"{count} is out of range")

    def check_byte_fallback(self, seen: dict[bytes, int]) -> None:
        """SentencePiece falls back on byte tokens for text its pieces cannot cover; llama.cpp
        throws (and the process aborts) when the byte token it looks for does not exist."""
        for b in range(256):
            if f"<0x{b:02X}>".encode() not in seen and bytes([b]) not in seen:
                raise self.fail(
                    Keys.Tokenizer.LIST,
                    f"SentencePiece vocabulary without the byte token <0x{b:02X}> "
                    "(llama.cpp aborts tokenizing text its pieces do not cover)",
                )

    def check_wordpiece(self, texts: list[bytes], types: np.ndarray | None) -> None:
        """A WordPiece vocabulary as llama.cpp stores it: word-start pieces carry the phantom
        space, there are no byte tokens (llama.cpp aborts rendering one with WordPiece, which
        it does for every token while loading), and unknown words map to an UNK token."""
        if types is not None and (types == TokenType.BYTE).any():
            i = int(np.argmax(types == TokenType.BYTE))
            raise self.fail(
                Keys.Tokenizer.MODEL,
                f"'bert' (WordPiece), but token {i} {decode_text(texts[i])!r} is a byte token, which "
                "WordPiece does not have (a SentencePiece vocabulary?)",
            )
        marker = PHANTOM_SPACE.encode()
        if not any(t.startswith(marker) for t in texts):
            raise self.fail(
                Keys.Tokenizer.MODEL,
                "'bert' (WordPiece), but no token starts with the word marker '\u2581': "
                "not a WordPiece vocabulary as llama.cpp stores one",
            )
        if self.get_int(Keys.Tokenizer.UNK_ID) is None:
            raise self.fail(Keys.Tokenizer.UNK_ID, "missing: WordPiece maps unknown words to it")

    def check_rwkv(self, texts: list[bytes]) -> None:
        """RWKV's tokenizer matches the longest token from each position; when the first byte of
        some token is not a token itself, a text starting with that byte and matching no token
        makes llama.cpp loop forever."""
        tokens = {_unescape_rwkv(t) for t in texts}
        first_bytes = {t[:1] for t in tokens if t}
        missing = sorted(b for b in first_bytes if b not in tokens)
        if missing:
            raise self.fail(
                Keys.Tokenizer.LIST,
                f"RWKV vocabulary without the single-byte token {missing[0]!r}, which other tokens "
                "start with (llama.cpp's RWKV tokenizer never ends on such text)",
            )

    def check_merges(self, model: str) -> None:
        key = Keys.Tokenizer.MERGES
        entry = self.kv.get(key)
        if entry is None:
            if self.get_str(Keys.Tokenizer.PRE) == "kimi-k2":
                return
            raise self.fail(key, f"missing: a {model!r} (BPE) tokenizer needs merges")
        if entry.type != GGUFValueType.ARRAY or entry.item_type != GGUFValueType.STRING:
            raise self.fail(key, f"must be an array of strings, is {type_name(entry)}")
        for i, merge in enumerate(entry.value):
            pos = merge.find(b" ", 1)
            if pos < 0 or pos == len(merge) - 1 or b" " in merge[pos + 1 :]:
                raise self.fail(
                    key, f"merge {i} {decode_text(merge)!r} is not two pieces separated by one space"
                )


def _unescape_rwkv(text: bytes) -> bytes:
    """An RWKV token's bytes: its text with ``\\t``, ``\\n``, ``\\r``, ``\\xNN`` and ``\\<c>`` escapes
    resolved (the RWKV world vocabulary's format)."""
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != 0x5C or i + 1 >= n:  # not a backslash (a trailing one is dropped by llama.cpp)
            if c != 0x5C:
                out.append(c)
            i += 1
            continue
        e = text[i + 1]
        if e == ord("x"):
            digits = text[i + 2 : i + 4]
            value = 0
            for d in digits:  # llama.cpp's lenient hex: a-f, else d - '0' (wrapping to a byte)
                value = ((value << 4) + ((d - 87) if d >= ord("a") else (d - 48))) & 0xFF
            if len(digits) == 2:
                out.append(value)
            i += 2 + len(digits)
            continue
        out.append({ord("t"): 9, ord("n"): 10, ord("r"): 13}.get(e, e))
        i += 2
    return bytes(out)
