"""Deterministic GGUF mutants, and a subprocess harness that loads, tokenizes and runs each one.

Used by ``tests/gguf/test_fuzz_gguf.py`` and ``tests/gguf/test_gguf_check.py``.

* :class:`GGUF` is an editable GGUF (key-value pairs and tensors) with its own serializer, so a
  mutant can hold what ``gguf.GGUFWriter`` refuses to write (duplicate tensors, raw invalid
  types, offsets that overlap).
* Two bases: a micro Llama written by ``llamabatch.gguf.testing`` (and the project's ``tiny`` preset)
  and a micro BERT written by ``llamabatch.gguf.convert`` from a random-weight Hugging Face directory.
* :data:`SEMANTIC` lists the mutation classes of files that parse but are wrong (vocabulary,
  hyper-parameters, architecture, tensors); :data:`BYTE` the byte-level ones (bit flips,
  truncations, huge counts, lengths and offsets). :func:`generate` draws ``n`` mutants,
  round-robin over the classes, each from a seeded ``random.Random``: the same arguments give
  the same files.
* :func:`run_mutants` runs them in a child process (``python gguf_mutants.py --child``), many
  per child: load the model, tokenize, detokenize, then generate a few tokens (decoders, with
  ``LLM``) or embed (encoders, with ``Embedder``). A child that dies by a signal or aborts is a
  *crash*, one that exceeds the timeout a *hang*; the harness restarts the child and goes on.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

VT = GGUFValueType
Q = GGMLQuantizationType

# ---------------------------------------------------------------------------------------------
# An editable GGUF
# ---------------------------------------------------------------------------------------------

_FORMATS = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<?",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}


@dataclass
class KV:
    key: str
    type: int  # a GGUFValueType (or any u32, for invalid types)
    value: Any  # scalar, bytes/str for strings, list for arrays
    item_type: int | None = None  # arrays


@dataclass
class Tensor:
    name: str
    dims: list[int]  # ggml order: dims[0] is the row length
    type: int  # a GGMLQuantizationType (or any u32)
    data: bytes
    offset: int | None = None  # None: laid out after the previous tensor
    placed: bool = True  # False: the header points at ``offset``, but no data is written there


@dataclass
class Field:
    """A number in the serialized header that a byte mutant may overwrite."""

    offset: int
    size: int  # 4 or 8
    label: str


def _nbytes(dims: list[int], ttype: int) -> int:
    block, size = GGML_QUANT_SIZES[Q(ttype)]
    return math.prod(dims) // block * size


@dataclass
class GGUF:
    kvs: list[KV]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32
    name_override: dict[int, bytes] = field(default_factory=dict)  # tensor index -> raw name

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> GGUF:
        """Read a (well-formed) GGUF with the ``gguf`` package's reader."""
        from gguf import GGUFReader

        reader = GGUFReader(path)
        kvs = []
        for f in reader.fields.values():
            if f.name.startswith("GGUF."):
                continue
            vtype = f.types[0]
            if vtype == VT.ARRAY:
                item = int(f.parts[3][0])
                if item == VT.STRING:
                    value = [bytes(f.parts[i]) for i in f.data]
                else:
                    value = [f.parts[i].tolist()[0] for i in f.data]
                kvs.append(KV(f.name, VT.ARRAY, value, item))
            elif vtype == VT.STRING:
                kvs.append(KV(f.name, vtype, bytes(f.parts[f.data[0]])))
            else:
                kvs.append(KV(f.name, vtype, f.parts[f.data[0]].tolist()[0]))
        tensors = [
            Tensor(t.name, [int(d) for d in t.shape], int(t.tensor_type), t.data.tobytes())
            for t in reader.tensors
        ]
        return cls(kvs, tensors)

    def copy(self) -> GGUF:
        return copy.deepcopy(self)

    # -- editing -------------------------------------------------------------------------

    def get(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def value(self, key: str) -> Any:
        kv = self.get(key)
        return None if kv is None else kv.value

    def set(self, key: str, vtype: int, value: Any, item_type: int | None = None) -> None:
        kv = self.get(key)
        if kv is None:
            self.kvs.append(KV(key, vtype, value, item_type))
        else:
            kv.type, kv.value, kv.item_type = vtype, value, item_type

    def drop(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv.key != key]

    def tensor(self, name: str) -> Tensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def arch(self) -> str:
        value = self.value(Keys.General.ARCHITECTURE)
        return value.decode() if isinstance(value, bytes) else str(value)

    def akey(self, template: str) -> str:
        return template.format(arch=self.arch)

    @property
    def tokens(self) -> list[bytes]:
        return self.value(Keys.Tokenizer.LIST)

    # -- writing -------------------------------------------------------------------------

    def to_bytes(self) -> tuple[bytes, list[Field]]:
        out = bytearray()
        fields: list[Field] = []

        def put(fmt: str, value: Any, label: str | None = None) -> None:
            if label is not None:
                fields.append(Field(len(out), struct.calcsize(fmt), label))
            out.extend(struct.pack(fmt, value))

        def put_str(value: bytes | str, label: str | None = None) -> None:
            raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
            put("<Q", len(raw), label)
            out.extend(raw)

        def put_scalar(vtype: int, value: Any, label: str) -> None:
            if vtype == VT.STRING:
                put_str(value, f"{label} length")
            else:
                put(_FORMATS[VT(vtype)], value)

        out.extend(b"GGUF")
        put("<I", self.version, "version")
        put("<Q", len(self.tensors), "tensor count")
        put("<Q", len(self.kvs), "key-value count")
        for kv in self.kvs:
            put_str(kv.key, f"{kv.key}: key length")
            put("<I", kv.type, f"{kv.key}: type")
            if kv.type == VT.ARRAY:
                assert kv.item_type is not None
                put("<I", kv.item_type, f"{kv.key}: item type")
                put("<Q", len(kv.value), f"{kv.key}: array length")
                for j, item in enumerate(kv.value):
                    label = f"{kv.key}[{j}]" if j < 4 else None
                    if kv.item_type == VT.STRING:
                        put_str(item, label and f"{label} length")
                    else:
                        put(_FORMATS[VT(kv.item_type)], item)
            elif kv.type in VT._value2member_map_:
                put_scalar(kv.type, kv.value, kv.key)
            else:  # an invalid type: some bytes where the value would be
                put("<Q", kv.value)
        offsets = []
        running = 0
        for t in self.tensors:
            offset = running if t.offset is None else t.offset
            offsets.append(offset)
            if t.placed:
                running = max(running, offset + len(t.data))
                running += -running % self.alignment
        for i, t in enumerate(self.tensors):
            put_str(self.name_override.get(i, t.name), f"tensor {t.name}: name length")
            put("<I", len(t.dims), f"tensor {t.name}: n_dims")
            for d, dim in enumerate(t.dims):
                put("<Q", dim, f"tensor {t.name}: dim {d}")
            put("<I", t.type, f"tensor {t.name}: type")
            put("<Q", offsets[i], f"tensor {t.name}: offset")
        out.extend(b"\0" * (-len(out) % self.alignment))
        data_start = len(out)
        for t, offset in zip(self.tensors, offsets, strict=True):
            if not t.placed:
                continue
            end = data_start + offset + len(t.data)
            if end > len(out):
                out.extend(b"\0" * (end - len(out)))
            out[data_start + offset : end] = t.data
        out.extend(b"\0" * (-len(out) % self.alignment))
        return bytes(out), fields


# ---------------------------------------------------------------------------------------------
# Bases
# ---------------------------------------------------------------------------------------------


def _micro_llama_spec():
    from llamabatch.gguf.testing import ModelSpec

    return ModelSpec(
        n_vocab=320, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=64, n_ctx_train=256, name="fuzz-llama"
    )


_BERT_WORDS = (
    "the of and to in is it for on with as this that be are was model file text hello world "
    "word words token tokens test tests run runs embed embedding vector sentence data value"
).split()


def write_micro_bert(directory: Path) -> Path:
    """A random-weight BERT written by ``llamabatch.gguf.convert`` (what ``llamabatch convert`` writes)."""
    from safetensors.numpy import save_file

    from llamabatch.gguf.convert import convert_bert

    src = directory / "bert-src"
    src.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-")
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab += [*_BERT_WORDS, "##ing", "##ed"]
    (src / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    d, ff, n_layer, n_pos = 32, 64, 2, 64
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": len(vocab),
        "hidden_size": d,
        "intermediate_size": ff,
        "num_hidden_layers": n_layer,
        "num_attention_heads": 4,
        "max_position_embeddings": n_pos,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
    }
    (src / "config.json").write_text(json.dumps(config), encoding="utf-8")
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    weights = {
        "embeddings.word_embeddings.weight": w(len(vocab), d),
        "embeddings.position_embeddings.weight": w(n_pos, d),
        "embeddings.token_type_embeddings.weight": w(2, d),
        "embeddings.LayerNorm.weight": np.ones(d, np.float32),
        "embeddings.LayerNorm.bias": np.zeros(d, np.float32),
    }
    for i in range(n_layer):
        p = f"encoder.layer.{i}."
        for part in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
        ):
            weights[p + part + ".weight"] = w(d, d)
            weights[p + part + ".bias"] = w(d)
        weights[p + "intermediate.dense.weight"] = w(ff, d)
        weights[p + "intermediate.dense.bias"] = w(ff)
        weights[p + "output.dense.weight"] = w(d, ff)
        weights[p + "output.dense.bias"] = w(d)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            weights[p + norm + ".weight"] = np.ones(d, np.float32)
            weights[p + norm + ".bias"] = np.zeros(d, np.float32)
    save_file(weights, str(src / "model.safetensors"))
    return convert_bert(src, directory / "fuzz-bert.gguf", dtype="f32", name="fuzz-bert")


