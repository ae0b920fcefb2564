"""The GGUF validator (llamabatch.gguf_check) on semantic cases: files made from the project's
own models by ``gguf_mutants.py`` that parse but are wrong (vocabulary, hyper-parameters,
architecture, tensors), each rejected before llama.cpp reads it with a message naming what
is wrong. ``test_gguf_check.py`` holds the good files, issue 11's cases and the container."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf.constants import Keys
from gguf_check_helpers import VT, Q, edited, rejects, set_key, write_model
from gguf_mutants import GGUF, Bases, Tensor

from llamabatch import ModelLoadError
from llamabatch._ffi.model import Model
from llamabatch.gguf.check import check_gguf

# --------------------------------------------------------------------------- semantic cases


def _tokens(g: GGUF, fn: Callable[[list[bytes]], None]) -> None:
    tokens = list(g.tokens)
    fn(tokens)
    g.set(Keys.Tokenizer.LIST, VT.ARRAY, tokens, VT.STRING)


def _tensor(name: str, fn: Callable[[Tensor], None]) -> Callable[[GGUF], None]:
    def edit(g: GGUF) -> None:
        t = g.tensor(name)
        assert t is not None
        fn(t)

    return edit


def _retype(t: Tensor, ttype: Q) -> None:
    t.type = int(ttype)
    t.data = bytes(len(t.data) // 4 * {Q.F16: 2, Q.I16: 2, Q.I32: 4, Q.F64: 8}.get(ttype, 4))


SEMANTIC_CASES: list[tuple[str, str, Callable[[GGUF], object], tuple[str, ...]]] = [
    # vocabulary
    (
        "empty_collides",
        "llama",
        lambda g: _tokens(g, lambda t: t.__setitem__(slice(259, 261), [b"", b"[EMPTY_259]"])),
        ("tokenizer.ggml.tokens", "token 260 '[EMPTY_259]' duplicates token 259"),
    ),
    (
        "unknown_tokenizer",
        "llama",
        set_key(Keys.Tokenizer.MODEL, VT.STRING, b"sentencepiece"),
        ("tokenizer.ggml.model", "unknown tokenizer 'sentencepiece'"),
    ),
    (
        "tokens_not_strings",
        "llama",
        set_key(Keys.Tokenizer.LIST, VT.ARRAY, [1, 2, 3], VT.INT32),
        ("tokenizer.ggml.tokens", "must be an array of strings, is an array of 3 INT32"),
    ),
    ("no_tokens", "bert", lambda g: g.drop(Keys.Tokenizer.LIST), ("tokenizer.ggml.tokens", "missing")),
    (
        "scores_short",
        "llama",
        lambda g: g.get(Keys.Tokenizer.SCORES).value.pop(),  # type: ignore[union-attr]
        ("tokenizer.ggml.scores", "has 319 entries for 320 tokens"),
    ),
    (
        "scores_nan",
        "llama",
        lambda g: g.get(Keys.Tokenizer.SCORES).value.__setitem__(7, math.nan),  # type: ignore[union-attr]
        ("tokenizer.ggml.scores", "token 7 has score nan"),
    ),
    (
        "token_type_invalid",
        "bert",
        lambda g: g.get(Keys.Tokenizer.TOKEN_TYPE).value.__setitem__(9, 7),  # type: ignore[union-attr]
        ("tokenizer.ggml.token_type", "token 9 has type 7"),
    ),
    (
        "token_types_uint8",
        "llama",
        lambda g: setattr(g.get(Keys.Tokenizer.TOKEN_TYPE), "item_type", VT.UINT8),
        ("tokenizer.ggml.token_type", "must be an array of INT32"),
    ),
    (
        "special_id_out_of_range",
        "llama",
        set_key(Keys.Tokenizer.EOS_ID, VT.UINT32, 320),
        ("tokenizer.ggml.eos_token_id", "token id 320 is out of range [0, 320)"),
    ),
    (
        "special_id_huge",
        "bert",
        set_key(Keys.Tokenizer.SEP_ID, VT.UINT32, 2**32 - 1),
        ("tokenizer.ggml.seperator_token_id", "4294967295 is out of range"),
    ),
    (
        "special_id_not_int",
        "llama",
        set_key(Keys.Tokenizer.BOS_ID, VT.FLOAT32, 1.0),
        ("tokenizer.ggml.bos_token_id", "must be an integer, is a FLOAT32"),
    ),
    (
        "missing_byte_token",
        "llama",
        lambda g: _tokens(g, lambda t: t.__setitem__(3 + 0xC3, b"nobyte")),
        ("tokenizer.ggml.tokens", "without the byte token <0xC3>"),
    ),
    (
        "wordpiece_without_marker",
        "bert",
        lambda g: _tokens(
            g, lambda t: t.__setitem__(slice(None), [x.replace("\u2581".encode(), b"#") for x in t])
        ),
        ("tokenizer.ggml.model", "no token starts with the word marker"),
    ),
    (
        "wordpiece_without_unk",
        "bert",
        lambda g: g.drop(Keys.Tokenizer.UNK_ID),
        ("tokenizer.ggml.unknown_token_id", "missing"),
    ),
    (
        "bpe_without_merges",
        "llama",
        set_key(Keys.Tokenizer.MODEL, VT.STRING, b"gpt2"),
        ("tokenizer.ggml.merges", "missing: a 'gpt2' (BPE) tokenizer needs merges"),
    ),
    (
        "bpe_bad_merge",
        "llama",
        lambda g: (
            g.set(Keys.Tokenizer.MODEL, VT.STRING, b"gpt2"),
            g.set(Keys.Tokenizer.MERGES, VT.ARRAY, [b"a b", b"ab"], VT.STRING),
        ),
        ("tokenizer.ggml.merges", "merge 1 'ab' is not two pieces separated by one space"),
    ),
    (
        "rwkv_on_llama_vocab",
        "llama",
        set_key(Keys.Tokenizer.MODEL, VT.STRING, b"rwkv"),
        ("tokenizer.ggml.tokens", "RWKV vocabulary without the single-byte token"),
    ),
    (
        "add_flag_not_bool",
        "llama",
        set_key(Keys.Tokenizer.ADD_BOS, VT.UINT8, 1),
        ("tokenizer.ggml.add_bos_token", "must be a bool, is a UINT8"),
    ),
    # hyper-parameters
    (
        "block_count_missing",
        "bert",
        lambda g: g.drop("bert.block_count"),
        ("bert.block_count", "missing (required)"),
    ),
    (
        "block_count_string",
        "llama",
        set_key("llama.block_count", VT.STRING, b"2"),
        ("llama.block_count", "must be an integer"),
    ),
    (
        "block_count_too_few",
        "llama",
        set_key("llama.block_count", VT.UINT32, 1),
        ("tensor 'blk.1.attn_norm.weight'", "not part of a llama model"),
    ),
    (
        "block_count_too_many",
        "bert",
        set_key("bert.block_count", VT.UINT32, 3),
        ("tensor 'blk.2.attn_q.weight'", "missing"),
    ),
    (
        "context_length_0",
        "llama",
        set_key("llama.context_length", VT.UINT32, 0),
        ("llama.context_length", "must be positive"),
    ),
    (
        "embedding_length_mismatch",
        "llama",
        set_key("llama.embedding_length", VT.UINT32, 64),
        ("llama.rope.dimension_count", "8, but llama needs the head size 16"),
    ),
    (
        "head_count_0",
        "bert",
        set_key("bert.attention.head_count", VT.UINT32, 0),
        ("bert.attention.head_count", "layer 0 has 0 attention heads"),
    ),
    (
        "heads_do_not_divide",
        "bert",
        set_key("bert.attention.head_count", VT.UINT32, 5),
        ("bert.attention.head_count", "5 heads do not divide embedding_length 32"),
    ),
    (
        "kv_heads_do_not_divide",
        "llama",
        set_key("llama.attention.head_count_kv", VT.UINT32, 3),
        ("llama.attention.head_count_kv", "3 key-value heads do not divide 4 heads"),
    ),
    (
        "head_count_array_length",
        "llama",
        set_key("llama.attention.head_count", VT.ARRAY, [4, 4, 4], VT.UINT32),
        ("llama.attention.head_count", "has 3 values, one per layer expected (2)"),
    ),
    (
        "feed_forward_mismatch",
        "llama",
        set_key("llama.feed_forward_length", VT.UINT32, 65),
        ("tensor 'blk.0.ffn_gate.weight'", "has shape [32, 64], the hyper-parameters imply [32, 65]"),
    ),
    (
        "key_value_lengths_differ",
        "bert",
        set_key("bert.attention.key_length", VT.UINT32, 16),
        ("bert.attention.value_length", "key length 16 and value length 8 differ"),
    ),
    (
        "layer_norm_eps_zero",
        "bert",
        set_key("bert.attention.layer_norm_epsilon", VT.FLOAT32, 0.0),
        ("bert.attention.layer_norm_epsilon", "0 must be positive"),
    ),
    (
        "layer_norm_eps_inf",
        "bert",
        set_key("bert.attention.layer_norm_epsilon", VT.FLOAT64, math.inf),
        ("bert.attention.layer_norm_epsilon", "inf is not a finite number"),
    ),
    (
        "rms_eps_missing",
        "llama",
        lambda g: g.drop("llama.attention.layer_norm_rms_epsilon"),
        ("llama.attention.layer_norm_rms_epsilon", "missing (required)"),
    ),
    (
        "rope_freq_base_0",
        "llama",
        set_key("llama.rope.freq_base", VT.FLOAT32, 0.0),
        ("llama.rope.freq_base", "must be positive"),
    ),
    (
        "rope_scaling_unknown",
        "llama",
        set_key("llama.rope.scaling.type", VT.STRING, b"bogus"),
        ("llama.rope.scaling.type", "unknown RoPE scaling 'bogus'"),
    ),
    (
        "rope_dimension_odd",
        "llama",
        set_key("llama.rope.dimension_count", VT.UINT32, 7),
        ("llama.rope.dimension_count", "7, but llama needs the head size 8"),
    ),
    (
        "experts_used_without_experts",
        "llama",
        set_key("llama.expert_used_count", VT.UINT32, 2),
        ("llama.expert_used_count", "2 experts used per token, but only 0 experts"),
    ),
    (
        "experts_none_used",
        "bert",
        set_key("bert.expert_count", VT.UINT32, 4),
        ("bert.expert_used_count", "missing or 0, with 4 experts"),
    ),
    (
        "experts_too_many",
        "llama",
        set_key("llama.expert_count", VT.UINT32, 2000),
        ("llama.expert_count", "2000 experts"),
    ),
    (
        "nextn_beyond_layers",
        "bert",
        set_key("bert.nextn_predict_layers", VT.UINT32, 3),
        ("bert.nextn_predict_layers", "3 exceeds block_count 2"),
    ),
    (
        "vocab_size_mismatch",
        "llama",
        set_key("llama.vocab_size", VT.UINT32, 321),
        ("llama.vocab_size", "321 but tokenizer.ggml.tokens holds 320 tokens"),
    ),
    (
        "pooling_unknown",
        "bert",
        set_key("bert.pooling_type", VT.UINT32, 7),
        ("bert.pooling_type", "unknown pooling type 7"),
    ),
    (
        "token_type_count_0",
        "bert",
        set_key(Keys.Tokenizer.TOKEN_TYPE_COUNT, VT.UINT32, 0),
        ("tokenizer.ggml.token_type_count", "bert needs token types"),
    ),
    # architecture
    (
        "architecture_missing",
        "llama",
        lambda g: g.drop(Keys.General.ARCHITECTURE),
        ("general.architecture", "missing (required)"),
    ),
    (
        "architecture_not_string",
        "bert",
        set_key(Keys.General.ARCHITECTURE, VT.UINT32, 1),
        ("general.architecture", "must be a string, is a UINT32"),
    ),
    (
        "architecture_swapped",
        "llama",
        set_key(Keys.General.ARCHITECTURE, VT.STRING, b"bert"),
        ("bert.context_length", "missing (required)"),
    ),
    # tensors
    (
        "tensor_missing",
        "llama",
        lambda g: g.tensors.remove(g.tensor("blk.1.ffn_up.weight")),
        ("tensor 'blk.1.ffn_up.weight'", "missing (a llama model needs it)"),
    ),
    (
        "tensor_duplicate",
        "bert",
        lambda g: g.tensors.append(g.tensor("blk.0.attn_q.bias")),
        ("tensor 'blk.0.attn_q.bias'", "duplicate tensor"),
    ),
    (
        "tensor_unknown",
        "llama",
        lambda g: g.tensors.append(Tensor("cls.weight", [32], int(Q.F32), bytes(128))),
        ("tensor 'cls.weight'", "not part of a llama model"),
    ),
    (
        "tensor_transposed",
        "llama",
        _tensor("blk.0.ffn_down.weight", lambda t: t.dims.reverse()),
        ("tensor 'blk.0.ffn_down.weight'", "has shape [32, 64], the hyper-parameters imply [64, 32]"),
    ),
    (
        "token_embd_rows",
        "bert",
        _tensor(
            "token_embd.weight", lambda t: (t.dims.__setitem__(1, 110), setattr(t, "data", t.data[:-128]))
        ),
        ("tensor 'token_embd.weight'", "has shape [32, 110], the hyper-parameters imply [32, 111]"),
    ),
    (
        "norm_weight_quantized",
        "llama",
        _tensor("output_norm.weight", lambda t: _retype(t, Q.F16)),
        (
            "tensor 'output_norm.weight'",
            "type F16: llama.cpp needs F32 for norm weights, biases and token types",
        ),
    ),
    (
        "token_types_f16",
        "bert",
        _tensor("token_types.weight", lambda t: _retype(t, Q.F16)),
        ("tensor 'token_types.weight'", "type F16: llama.cpp needs F32"),
    ),
    (
        "bias_as_integers",
        "bert",
        _tensor("blk.1.ffn_up.bias", lambda t: _retype(t, Q.I32)),
        ("tensor 'blk.1.ffn_up.bias'", "type I32"),
    ),
    (
        "matrix_as_integers",
        "llama",
        _tensor("blk.0.attn_q.weight", lambda t: _retype(t, Q.I16)),
        ("tensor 'blk.0.attn_q.weight'", "type I16 cannot be a weight matrix"),
    ),
    (
        "matrix_as_f64",
        "bert",
        _tensor("blk.0.ffn_up.weight", lambda t: _retype(t, Q.F64)),
        ("tensor 'blk.0.ffn_up.weight'", "type F64 cannot be a weight matrix"),
    ),
]


@pytest.mark.parametrize(
    ("base", "edit", "fragments"), [c[1:] for c in SEMANTIC_CASES], ids=[c[0] for c in SEMANTIC_CASES]
)
def test_semantic_cases(
    bases: Bases, tmp_path: Path, base: str, edit: Callable[[GGUF], object], fragments: tuple[str, ...]
) -> None:
    rejects(write_model(tmp_path, edited(bases, base, edit)), *fragments)


def test_missing_special_token_found_after_loading(bases: Bases, tmp_path: Path) -> None:
    """Unigram adds BOS when asked and has no default one: llama.cpp would assert at tokenize."""

    def edit(g: GGUF) -> None:
        g.set(Keys.Tokenizer.MODEL, VT.STRING, b"t5")
        g.drop(Keys.Tokenizer.BOS_ID)
        g.set(Keys.Tokenizer.ADD_BOS, VT.BOOL, True)

    path = write_model(tmp_path, edited(bases, "llama", edit))
    check_gguf(path)  # the ids are fine; what llama.cpp makes of them is not
    with pytest.raises(
        ModelLoadError, match=r"tokenizer\.ggml\.bos_token_id: missing, but the tokenizer adds a BOS"
    ):
        Model(path)
