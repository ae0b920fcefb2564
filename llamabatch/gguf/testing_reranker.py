"""A random-weight cross-encoder for tests and examples, made without torch.

:func:`make_cross_encoder` writes a small ``BertForSequenceClassification`` directory as
transformers saves one (``config.json``, ``model.safetensors``, ``vocab.txt``,
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) from numpy alone
(weights drawn from a seeded generator, so the same seed always gives the same bytes);
:func:`reranker_path` converts it once to GGUF (cached, like ``llamabatch.gguf.testing``'s models).
``tests/data/make_reranker_reference.py`` loads the same directory with transformers to store
the reference logits the tests compare against.

Needs the ``safetensors`` and ``tokenizers`` packages (the ``test`` extra).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = [
    "LONG_PAIRS",
    "PAIRS",
    "cross_encoder_dir",
    "make_cross_encoder",
    "make_xlmr_cross_encoder",
    "reranker_path",
]

#: Bumped whenever :func:`make_cross_encoder`'s output changes (names the cached source).
_VERSION = 3

#: Words of the test vocabulary (all lower case: the tokenizer is uncased).
_WORDS = (
    "the a an of to in is was on for with as by at from and or not it this that what which who how "
    "when where why do does did can will be are were has have had city capital france paris berlin "
    "germany country river tree cat dog sat mat man woman play playing guitar music food eat eating "
    "apple banana fruit red green blue sky sea water fish bird fly flying run running fast slow big "
    "small house car road train plane book read reading write writing computer program code python "
    "language model search query document answer question rank relevant best good bad day night sun "
    "moon star rain snow cold hot weather"
).split()
_PIECES = ("##s", "##ing", "##ed", "##er", "##ly", "##est")
_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

#: (query, document) pairs the reference logits are computed for.
PAIRS: list[tuple[str, str]] = [
    ("what is the capital of france", "paris is the capital of france"),
    ("what is the capital of france", "berlin is a city in germany"),
    ("how fast does a bird fly", "birds fly fast over the sea"),
    ("who is playing the guitar", "a man is playing music on a guitar"),
    ("which fruit is red", "an apple can be red or green"),
    ("which fruit is red", "the sky is blue at day"),
    ("python code", "a computer program written in python"),
    ("rain", "cold weather with rain and snow"),
    ("the cat sat on the mat", ""),
    ("", "the dog is running"),
    ("what", "what what what"),
    ("reading books at night", "she was reading a book at night under the moon and stars"),
]

_LONG = " ".join(_WORDS[20:80])
#: Pairs longer than the test model's 64 positions: truncated (longest segment first) or refused.
LONG_PAIRS: list[tuple[str, str]] = [
    ("which city is the capital", _LONG),
    (_LONG, "paris"),
    (" ".join(_WORDS[:40]), " ".join(_WORDS[40:90])),
]


def _vocab() -> list[str]:
    return [*_SPECIAL, *[f"[unused{i}]" for i in range(3)], *_WORDS, *_PIECES]


def make_cross_encoder(
    directory: str | os.PathLike[str],
    *,
    seed: int = 25,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 64,
    num_labels: int = 1,
    head: bool = True,
    activation_fn: str | None = None,
) -> Path:
    """Write a random-weight BERT cross-encoder (or, with ``head=False``, a plain ``BertModel``
    without the pooler and classifier) into ``directory``; returns its path.

    ``activation_fn`` (e.g. ``"torch.nn.modules.linear.Identity"``) is recorded in
    ``config.json`` as sentence-transformers' ``CrossEncoder`` records it.
    """
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _vocab()
    rng = np.random.default_rng(seed)
    d, ff = hidden_size, intermediate_size

    def normal(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    prefix = "bert." if head else ""
    tensors: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": normal(len(vocab), d, std=0.5),
        "embeddings.position_embeddings.weight": normal(max_position_embeddings, d, std=0.3),
        # the two segments differ strongly, so a wrong token type shows in the scores
        "embeddings.token_type_embeddings.weight": normal(2, d, std=0.8),
        "embeddings.LayerNorm.weight": 1 + normal(d, std=0.1),
        "embeddings.LayerNorm.bias": normal(d, std=0.1),
    }
    for i in range(num_layers):
        layer = f"encoder.layer.{i}."
        for name, rows, cols in (
            ("attention.self.query", d, d),
            ("attention.self.key", d, d),
            ("attention.self.value", d, d),
            ("attention.output.dense", d, d),
            ("intermediate.dense", ff, d),
            ("output.dense", d, ff),
        ):
            tensors[f"{layer}{name}.weight"] = normal(rows, cols, std=cols**-0.5)
            tensors[f"{layer}{name}.bias"] = normal(rows, std=0.05)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            tensors[f"{layer}{norm}.weight"] = 1 + normal(d, std=0.1)
            tensors[f"{layer}{norm}.bias"] = normal(d, std=0.1)
    weights = {prefix + k: v for k, v in tensors.items()}
    if head:
        weights["bert.pooler.dense.weight"] = normal(d, d, std=d**-0.5)
        weights["bert.pooler.dense.bias"] = normal(d, std=0.05)
        weights["classifier.weight"] = normal(num_labels, d, std=0.1)
        weights["classifier.bias"] = normal(num_labels, std=0.1)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    config: dict[str, object] = {
        "architectures": ["BertForSequenceClassification" if head else "BertModel"],
        "model_type": "bert",
        "vocab_size": len(vocab),
        "hidden_size": d,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "intermediate_size": ff,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": max_position_embeddings,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
    }
    if head:
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
        if activation_fn is not None:
            config["sentence_transformers"] = {"activation_fn": activation_fn}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = vocab.index("[CLS]"), vocab.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tok.save(str(out / "tokenizer.json"))
    specials = {
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "mask_token": "[MASK]",
    }
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    tok_config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "model_max_length": max_position_embeddings,
        **specials,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def reranker_path(dtype: str = "f32", *, head: bool = True) -> Path:
    """The test cross-encoder (seed 25, one label) as a GGUF, converted once and cached under
    ``llamabatch.gguf.testing``'s cache directory; ``head=False``: the same encoder without a head."""
    from llamabatch.gguf.convert import cached_conversion
    from llamabatch.gguf.testing_llama import cache_dir

    return cached_conversion(cross_encoder_dir(head=head), dtype=dtype, cache_dir=cache_dir())