def _byte_chars() -> list[str]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte (printable Latin-1
    bytes stand for themselves, the others for code points from 256 on)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_micro_bpe(directory: Path, llama: Path) -> Path:
    """The micro Llama with a byte-level BPE vocabulary (``gpt2``, as Llama 3 has): 256 byte
    tokens, merged pieces, then control tokens up to the micro Llama's 320, so the tensors keep
    their shapes."""
    g = GGUF.read(llama)
    chars = _byte_chars()
    space = chars[ord(" ")]
    tokens = list(chars)
    merges: list[str] = []
    for word in (
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "it",
        "for",
        "on",
        "as",
        "model",
        "file",
        "test",
        "text",
    ):
        pieces = [space, *word]
        while len(pieces) > 1 and len(tokens) < 318:
            left, right = pieces[0], pieces[1]
            merges.append(f"{left} {right}")
            if left + right not in tokens:
                tokens.append(left + right)
            pieces = [left + right, *pieces[2:]]
    tokens = tokens[:318]
    n_normal = len(tokens)
    tokens += ["<|begin_of_text|>", "<|end_of_text|>"]
    tokens += [f"<|reserved_{i}|>" for i in range(320 - len(tokens))]
    types = [1] * n_normal + [3] * (len(tokens) - n_normal)
    g.set(Keys.Tokenizer.MODEL, VT.STRING, b"gpt2")
    g.set(Keys.Tokenizer.PRE, VT.STRING, b"llama3")
    g.set(Keys.Tokenizer.LIST, VT.ARRAY, [t.encode() for t in tokens], VT.STRING)
    g.set(Keys.Tokenizer.TOKEN_TYPE, VT.ARRAY, types, VT.INT32)
    g.set(
        Keys.Tokenizer.MERGES,
        VT.ARRAY,
        [m.encode() for m in merges if all(p in tokens for p in m.split(" "))],
        VT.STRING,
    )
    g.drop(Keys.Tokenizer.SCORES)
    g.drop(Keys.Tokenizer.UNK_ID)
    g.drop(Keys.Tokenizer.ADD_PREFIX)
    g.set(Keys.Tokenizer.BOS_ID, VT.UINT32, n_normal)
    g.set(Keys.Tokenizer.EOS_ID, VT.UINT32, n_normal + 1)
    g.set(Keys.Tokenizer.EOT_ID, VT.UINT32, n_normal + 1)
    g.drop(Keys.Tokenizer.CHAT_TEMPLATE)
    path = directory / "fuzz-bpe.gguf"
    path.write_bytes(g.to_bytes()[0])
    return path


def write_bases(directory: Path) -> dict[str, Path]:
    """The base files: ``llama`` (micro), ``bpe`` (the micro Llama with a byte-level BPE
    vocabulary), ``tiny`` (the project's preset) and ``bert`` (micro)."""
    from llamabatch.gguf.testing import model_path, write_llama_gguf

    directory.mkdir(parents=True, exist_ok=True)
    llama = write_llama_gguf(directory / "fuzz-llama.gguf", _micro_llama_spec())
    return {
        "llama": llama,
        "bpe": write_micro_bpe(directory, llama),
        "tiny": model_path("tiny"),
        "bert": write_micro_bert(directory),
    }


# ---------------------------------------------------------------------------------------------
# Semantic mutations
# ---------------------------------------------------------------------------------------------


class NotApplicable(Exception):
    """The mutation does not apply to this base."""


Mutation = Callable[[GGUF, random.Random], str]  # edits the GGUF in place, returns a description

SEMANTIC: dict[str, Mutation] = {}
#: Classes from the issue (each has a fixed regression test too).
ISSUE_CLASSES = (
    "vocab.duplicate_text",
    "hparams.block_count",
    "hparams.norm_epsilon",
    "vocab.tokenizer_model",
    "vocab.all_empty",
)

