"""The checkers' shared part: the facts they check against and ``CheckerBase`` (typed reads of
the header's key/values, failures naming the key). ``check.py`` runs the checks."""

from __future__ import annotations

from pathlib import Path

from gguf.constants import GGMLQuantizationType, GGUFValueType, Keys, TokenType

from llamabatch.errors import ModelLoadError
from llamabatch.gguf.reader import FLOAT_TYPES, INT_TYPES, Header, type_name

#: llama.cpp's compile-time limits.
MAX_LAYERS = 512
MAX_EXPERTS = 1024

_Q = GGMLQuantizationType
#: Integer and double tensor types: llama.cpp's matrix products and norms do not take them.
NON_WEIGHT_TYPES = frozenset({_Q.I8, _Q.I16, _Q.I32, _Q.I64, _Q.F64})
#: Intermediate quantizations (activations of dot products), never weights.
INTERMEDIATE_TYPES = frozenset({_Q.Q8_1, _Q.Q8_K})
#: Types of 1-D tensors (norm weights, biases) that llama.cpp adds and multiplies by.
VECTOR_TYPES = frozenset({_Q.F32})

#: 2-D tensors whose rows llama.cpp adds to the activations as they are (so F32, like 1-D ones).
ADDED_AS_IS = frozenset({"token_types.weight"})
#: ``tokenizer.ggml.model`` values llama.cpp knows, and the vocabulary type each selects.
TOKENIZERS = {
    "no_vocab": "none",
    "none": "none",
    "llama": "spm",
    "bert": "wpm",
    "gpt2": "bpe",
    "hybriddna": "bpe",
    "whitespace": "bpe",
    "gemma4": "bpe",
    "t5": "ugm",
    "rwkv": "rwkv",
    "plamo2": "plamo2",
    "test": "test",
}
#: Token types: gguf's TokenType plus 0, "undefined" in llama.h.
TOKEN_TYPES = frozenset({0, *(int(t) for t in TokenType)})
#: Keys holding special token ids.
SPECIAL_ID_KEYS = (
    Keys.Tokenizer.BOS_ID,
    Keys.Tokenizer.EOS_ID,
    Keys.Tokenizer.EOT_ID,
    Keys.Tokenizer.EOM_ID,
    Keys.Tokenizer.UNK_ID,
    Keys.Tokenizer.SEP_ID,
    Keys.Tokenizer.PAD_ID,
    Keys.Tokenizer.MASK_ID,
    Keys.Tokenizer.FIM_PRE_ID,
    Keys.Tokenizer.FIM_SUF_ID,
    Keys.Tokenizer.FIM_MID_ID,
    Keys.Tokenizer.FIM_PAD_ID,
    Keys.Tokenizer.FIM_REP_ID,
    Keys.Tokenizer.FIM_SEP_ID,
    Keys.Tokenizer.PREFIX_ID,
    Keys.Tokenizer.SUFFIX_ID,
    Keys.Tokenizer.MIDDLE_ID,
)
#: Architectures whose graph is llama's (same tensors and hyper-parameters).
LLAMA_LIKE = frozenset({"llama"})
#: Architectures whose tensors this module knows.
KNOWN_LAYOUTS = LLAMA_LIKE | {"bert"}
#: Architectures that need text tokenized (a "none" vocabulary cannot serve them).
TEXT_ARCHS = KNOWN_LAYOUTS
#: WordPiece's word-start marker in llama.cpp's WPM vocabularies ("\u2581", as SentencePiece).
PHANTOM_SPACE = "\u2581"


class CheckerBase:
    def __init__(self, path: Path, header: Header, vocab_only: bool) -> None:
        self.path = path
        self.h = header
        self.kv = header.kv
        self.vocab_only = vocab_only
        self.notes: list[str] = []
        self.arch = ""
        self.n_vocab: int | None = None
        self.tokenizer: str | None = None
        self.texts: list[bytes] = []
        self.tensor_map = {t.name: t for t in header.tensors}

    # -- helpers ---------------------------------------------------------------------------

    def fail(self, key: str, what: str) -> ModelLoadError:
        return ModelLoadError(str(self.path), f"{key}: {what}")

    def k(self, template: str) -> str:
        return template.format(arch=self.arch)

    def get_int(self, key: str, *, required: bool = False) -> int | None:
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type not in INT_TYPES:
            raise self.fail(key, f"must be an integer, is {type_name(entry)}")
        return int(entry.value)

    def get_float(self, key: str, *, required: bool = False) -> float | None:
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type not in FLOAT_TYPES:
            raise self.fail(key, f"must be a float, is {type_name(entry)}")
        return float(entry.value)

    def get_str(self, key: str, *, required: bool = False) -> str | None:
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type != GGUFValueType.STRING:
            raise self.fail(key, f"must be a string, is {type_name(entry)}")
        try:
            return entry.value.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(key, f"not valid UTF-8: {entry.value[:40]!r}") from None

    def get_bool(self, key: str) -> bool | None:
        entry = self.kv.get(key)
        if entry is None:
            return None
        if entry.type != GGUFValueType.BOOL:
            raise self.fail(key, f"must be a bool, is {type_name(entry)}")
        return bool(entry.value)

    def get_per_layer(self, key: str, n_layer: int, *, required: bool = False) -> list[int] | None:
        """An integer, or an array of one integer per layer (llama.cpp accepts both)."""
        entry = self.kv.get(key)
        if entry is None:
            if required:
                raise self.fail(key, "missing (required)")
            return None
        if entry.type == GGUFValueType.ARRAY:
            if entry.item_type not in INT_TYPES:
                raise self.fail(key, f"must be integers, is {type_name(entry)}")
            if entry.count != n_layer:
                raise self.fail(key, f"has {entry.count} values, one per layer expected ({n_layer})")
            values = [int(v) for v in entry.value]
            if any(v < 0 or v >= 1 << 32 for v in values):
                raise self.fail(key, f"values out of range: {values[:8]}")
            return values
        value = self.get_int(key)
        assert value is not None
        if not 0 <= value < 1 << 32:
            raise self.fail(key, f"{value} is out of range")
        return [value] * n_layer