def cross_encoder_dir(*, head: bool = True) -> Path:
    """The Hugging Face directory of the test cross-encoder (made once, cached)."""
    from llamabatch.gguf.testing_llama import cache_dir

    source = cache_dir() / f"cross-encoder-src-v{_VERSION}-{'head' if head else 'nohead'}"
    if not (source / "config.json").is_file():
        tmp = source.with_name(f"{source.name}.{os.getpid()}.tmp")
        make_cross_encoder(tmp, head=head)
        try:
            os.replace(tmp, source)
        except OSError:  # another process made it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return source


def make_xlmr_cross_encoder(
    directory: str | os.PathLike[str],
    *,
    seed: int = 27,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_length: int = 64,
) -> Path:
    """Write a random-weight ``XLMRobertaForSequenceClassification`` (the bge-reranker shape)
    with a SentencePiece-style Unigram tokenizer (``tokenizer.json``) into ``directory``.

    Positions start at ``pad_token_id + 1`` as in RoBERTa, so the position table has
    ``max_length + 2`` rows; one token type; the head is ``classifier.dense`` + tanh +
    ``classifier.out_proj`` on ``<s>``."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces: list[tuple[str, float]] = [(t, 0.0) for t in specials]
    pieces += [("\u2581" + w, -5.0 - (i % 7) * 0.25) for i, w in enumerate(_WORDS)]
    pieces += [(p.removeprefix("##"), -7.0) for p in _PIECES]
    pieces += [("\u2581", -9.0)] + [
        (c, -11.0) for c in "abcdefghijklmnopqrstuvwxyz" if "##" + c not in _PIECES
    ]
    pieces.append(("<mask>", 0.0))
    vocab = [p for p, _ in pieces]
    rng = np.random.default_rng(seed)
    d, ff = hidden_size, intermediate_size

    def normal(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights: dict[str, np.ndarray] = {
        "roberta.embeddings.word_embeddings.weight": normal(len(vocab), d, std=0.5),
        "roberta.embeddings.position_embeddings.weight": normal(max_length + 2, d, std=0.3),
        "roberta.embeddings.token_type_embeddings.weight": normal(1, d, std=0.3),
        "roberta.embeddings.LayerNorm.weight": 1 + normal(d, std=0.1),
        "roberta.embeddings.LayerNorm.bias": normal(d, std=0.1),
    }
    for i in range(num_layers):
        layer = f"roberta.encoder.layer.{i}."
        for name, rows, cols in (
            ("attention.self.query", d, d),
            ("attention.self.key", d, d),
            ("attention.self.value", d, d),
            ("attention.output.dense", d, d),
            ("intermediate.dense", ff, d),
            ("output.dense", d, ff),
        ):
            weights[f"{layer}{name}.weight"] = normal(rows, cols, std=cols**-0.5)
            weights[f"{layer}{name}.bias"] = normal(rows, std=0.05)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            weights[f"{layer}{norm}.weight"] = 1 + normal(d, std=0.1)
            weights[f"{layer}{norm}.bias"] = normal(d, std=0.1)
    weights["classifier.dense.weight"] = normal(d, d, std=d**-0.5)
    weights["classifier.dense.bias"] = normal(d, std=0.05)
    weights["classifier.out_proj.weight"] = normal(1, d, std=0.1)
    weights["classifier.out_proj.bias"] = normal(1, std=0.1)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["XLMRobertaForSequenceClassification"],
        "model_type": "xlm-roberta",
        "vocab_size": len(vocab),
        "hidden_size": d,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "intermediate_size": ff,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": max_length + 2,
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "position_embedding_type": "absolute",
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = Tokenizer(Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok.save(str(out / "tokenizer.json"))
    names = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "sep_token": "</s>",
        "cls_token": "<s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    }
    (out / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    tok_config = {"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": max_length, **names}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out