_HUGE_U32 = (2**31 - 1, 2**31, 2**32 - 1)
_SPECIAL_KEYS = (
    Keys.Tokenizer.BOS_ID,
    Keys.Tokenizer.EOS_ID,
    Keys.Tokenizer.EOT_ID,
    Keys.Tokenizer.EOM_ID,
    Keys.Tokenizer.UNK_ID,
    Keys.Tokenizer.SEP_ID,
    Keys.Tokenizer.PAD_ID,
    Keys.Tokenizer.MASK_ID,
    Keys.Tokenizer.FIM_PRE_ID,
    Keys.Tokenizer.FIM_MID_ID,
)


def semantic(name: str) -> Callable[[Mutation], Mutation]:
    def register(fn: Mutation) -> Mutation:
        SEMANTIC[name] = fn
        return fn

    return register


def _is_bert(g: GGUF) -> bool:
    return g.arch == "bert"


def _normal_ids(g: GGUF) -> list[int]:
    types = g.value(Keys.Tokenizer.TOKEN_TYPE)
    return [i for i, t in enumerate(types)] if types is None else [i for i, t in enumerate(types) if t == 1]


def _set_tokens(g: GGUF, tokens: list[bytes]) -> None:
    g.set(Keys.Tokenizer.LIST, VT.ARRAY, tokens, VT.STRING)


# -- vocabulary ---------------------------------------------------------------------------------


@semantic("vocab.duplicate_text")
def _(g: GGUF, rng: random.Random) -> str:
    tokens = list(g.tokens)
    i, j = rng.sample(range(len(tokens)), 2)
    if rng.random() < 0.3:  # a special token and a normal one
        i = rng.choice([0, 1, 2, 3])
    tokens[j] = tokens[i]
    _set_tokens(g, tokens)
    return f"token {j} := text of token {i} {tokens[i]!r}"


@semantic("vocab.all_empty")
def _(g: GGUF, rng: random.Random) -> str:
    _set_tokens(g, [b""] * len(g.tokens))
    return "every token text empty"


