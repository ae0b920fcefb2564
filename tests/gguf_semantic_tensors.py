"""Semantic GGUF mutations, part two (after ``gguf_semantic.py``'s, in ``SEMANTIC``): a wrong
architecture, and tensors with wrong shapes, types, offsets or data."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, Keys
from gguf_editor import GGUF, VT, Q, Tensor, nbytes
from gguf_semantic import SEMANTIC, NotApplicable, semantic

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
    size = nbytes(dims, t.type)
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
    size = nbytes(t.dims, new)
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
