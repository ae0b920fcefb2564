"""The base files the GGUF mutants are made from (``gguf_mutants.py``): a micro Llama written
by ``llamabatch.gguf.testing`` (and the project's ``tiny`` preset), a micro BPE Llama, and a
micro BERT written by ``llamabatch.gguf.convert`` from a random-weight Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf.constants import Keys
from gguf_editor import GGUF, VT

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