@semantic("vocab.some_empty")
def _(g: GGUF, rng: random.Random) -> str:
    tokens = list(g.tokens)
    ids = rng.sample(range(len(tokens)), rng.choice([1, 2, len(tokens) // 2]))
    for i in ids:
        tokens[i] = b""
    if rng.random() < 0.5:  # and a text llama.cpp's renaming of an empty one collides with
        k = rng.choice([i for i in range(len(tokens)) if i not in ids])
        tokens[k] = f"[EMPTY_{ids[0]}]".encode()
    _set_tokens(g, tokens)
    return f"{len(ids)} empty token texts"


@semantic("vocab.tokenizer_model")
def _(g: GGUF, rng: random.Random) -> str:
    choices = ["bert", "llama", "none", "no_vocab", "gpt2", "t5", "rwkv", "plamo2", "test", "gemma4"]
    choices += ["whitespace", "hybriddna", "", "LLAMA", "sentencepiece"]
    current = g.value(Keys.Tokenizer.MODEL)
    model = rng.choice([c for c in choices if c.encode() != current])
    g.set(Keys.Tokenizer.MODEL, VT.STRING, model.encode())
    return f"tokenizer.ggml.model = {model!r}"


@semantic("vocab.token_count")
def _(g: GGUF, rng: random.Random) -> str:
    tokens = list(g.tokens)
    delta = rng.choice([-1, -7, 1, 5])
    if delta < 0:
        del tokens[delta:]
        arrays = (Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE) if rng.random() < 0.5 else ()
    else:
        tokens += [f"extra{i}".encode() for i in range(delta)]
        arrays = (Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE) if rng.random() < 0.5 else ()
    for key in arrays:
        kv = g.get(key)
        if kv is not None:
            kv.value = (kv.value[: len(tokens)] + [kv.value[-1]] * len(tokens))[: len(tokens)]
    _set_tokens(g, tokens)
    return f"{delta:+d} tokens (arrays resized: {bool(arrays)})"


@semantic("vocab.array_lengths")
def _(g: GGUF, rng: random.Random) -> str:
    keys = [k for k in (Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE) if g.get(k) is not None]
    kv = g.get(rng.choice(keys))
    assert kv is not None
    delta = rng.choice([-1, -len(kv.value) + 1, 1, 100])
    kv.value = kv.value[:delta] if delta < 0 else kv.value + [kv.value[-1]] * delta
    return f"{kv.key}: {delta:+d} entries"


@semantic("vocab.scores")
def _(g: GGUF, rng: random.Random) -> str:
    n = len(g.tokens)
    choice = rng.choice(["nan", "inf", "-inf", "int32", "string", "float64", "all_nan"])
    if choice in ("nan", "inf", "-inf", "all_nan"):
        scores = [0.0] * n if g.get(Keys.Tokenizer.SCORES) is None else list(g.value(Keys.Tokenizer.SCORES))
        bad = float(choice.replace("all_", ""))
        for i in range(n) if choice == "all_nan" else rng.sample(range(n), 3):
            scores[i] = bad
        g.set(Keys.Tokenizer.SCORES, VT.ARRAY, scores, VT.FLOAT32)
    elif choice == "int32":
        g.set(Keys.Tokenizer.SCORES, VT.ARRAY, [rng.randrange(-100, 100) for _ in range(n)], VT.INT32)
    elif choice == "string":
        g.set(Keys.Tokenizer.SCORES, VT.ARRAY, [b"0"] * n, VT.STRING)
    else:
        g.set(Keys.Tokenizer.SCORES, VT.ARRAY, [0.5] * n, VT.FLOAT64)
    return f"scores: {choice}"


@semantic("vocab.token_types")
def _(g: GGUF, rng: random.Random) -> str:
    n = len(g.tokens)
    types = list(g.value(Keys.Tokenizer.TOKEN_TYPE) or [1] * n)
    choice = rng.choice(["invalid", "uint8", "float", "all_control", "all_byte", "all_unused", "undefined"])
    if choice == "invalid":
        for i in rng.sample(range(n), 3):
            types[i] = rng.choice([7, 99, -1, 2**31 - 1])
        g.set(Keys.Tokenizer.TOKEN_TYPE, VT.ARRAY, types, VT.INT32)
    elif choice == "uint8":
        g.set(Keys.Tokenizer.TOKEN_TYPE, VT.ARRAY, [t % 256 for t in types], VT.UINT8)
    elif choice == "float":
        g.set(Keys.Tokenizer.TOKEN_TYPE, VT.ARRAY, [float(t) for t in types], VT.FLOAT32)
    else:
        value = {"all_control": 3, "all_byte": 6, "all_unused": 5, "undefined": 0}[choice]
        g.set(Keys.Tokenizer.TOKEN_TYPE, VT.ARRAY, [value] * n, VT.INT32)
    return f"token types: {choice}"


@semantic("vocab.tokens_value")
def _(g: GGUF, rng: random.Random) -> str:
    n = len(g.tokens)
    choice = rng.choice(["int_array", "scalar", "missing", "empty_array", "one_token"])
    if choice == "int_array":
        g.set(Keys.Tokenizer.LIST, VT.ARRAY, list(range(n)), VT.INT32)
    elif choice == "scalar":
        g.set(Keys.Tokenizer.LIST, VT.STRING, b"hello")
    elif choice == "missing":
        g.drop(Keys.Tokenizer.LIST)
    elif choice == "empty_array":
        _set_tokens(g, [])
    else:
        _set_tokens(g, [b"a"])
    return f"tokenizer.ggml.tokens: {choice}"


@semantic("vocab.byte_tokens")
def _(g: GGUF, rng: random.Random) -> str:
    tokens = list(g.tokens)
    byte_ids = [i for i, t in enumerate(tokens) if t.startswith(b"<0x") and len(t) == 6]
    if not byte_ids:  # WordPiece: add SentencePiece byte tokens instead
        for i in rng.sample(range(10, len(tokens)), 3):
            tokens[i] = f"<0x{i:02X}>".encode()
        _set_tokens(g, tokens)
        return "SentencePiece byte tokens in a WordPiece vocabulary"
    drop = rng.sample(byte_ids, rng.choice([1, 10, len(byte_ids)]))
    for i in drop:
        tokens[i] = f"nobyte{i}".encode()
    _set_tokens(g, tokens)
    return f"{len(drop)} byte tokens renamed"


@semantic("vocab.special_ids")
def _(g: GGUF, rng: random.Random) -> str:
    n = len(g.tokens)
    key = rng.choice(_SPECIAL_KEYS)
    value = rng.choice([n, n + 100, *_HUGE_U32])
    vtype = VT.UINT32
    if rng.random() < 0.25:
        vtype, value = VT.INT32, -1
    g.set(key, vtype, value)
    return f"{key} = {value}"


@semantic("vocab.special_types")
def _(g: GGUF, rng: random.Random) -> str:
    key = rng.choice(_SPECIAL_KEYS)
    vtype, value = rng.choice(
        [(VT.STRING, b"1"), (VT.FLOAT32, 1.0), (VT.BOOL, True), (VT.INT64, 1), (VT.INT32, 2)]
    )
    g.set(key, vtype, value)
    return f"{key} as {VT(vtype).name}"


@semantic("vocab.add_special")
def _(g: GGUF, rng: random.Random) -> str:
    choice = rng.choice(
        ["bos_without_id", "eos_without_id", "sep_on_llama", "sep_without_id", "flags_as_int"]
    )
    if choice == "bos_without_id":
        g.set(Keys.Tokenizer.ADD_BOS, VT.BOOL, True)
        g.drop(Keys.Tokenizer.BOS_ID)
        if rng.random() < 0.5:  # and the default id out of range
            _set_tokens(g, g.tokens[:1] + [f"z{i}".encode() for i in range(1, len(g.tokens))])
    elif choice == "eos_without_id":
        g.set(Keys.Tokenizer.ADD_EOS, VT.BOOL, True)
        g.drop(Keys.Tokenizer.EOS_ID)
    elif choice == "sep_on_llama":
        g.set(Keys.Tokenizer.ADD_SEP, VT.BOOL, True)
    elif choice == "sep_without_id":
        g.set(Keys.Tokenizer.ADD_SEP, VT.BOOL, True)
        g.drop(Keys.Tokenizer.SEP_ID)
    else:
        g.set(Keys.Tokenizer.ADD_BOS, VT.UINT32, 1)
    return choice


@semantic("vocab.merges")
def _(g: GGUF, rng: random.Random) -> str:
    g.set(Keys.Tokenizer.MODEL, VT.STRING, b"gpt2")
    tokens = g.tokens
    choice = rng.choice(["missing", "malformed", "int_array", "unknown_pieces", "plausible", "empty"])
    if choice == "missing":
        g.drop(Keys.Tokenizer.MERGES)
    elif choice == "malformed":
        merges = [b"ab", b" a", b"a ", b"a  b", b"", b" "]
        g.set(Keys.Tokenizer.MERGES, VT.ARRAY, rng.sample(merges, 3), VT.STRING)
    elif choice == "int_array":
        g.set(Keys.Tokenizer.MERGES, VT.ARRAY, [1, 2, 3], VT.INT32)
    elif choice == "unknown_pieces":
        g.set(Keys.Tokenizer.MERGES, VT.ARRAY, [b"zz qq", b"\xe2\x96 x"], VT.STRING)
    elif choice == "plausible":
        merges = [
            tokens[i] + b" " + tokens[j] for i, j in zip(range(300, 310), range(290, 300), strict=False)
        ]
        g.set(Keys.Tokenizer.MERGES, VT.ARRAY, merges, VT.STRING)
    else:
        g.set(Keys.Tokenizer.MERGES, VT.ARRAY, [], VT.STRING)
    if rng.random() < 0.3:
        g.set(Keys.Tokenizer.PRE, VT.STRING, rng.choice([b"bogus", b"default", b"llama3", b""]))
    return f"gpt2 tokenizer, merges {choice}"


@semantic("vocab.token_bytes")
def _(g: GGUF, rng: random.Random) -> str:
    tokens = list(g.tokens)
    i = rng.choice(_normal_ids(g))
    choice = rng.choice(["invalid_utf8", "huge", "nul", "control"])
    tokens[i] = {
        "invalid_utf8": b"\xff\xfe" + tokens[i],
        "huge": b"x" * 100_000,
        "nul": b"a\0b",
        "control": b"\x01\x02",
    }[choice]
    _set_tokens(g, tokens)
    return f"token {i}: {choice}"


@semantic("vocab.token_type_count")
def _(g: GGUF, rng: random.Random) -> str:
    value = rng.choice([0, 1, 3, 1000, 2**32 - 1])
    g.set(Keys.Tokenizer.TOKEN_TYPE_COUNT, VT.UINT32, value)
    return f"token_type_count = {value}"


@semantic("vocab.chat_template")
def _(g: GGUF, rng: random.Random) -> str:
    choice = rng.choice(["broken_jinja", "invalid_utf8", "int", "huge"])
    if choice == "int":
        g.set(Keys.Tokenizer.CHAT_TEMPLATE, VT.UINT32, 7)
    else:
        value = {
            "broken_jinja": b"{% for x in %}{{",
            "invalid_utf8": b"\xff{{ x }}",
            "huge": b"{{x}}" * 20000,
        }
        g.set(Keys.Tokenizer.CHAT_TEMPLATE, VT.STRING, value[choice])
    return f"chat template: {choice}"


# -- hyper-parameters ------------------------------------------------------------------------------


def _set_u32(g: GGUF, template: str, value: int) -> str:
    key = g.akey(template)
    g.set(key, VT.UINT32, value)
    return f"{key} = {value}"


@semantic("hparams.block_count")
def _(g: GGUF, rng: random.Random) -> str:
    n = g.value(g.akey(Keys.LLM.BLOCK_COUNT))
    return _set_u32(g, Keys.LLM.BLOCK_COUNT, rng.choice([0, n - 1, n + 1, 513, 100_000, *_HUGE_U32]))


@semantic("hparams.embedding_length")
def _(g: GGUF, rng: random.Random) -> str:
    n = g.value(g.akey(Keys.LLM.EMBEDDING_LENGTH))
    return _set_u32(g, Keys.LLM.EMBEDDING_LENGTH, rng.choice([0, 1, n - 1, n + 1, 2 * n, n // 2, *_HUGE_U32]))


@semantic("hparams.head_count")
def _(g: GGUF, rng: random.Random) -> str:
    heads = g.value(g.akey(Keys.Attention.HEAD_COUNT))
    n_layer = g.value(g.akey(Keys.LLM.BLOCK_COUNT))
    if rng.random() < 0.3:  # per-layer array
        values = rng.choice(
            [[heads] * (n_layer + 1), [heads, 0][:n_layer], [heads, 3][:n_layer], [0] * n_layer]
        )
        g.set(g.akey(Keys.Attention.HEAD_COUNT), VT.ARRAY, values, VT.UINT32)
        return f"head_count = {values}"
    return _set_u32(g, Keys.Attention.HEAD_COUNT, rng.choice([0, 3, 5, heads * 2, 33, 64, *_HUGE_U32]))


@semantic("hparams.head_count_kv")
def _(g: GGUF, rng: random.Random) -> str:
    heads = g.value(g.akey(Keys.Attention.HEAD_COUNT))
    return _set_u32(g, Keys.Attention.HEAD_COUNT_KV, rng.choice([0, 3, heads + 1, heads * 2, 2**32 - 1]))


@semantic("hparams.feed_forward_length")
def _(g: GGUF, rng: random.Random) -> str:
    n = g.value(g.akey(Keys.LLM.FEED_FORWARD_LENGTH))
    return _set_u32(g, Keys.LLM.FEED_FORWARD_LENGTH, rng.choice([0, 1, n - 1, n + 1, 2**31]))


@semantic("hparams.context_length")
def _(g: GGUF, rng: random.Random) -> str:
    return _set_u32(g, Keys.LLM.CONTEXT_LENGTH, rng.choice([0, 1, 2, 4, 8, 2**31, 2**32 - 1]))


@semantic("hparams.norm_epsilon")
def _(g: GGUF, rng: random.Random) -> str:
    template = Keys.Attention.LAYERNORM_EPS if _is_bert(g) else Keys.Attention.LAYERNORM_RMS_EPS
    key = g.akey(template)
    value = rng.choice([math.nan, -1e-5, -1.0, 0.0, math.inf, -math.inf, 1e30])
    vtype = VT.FLOAT32 if rng.random() < 0.8 else VT.FLOAT64
    g.set(key, vtype, value)
    return f"{key} = {value} ({VT(vtype).name})"


@semantic("hparams.rope")
def _(g: GGUF, rng: random.Random) -> str:
    choice = rng.choice(["freq_base", "dimension_count", "scaling_type", "scaling_factor", "attn_factor"])
    if choice == "freq_base":
        key, value = g.akey(Keys.Rope.FREQ_BASE), rng.choice([0.0, -1.0, math.nan, math.inf])
        g.set(key, VT.FLOAT32, value)
    elif choice == "dimension_count":
        return _set_u32(g, Keys.Rope.DIMENSION_COUNT, rng.choice([0, 1, 3, 6, 10, 16, 2**31]))
    elif choice == "scaling_type":
        key, value = (
            g.akey(Keys.Rope.SCALING_TYPE),
            rng.choice([b"bogus", b"", b"YARN", b"yarn", b"longrope"]),
        )
        g.set(key, VT.STRING, value)
    else:
        template = Keys.Rope.SCALING_FACTOR if choice == "scaling_factor" else Keys.Rope.SCALING_ATTN_FACTOR
        key, value = g.akey(template), rng.choice([math.nan, -1.0, 0.0, math.inf, 1e-30])
        g.set(key, VT.FLOAT32, value)
    return f"{key} = {value!r}"


@semantic("hparams.head_sizes")
def _(g: GGUF, rng: random.Random) -> str:
    template = rng.choice([Keys.Attention.KEY_LENGTH, Keys.Attention.VALUE_LENGTH])
    return _set_u32(g, template, rng.choice([0, 1, 4, 16, 64, 2**31]))


@semantic("hparams.experts")
def _(g: GGUF, rng: random.Random) -> str:
    count, used = rng.choice([(4, 0), (4, 5), (0, 2), (2000, 2), (4, 2), (1, 1)])
    _set_u32(g, Keys.LLM.EXPERT_COUNT, count)
    _set_u32(g, Keys.LLM.EXPERT_USED_COUNT, used)
    if rng.random() < 0.3:
        _set_u32(g, Keys.LLM.EXPERT_GROUP_COUNT, rng.choice([0, 2, 3, 8]))
    return f"expert_count = {count}, expert_used_count = {used}"


@semantic("hparams.vocab_size")
def _(g: GGUF, rng: random.Random) -> str:
    n = len(g.tokens)
    return _set_u32(g, Keys.LLM.VOCAB_SIZE, rng.choice([0, n - 1, n + 1, 2**32 - 1]))


@semantic("hparams.pooling_and_causal")
def _(g: GGUF, rng: random.Random) -> str:
    choice = rng.choice(["pooling", "causal"])
    if choice == "pooling":
        return _set_u32(g, Keys.LLM.POOLING_TYPE, rng.choice([0, 1, 2, 3, 4, 5, 99, 2**32 - 1]))
    key = g.akey(Keys.Attention.CAUSAL)
    value = rng.choice([True, False])
    g.set(key, VT.BOOL, value)
    return f"{key} = {value}"


@semantic("hparams.missing_key")
def _(g: GGUF, rng: random.Random) -> str:
    prefix = g.arch + "."
    keys = [kv.key for kv in g.kvs if kv.key.startswith(prefix)]
    key = rng.choice(keys)
    g.drop(key)
    return f"dropped {key}"


@semantic("hparams.value_types")
def _(g: GGUF, rng: random.Random) -> str:
    prefix = g.arch + "."
    kv = rng.choice([kv for kv in g.kvs if kv.key.startswith(prefix)])
    kv.type, kv.value, kv.item_type = rng.choice(
        [
            (VT.STRING, b"12", None),
            (VT.FLOAT32, 2.0, None),
            (VT.BOOL, True, None),
            (VT.INT32, -2, None),
            (VT.INT64, 2**40, None),
            (VT.UINT8, 2, None),
            (VT.ARRAY, [1, 2, 3], VT.UINT32),
            (VT.ARRAY, [], VT.FLOAT32),
        ]
    )
    return f"{kv.key} as {VT(kv.type).name}"


@semantic("hparams.nextn_layers")
def _(g: GGUF, rng: random.Random) -> str:
    n = g.value(g.akey(Keys.LLM.BLOCK_COUNT))
    return _set_u32(g, Keys.LLM.NEXTN_PREDICT_LAYERS, rng.choice([1, n, n + 1, 2**32 - 1]))


# -- architecture ------------------------------------------------------------------------------


@semantic("arch.name")
def _(g: GGUF, rng: random.Random) -> str:
    names = [b"", b"llama", b"bert", b"gpt2", b"qwen2", b"mistral", b"nomic-bert", b"jina-bert-v2", b"mamba"]
    names += [b"t5", b"foo", b"LLAMA", b"llama\0x", b"\xffllama", b"clip", b"rwkv6"]
    current = g.value(Keys.General.ARCHITECTURE)
    name = rng.choice([n for n in names if n != current])
    g.set(Keys.General.ARCHITECTURE, VT.STRING, name)
    if rng.random() < 0.5 and name and b"\0" not in name and b"\xff" not in name:
        # keep the hyper-parameters readable under the new name
        old, new = current.decode() + ".", name.decode() + "."
        for kv in g.kvs:
            if kv.key.startswith(old):
                kv.key = new + kv.key[len(old) :]
        return f"architecture {name!r}, keys renamed"
    return f"architecture {name!r}"


@semantic("arch.key")
def _(g: GGUF, rng: random.Random) -> str:
    choice = rng.choice(["missing", "int", "array"])
    if choice == "missing":
        g.drop(Keys.General.ARCHITECTURE)
    elif choice == "int":
        g.set(Keys.General.ARCHITECTURE, VT.UINT32, 1)
    else:
        g.set(Keys.General.ARCHITECTURE, VT.ARRAY, [b"llama"], VT.STRING)
    return f"general.architecture {choice}"


@semantic("file.alignment")
def _(g: GGUF, rng: random.Random) -> str:
    value = rng.choice([0, 3, 16, 64, 2**31])
    g.set(Keys.General.ALIGNMENT, VT.UINT32, value)
    if value and not value & (value - 1) and value <= 64:
        g.alignment = value
    return f"general.alignment = {value} (laid out with {g.alignment})"


@semantic("file.duplicate_key")
def _(g: GGUF, rng: random.Random) -> str:
    kv = rng.choice(g.kvs)
    g.kvs.insert(rng.randrange(len(g.kvs) + 1), copy.deepcopy(kv))
    return f"{kv.key} twice"


# -- tensors ---------------------------------------------------------------------------------------


def _pick_tensor(g: GGUF, rng: random.Random, *, ndim: int | None = None) -> Tensor:
    pool = [t for t in g.tensors if ndim is None or len(t.dims) == ndim]
    return rng.choice(pool or g.tensors)


@semantic("tensor.missing")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng)
    g.tensors.remove(t)
    return f"dropped {t.name}"


@semantic("tensor.duplicate")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng)
    g.tensors.insert(rng.randrange(len(g.tensors) + 1), copy.deepcopy(t))
    return f"{t.name} twice"


@semantic("tensor.extra")
def _(g: GGUF, rng: random.Random) -> str:
    template = _pick_tensor(g, rng)
    n_layer = g.value(g.akey(Keys.LLM.BLOCK_COUNT)) or 0
    name = rng.choice(
        [f"blk.{n_layer}.attn_q.weight", "foo.weight", "cls.weight", "output.bias", "blk.0.extra"]
    )
    g.tensors.append(Tensor(name, list(template.dims), template.type, template.data))
    return f"extra tensor {name} {template.dims}"


@semantic("tensor.rename")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng)
    old = t.name
    t.name = rng.choice(
        [old.replace("blk.0.", "blk.7."), old.upper(), old + "x", "x" * 70, "blk.-1.attn_q.weight"]
    )
    return f"{old} renamed {t.name}"


@semantic("tensor.shape")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng)
    old = list(t.dims)
    choice = rng.choice(["transpose", "plus_one", "minus_one", "add_dim", "drop_dim", "zero", "double"])
    dims = list(old)
    if choice == "transpose" and len(dims) >= 2:
        dims[0], dims[1] = dims[1], dims[0]
    elif choice == "plus_one":
        dims[-1] += 1
    elif choice == "minus_one":
        dims[-1] = max(dims[-1] - 1, 1)
    elif choice == "add_dim":
        dims = [*dims, 2]
    elif choice == "drop_dim" and len(dims) >= 2:
        dims = [dims[0] * dims[1], *dims[2:]]
    elif choice == "zero":
        dims[-1] = 0
    else:
        dims[0] *= 2
    block, _ = GGML_QUANT_SIZES[Q(t.type)]
    if dims[0] % block:
        dims[0] += block - dims[0] % block
    t.dims = dims
    size = _nbytes(dims, t.type)
    t.data = (t.data * (size // max(len(t.data), 1) + 1))[:size]
    return f"{t.name} {old} -> {dims}"


_RETYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.I8, Q.I16, Q.I32, Q.I64, Q.F64, Q.Q8_1, Q.Q8_K]
_RETYPES += [Q.IQ2_XXS, Q.TQ1_0, Q.MXFP4, Q.IQ4_NL]


@semantic("tensor.type")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng, ndim=rng.choice([1, 2]))
    new = rng.choice(_RETYPES)
    block, _ = GGML_QUANT_SIZES[new]
    if t.dims[0] % block:
        new = Q.F16
    t.type = int(new)
    size = _nbytes(t.dims, new)
    if new in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0) and len(t.data) == 4 * math.prod(t.dims):
        from gguf.quants import quantize

        values = np.frombuffer(t.data, np.float32).reshape(list(reversed(t.dims)))
        t.data = quantize(values, new).tobytes()
    else:
        t.data = rng.randbytes(size) if rng.random() < 0.5 else bytes(size)
    return f"{t.name} as {new.name}"


@semantic("tensor.raw_type")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng)
    t.type = rng.choice([4, 5, 31, 36, 42, 43, 99, 2**31])
    return f"{t.name} type {t.type}"


