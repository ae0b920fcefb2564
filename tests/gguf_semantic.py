"""Semantic GGUF mutations, part one: files that parse but are wrong in their vocabulary or
hyper-parameters (``SEMANTIC``, in registration order; ``gguf_semantic_tensors.py`` adds the
architecture and tensor classes after these). Each edits a ``GGUF`` in place and describes
what it did."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from gguf.constants import Keys
from gguf_editor import GGUF, VT

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


def set_tokens(g: GGUF, tokens: list[bytes]) -> None:
    g.set(Keys.Tokenizer.LIST, VT.ARRAY, tokens, VT.STRING)


# -- vocabulary ---------------------------------------------------------------------------------


@semantic("vocab.duplicate_text")
def _(g: GGUF, rng: random.Random) -> str:
    tokens = list(g.tokens)
    i, j = rng.sample(range(len(tokens)), 2)
    if rng.random() < 0.3:  # a special token and a normal one
        i = rng.choice([0, 1, 2, 3])
    tokens[j] = tokens[i]
    set_tokens(g, tokens)
    return f"token {j} := text of token {i} {tokens[i]!r}"


@semantic("vocab.all_empty")
def _(g: GGUF, rng: random.Random) -> str:
    set_tokens(g, [b""] * len(g.tokens))
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
    set_tokens(g, tokens)
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
    set_tokens(g, tokens)
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
        set_tokens(g, [])
    else:
        set_tokens(g, [b"a"])
    return f"tokenizer.ggml.tokens: {choice}"


@semantic("vocab.byte_tokens")
def _(g: GGUF, rng: random.Random) -> str:
    tokens = list(g.tokens)
    byte_ids = [i for i, t in enumerate(tokens) if t.startswith(b"<0x") and len(t) == 6]
    if not byte_ids:  # WordPiece: add SentencePiece byte tokens instead
        for i in rng.sample(range(10, len(tokens)), 3):
            tokens[i] = f"<0x{i:02X}>".encode()
        set_tokens(g, tokens)
        return "SentencePiece byte tokens in a WordPiece vocabulary"
    drop = rng.sample(byte_ids, rng.choice([1, 10, len(byte_ids)]))
    for i in drop:
        tokens[i] = f"nobyte{i}".encode()
    set_tokens(g, tokens)
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
            set_tokens(g, g.tokens[:1] + [f"z{i}".encode() for i in range(1, len(g.tokens))])
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
    set_tokens(g, tokens)
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