@semantic("tensor.dims")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng)
    choice = rng.choice(["none", "five", "huge", "negative"])
    if choice == "none":
        t.dims = []
    elif choice == "five":
        t.dims = [*t.dims, 1, 1, 1, 1][:5]
    elif choice == "huge":
        t.dims = [t.dims[0], 2**40]
    else:
        t.dims = [t.dims[0], 2**63 + 5]
    return f"{t.name} dims {choice}"


@semantic("tensor.offset")
def _(g: GGUF, rng: random.Random) -> str:
    i = rng.randrange(len(g.tensors))
    t = g.tensors[i]
    choice = rng.choice(["misaligned", "overlap", "beyond", "huge", "gap"])
    if choice == "misaligned":
        t.offset = 1
    elif choice == "overlap":
        t.offset = 0
    elif choice == "beyond":
        t.offset, t.placed = 1 << 30, False
    elif choice == "huge":
        t.offset, t.placed = 2**64 - 32, False
    else:
        t.offset = (sum(len(x.data) for x in g.tensors) + 4096) // 32 * 32
    return f"{t.name} offset {choice}"


@semantic("tensor.values")
def _(g: GGUF, rng: random.Random) -> str:
    t = _pick_tensor(g, rng)
    if t.type != Q.F32:
        return f"{t.name}: not F32, unchanged"
    values = np.frombuffer(t.data, np.float32).copy()
    choice = rng.choice(["nan", "inf", "huge", "zero"])
    values[:] = {"nan": np.nan, "inf": np.inf, "huge": 3e38, "zero": 0.0}[choice]
    t.data = values.tobytes()
    return f"{t.name} all {choice}"


@semantic("tensor.name_bytes")
def _(g: GGUF, rng: random.Random) -> str:
    i = rng.randrange(len(g.tensors))
    g.name_override[i] = rng.choice([b"", b"\xff\xfe", b"x" * 64, b"token_embd.weight\0x"])
    return f"tensor {i} raw name {g.name_override[i][:20]!r}"


@semantic("combo")
def _(g: GGUF, rng: random.Random) -> str:
    done = []
    names = [n for n in SEMANTIC if n != "combo"]
    for name in rng.sample(names, rng.choice([2, 3])):
        try:
            done.append(f"{name}: {SEMANTIC[name](g, rng)}")
        except (NotApplicable, IndexError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return " + ".join(done)


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


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    index: int
    name: str  # class name
    kind: str  # "semantic" or "byte"
    base: str
    description: str
    source: bytes | Callable[[], bytes] = field(repr=False)  # the bytes, or a function making them

    @property
    def data(self) -> bytes:
        """The file's bytes (made on demand: a thousand mutants would not fit in memory)."""
        return self.source() if callable(self.source) else self.source

    @property
    def label(self) -> str:
        return f"#{self.index} {self.name} [{self.base}] {self.description}"


class Bases:
    """The base files, parsed once."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths
        self.gguf = {name: GGUF.read(path) for name, path in paths.items()}
        self.serialized = {name: g.to_bytes() for name, g in self.gguf.items()}


def _base_for(name: str, i: int) -> str:
    return ("llama", "bert", "bpe", "llama", "bert", "tiny")[i % 6]


def generate(
    bases: Bases, n: int, *, seed: int = 0, kinds: Iterable[str] = ("semantic", "byte"), start: int = 0
) -> list[Mutant]:
    """``n`` mutants, round-robin over the classes of ``kinds`` (semantic first), deterministic;
    numbered from ``start``."""
    classes: list[tuple[str, str]] = []
    if "semantic" in kinds:
        classes += [("semantic", name) for name in SEMANTIC]
    if "byte" in kinds:
        classes += [("byte", name) for name in BYTE]
    out: list[Mutant] = []
    i = start
    attempts = 0
    while len(out) < n and attempts < 10 * n + 100:
        kind, name = classes[attempts % len(classes)]
        round_ = attempts // len(classes)
        attempts += 1
        base = _base_for(name, round_)

        def make(
            kind: str = kind, name: str = name, base: str = base, key: str = f"{seed}:{name}:{round_}"
        ) -> tuple[bytes, str]:
            rng = random.Random(key)
            if kind == "semantic":
                g = bases.gguf[base].copy()
                description = SEMANTIC[name](g, rng)
                return g.to_bytes()[0], description
            base_bytes, fields = bases.serialized[base]
            return BYTE[name](base_bytes, fields, rng)

        try:
            _, description = make()
        except (NotApplicable, IndexError, ValueError, KeyError, TypeError, AttributeError, struct.error):
            continue
        out.append(Mutant(i, name, kind, base, description, lambda make=make: make()[0]))
        i += 1
    return out


def issue_mutants(bases: Bases) -> dict[str, bytes]:
    """One fixed file per crash the issue reports (llama.cpp aborts on each without validation)."""

    def edit(base: str, fn: Callable[[GGUF], None]) -> bytes:
        g = bases.gguf[base].copy()
        fn(g)
        return g.to_bytes()[0]

    def dup(g: GGUF) -> None:
        tokens = list(g.tokens)
        tokens[300] = tokens[299]
        _set_tokens(g, tokens)

    def model(name: bytes) -> Callable[[GGUF], None]:
        return lambda g: g.set(Keys.Tokenizer.MODEL, VT.STRING, name)

    return {
        "duplicate_token_texts": edit("llama", dup),
        "block_count_0": edit("llama", lambda g: g.set("llama.block_count", VT.UINT32, 0)),
        "block_count_huge": edit("llama", lambda g: g.set("llama.block_count", VT.UINT32, 100_000)),
        "rms_epsilon_nan": edit(
            "llama", lambda g: g.set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, math.nan)
        ),
        "rms_epsilon_negative": edit(
            "llama", lambda g: g.set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, -1e-5)
        ),
        "bert_tokenizer_on_llama_vocab": edit("llama", model(b"bert")),
        "tokenizer_none": edit("llama", model(b"none")),
        "all_token_texts_empty": edit("llama", lambda g: _set_tokens(g, [b""] * len(g.tokens))),
    }


# ---------------------------------------------------------------------------------------------
# The subprocess harness
# ---------------------------------------------------------------------------------------------

TEXTS = [
    "Hello world, this is a test of the model file.",
    "naïve café — 東京 🙂\t\n<s></s>[CLS] <|im_start|> \x00 end",
    "",
]


@dataclass
class Outcome:
    mutant: Mutant
    result: str  # "ok", "error" (a clean exception), "crash", "hang"
    stage: str = ""
    error_type: str = ""
    message: str = ""
    clean: bool = True  # for "error": a LlamaBatchError or ValueError
    seconds: float = 0.0

    def __str__(self) -> str:
        detail = f"{self.error_type}: {self.message}" if self.error_type else self.message
        return f"{self.result:5s} at {self.stage or '-':10s} {self.mutant.label[:150]} | {detail[:300]}"


@dataclass
class Report:
    outcomes: list[Outcome]
    seconds: float

    def of(self, result: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == result]

    @property
    def crashes(self) -> list[Outcome]:
        return self.of("crash")

    @property
    def hangs(self) -> list[Outcome]:
        return self.of("hang")

    @property
    def unclean(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == "error" and not o.clean]

    def summary(self) -> str:
        kinds = {k: sum(o.mutant.kind == k for o in self.outcomes) for k in ("semantic", "byte")}
        counts = {r: len(self.of(r)) for r in ("ok", "error", "crash", "hang")}
        return (
            f"{len(self.outcomes)} mutants ({kinds['semantic']} semantic, {kinds['byte']} byte) in "
            f"{self.seconds:.1f}s: {counts['ok']} ran, {counts['error']} raised "
            f"({len(self.unclean)} unclean), {counts['crash']} crashes, {counts['hang']} hangs"
        )


class _Child:
    def __init__(self, workdir: Path, validate: bool) -> None:
        self.stderr_path = workdir / f"child-stderr-{time.monotonic_ns()}.txt"
        self.stderr = self.stderr_path.open("wb")
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parent)
        # (no empty entry: it would put the current directory, maybe an unbuilt source tree, first)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        env["PYTHONFAULTHANDLER"] = "1"
        env["GGML_NO_BACKTRACE"] = "1"  # ggml would attach gdb to print a backtrace on abort
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(Path(__file__).resolve()), "--child", "1" if validate else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            start_new_session=True,
        )
        self.buffer = b""

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()

    def read_line(self, deadline: float) -> dict[str, Any] | None:
        """The next message; raises EOFError when the child is gone, TimeoutError past ``deadline``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            if b"\n" not in self.buffer:
                self._fill(fd, deadline)
                continue
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                return json.loads(line)
            except ValueError:  # not a message (the child's stdout is its stderr; be safe)
                continue

    def _fill(self, fd: int, deadline: float) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                break
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError
        self.buffer += chunk

    def stderr_tail(self) -> str:
        self.stderr.flush()
        text = self.stderr_path.read_bytes()[-20000:].decode("utf-8", "replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # what llama.cpp / the C++ runtime said, then the innermost Python frame
        said = [ln for ln in lines if any(k in ln for k in ("GGML_ASSERT", "error", "terminate", "what()"))]
        frames = [ln for ln in lines if ln.startswith("File ")]
        return " | ".join(said[-3:] + frames[:1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.close()

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self.stderr.close()
        self.stderr_path.unlink(missing_ok=True)


def run_mutants(
    mutants: list[Mutant],
    workdir: Path,
    *,
    validate: bool = True,
    timeout: float = 30.0,
    progress: Callable[[Outcome], None] | None = None,
) -> Report:
    """Run every mutant in child processes (restarted after a crash or a hang)."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    child: _Child | None = None
    try:
        for m in mutants:
            path = workdir / f"mutant-{m.index:05d}.gguf"
            path.write_bytes(m.data)
            if child is None:
                child = _Child(workdir, validate)
            start = time.monotonic()
            child.send({"path": str(path)})
            stage = ""
            outcome: Outcome | None = None
            while outcome is None:
                try:
                    msg = child.read_line(start + timeout)
                except EOFError:
                    msg = None
                except TimeoutError:
                    outcome = Outcome(m, "hang", stage, message=f"no answer within {timeout:.0f}s")
                    child.kill()
                    child = None
                    break
                if msg is None:
                    code = child.proc.wait()
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    outcome = Outcome(m, "crash", stage, message=f"{how}: {child.stderr_tail()}")
                    child.kill()
                    child = None
                    break
                if msg["event"] == "stage":
                    stage = msg["stage"]
                elif msg["event"] == "done":
                    outcome = Outcome(
                        m,
                        msg["result"],
                        msg.get("stage", stage),
                        msg.get("error_type", ""),
                        msg.get("message", ""),
                        msg.get("clean", True),
                    )
            outcome.seconds = time.monotonic() - start
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
            path.unlink(missing_ok=True)
    finally:
        if child is not None:
            child.kill()
    return Report(outcomes, time.monotonic() - t0)


# -- the child -----------------------------------------------------------------------------------


def _child_main(validate: bool) -> None:
    import faulthandler

    faulthandler.enable()
    from llamabatch import LLM, Embedder, SamplingParams
    from llamabatch._ffi import model as model_module
    from llamabatch.errors import LlamaBatchError

    original_init = model_module.Model.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["validate"] = validate  # every Model the child makes (LLM's, Embedder's too)
        original_init(self, *args, **kwargs)

    model_module.Model.__init__ = init  # type: ignore[method-assign]
    # Messages go to the original stdout; anything else printing to fd 1 lands in stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def send(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    for line in sys.stdin:
        job = json.loads(line)
        path = job["path"]
        stage = "load"
        try:
            send(event="stage", stage=stage)
            with model_module.Model(path) as model:
                stage = "tokenize"
                send(event="stage", stage=stage)
                for text in TEXTS:
                    tokens = model.tokenize(text)
                    model.tokenize(text, add_special=False, parse_special=True)
                    model.detokenize(tokens)
                    for t in tokens[:8]:
                        model.token_to_piece(t)
                        model.token_to_piece(t, special=True)
                # embedding models (BERT and the like) declare a pooling; decoders do not
                encoder = model.pooling_type != "unspecified" or model.has_encoder
                decoder = model.has_decoder and not encoder
            if decoder:
                stage = "generate"
                send(event="stage", stage=stage)
                try:
                    with LLM(path, n_ctx=128, n_parallel=2, n_batch=32, n_threads=1) as llm:
                        llm.generate(TEXTS[:2], SamplingParams(max_tokens=3, seed=1))
                        llm.generate(["x y z"], SamplingParams(max_tokens=3, temperature=0.0))
                except ValueError as exc:
                    if "decoder-only" not in str(exc):
                        raise
                    encoder = True  # a non-causal model without a declared pooling: embed it
            if encoder:
                stage = "embed"
                send(event="stage", stage=stage)
                with Embedder(path, n_batch=128, n_threads=1, truncate=True) as emb:
                    emb.embed(TEXTS)
            send(event="done", result="ok", stage=stage)
        except Exception as exc:
            send(
                event="done",
                result="error",
                stage=stage,
                error_type=type(exc).__name__,
                message=str(exc)[:500],
                clean=isinstance(exc, (LlamaBatchError, ValueError)),
            )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2] == "1")
    else:  # a report: python tests/gguf_mutants.py N [validate 0/1]
        import tempfile

        n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
        validate = sys.argv[2] != "0" if len(sys.argv) > 2 else True
        with tempfile.TemporaryDirectory() as tmp:
            bases = Bases(write_bases(Path(tmp) / "bases"))
            timeout = float(os.environ.get("FUZZ_TIMEOUT", "30"))

            def show(o: Outcome) -> None:
                if o.result != "ok":
                    print(o, flush=True)

            report = run_mutants(
                generate(bases, n), Path(tmp) / "run", validate=validate, timeout=timeout, progress=show
            )
            print(report.summary())
