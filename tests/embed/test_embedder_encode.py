"""The Embedder's sentence-transformers-style ``encode`` (shapes, batch sizes, options, token
embeddings, progress bar) and ``embed`` details, against real llama.cpp, with the fixtures of
``conftest.py``."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embed_models import MIN_COSINE, REFERENCE, THREADS, cosine, wait_for

from llamabatch import Embedder, EngineClosed, PromptTooLong
from llamabatch.gguf.testing import english_sentences
from llamabatch.runtime.telemetry import EmbedPackEvent

# --------------------------------------------------------------------------- sentence-transformers' encode


def test_encode_as_a_sentence_transformers_user_calls_it(
    bert: Embedder, sentences: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    model = bert  # the one line a sentence-transformers user changes
    vectors = model.encode(sentences, batch_size=64, normalize_embeddings=True, show_progress_bar=True)
    reference = np.load(REFERENCE)
    assert (
        isinstance(vectors, np.ndarray) and vectors.dtype == np.float32 and vectors.shape == reference.shape
    )
    assert cosine(vectors, reference).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    err = capsys.readouterr().err
    assert f"{len(sentences)}/{len(sentences)}" in err and "Embedding" in err  # tqdm, per text, on stderr
    one = model.encode(sentences[3])
    assert one.shape == (384,) and cosine(one, reference[3]) >= MIN_COSINE


def test_encode_shapes_and_batch_size(llama: Embedder) -> None:
    texts = english_sentences(23)
    expected = llama.embed(texts)
    before = llama.stats().calls
    for batch_size in (1, 5, 32, 1000):  # texts queued at a time: the packs, and vectors, do not change
        np.testing.assert_allclose(llama.encode(texts, batch_size=batch_size), expected, atol=2e-4)
    assert llama.stats().calls == before + 4  # one call each, however many jobs
    np.testing.assert_allclose(llama.encode(tuple(texts)), expected, atol=2e-4)
    np.testing.assert_allclose(llama.encode(np.array(texts)), expected, atol=2e-4)
    single = llama.encode(texts[2])
    assert single.shape == (64,) and single.dtype == np.float32
    np.testing.assert_allclose(single, expected[2], atol=2e-4)
    assert llama.encode([]).shape == (0, 64)


def test_encode_options(llama: Embedder) -> None:
    texts = english_sentences(12)
    full = llama.encode(texts)
    # prompt: put in front of every text
    np.testing.assert_allclose(
        llama.encode(texts[:3], prompt="query: "), llama.embed([f"query: {t}" for t in texts[:3]]), atol=2e-4
    )
    # truncate_dim, then normalize_embeddings, in sentence-transformers' order
    cut = llama.encode(texts, truncate_dim=16)
    np.testing.assert_allclose(cut, full[:, :16], atol=1e-6)
    unit = llama.encode(texts, truncate_dim=16, normalize_embeddings=True)
    np.testing.assert_allclose(unit, cut / np.linalg.norm(cut, axis=1, keepdims=True), atol=1e-6)
    # precision: per-dimension ranges from these embeddings, or 1 bit per dimension
    low, high = full.min(axis=0), full.max(axis=0)
    buckets = (full - low) / ((high - low) / 255)
    np.testing.assert_array_equal(llama.encode(texts, precision="uint8"), buckets.astype(np.uint8))
    np.testing.assert_array_equal(llama.encode(texts, precision="int8"), (buckets - 128).astype(np.int8))
    bits = np.packbits(full > 0, axis=1)
    assert bits.shape == (12, 8)
    np.testing.assert_array_equal(llama.encode(texts, precision="ubinary"), bits)
    np.testing.assert_array_equal(
        llama.encode(texts, precision="binary"), (bits.astype(int) - 128).astype(np.int8)
    )
    # torch output only when torch is there, with a clear error otherwise
    try:
        import torch
    except ImportError:
        with pytest.raises(ImportError, match="torch is not installed"):
            llama.encode(texts, convert_to_tensor=True)
        with pytest.raises(ImportError, match="convert_to_numpy=False"):
            llama.encode(texts, convert_to_numpy=False)
    else:
        tensor = llama.encode(texts, convert_to_tensor=True)
        assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (12, 64)
        rows = llama.encode(texts, convert_to_numpy=False)
        assert isinstance(rows, list) and len(rows) == 12 and tuple(rows[0].shape) == (64,)
    assert llama.encode(texts[0], device=None).shape == (64,)  # one device: accepted (fixed at construction)
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"precision": "float16"}, ValueError, "precision"),
        ({"prompt_name": "query"}, ValueError, "prompt_name"),
        ({"output_value": "token_embeddings"}, ValueError, "pooling='none'"),
        ({"output_value": None}, ValueError, "output_value"),
        ({"truncate_dim": 0}, ValueError, "truncate_dim"),
        ({"device": ["cpu", "cpu"]}, ValueError, "multi-process"),
        ({"pool": {}}, ValueError, "multi-process"),
        ({"chunk_size": 10}, ValueError, "multi-process"),
        ({"convert_to_tensr": True}, TypeError, "convert_to_tensr"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            llama.encode(texts, **kwargs)
    with pytest.raises(TypeError, match="bytes"):
        llama.encode(b"raw bytes")  # type: ignore[arg-type]
    assert llama.encode(texts[:2], prompt="q: ", prompt_name="ignored").shape == (2, 64)
    # a text too long, in a later batch: the call fails naming it, the queued batches are dropped
    too_long = " ".join(english_sentences(80))
    with pytest.raises(PromptTooLong, match="text 5 "):
        llama.encode([*texts[:5], too_long], batch_size=2)
    np.testing.assert_allclose(llama.encode(texts), full, atol=2e-4)
    wait_for(lambda: llama.stats().pending_tokens == 0)


def test_encode_token_embeddings(tiny: Path) -> None:
    texts = english_sentences(4)
    with Embedder(tiny, pooling="none", normalize="none", n_threads=THREADS) as e:
        per_token = e.embed(texts)
        got = e.encode(texts, output_value="token_embeddings")
        assert isinstance(got, list) and len(got) == 4
        for a, b in zip(got, per_token, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-4)
        one = e.encode(texts[1], output_value="token_embeddings")
        assert one.shape == per_token[1].shape
        with pytest.raises(ValueError, match="token_embeddings"):
            e.encode(texts)  # a sentence embedding needs a pooling


def test_embed_single_string_and_per_call_normalize(llama: Embedder) -> None:
    texts = english_sentences(6)
    unit = llama.embed(texts)
    raw = llama.embed(texts, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), unit, atol=1e-5)
    np.testing.assert_allclose(np.abs(llama.embed(texts, normalize="max_abs")).max(axis=1), 1.0, rtol=1e-6)
    assert llama.normalize == "l2"  # the Embedder's own setting did not change
    one = llama.embed(texts[0])
    assert one.shape == (64,) and one.dtype == np.float32
    np.testing.assert_allclose(one, unit[0], atol=2e-4)
    with pytest.raises(ValueError, match="normalize"):
        llama.embed(texts, normalize="l1")

    async def run() -> tuple[Any, Any]:
        return await llama.aembed(texts[0]), await llama.aembed(texts, normalize="none")

    a_one, a_raw = asyncio.run(run())
    assert a_one.shape == (64,)
    np.testing.assert_allclose(a_one, unit[0], atol=2e-4)
    np.testing.assert_allclose(a_raw, raw, atol=2e-4)


def test_progress_bar(llama: Embedder, capsys: pytest.CaptureFixture[str]) -> None:
    texts = english_sentences(7)
    llama.embed(texts, show_progress_bar=True)
    assert "7/7" in capsys.readouterr().err
    llama.embed(texts)  # the default, as sentence-transformers': only when the logger is at INFO or DEBUG
    llama.encode(texts)
    assert capsys.readouterr().err == ""
    lb_logger = logging.getLogger("llamabatch")
    level = lb_logger.level
    lb_logger.setLevel(logging.INFO)
    try:
        llama.encode(texts, batch_size=2)
        assert "7/7" in capsys.readouterr().err
        llama.encode(texts, show_progress_bar=False)
        assert "7/7" not in capsys.readouterr().err
    finally:
        lb_logger.setLevel(level)

    async def run() -> Any:
        return await llama.aembed(texts, show_progress_bar=True)

    asyncio.run(run())
    assert "7/7" in capsys.readouterr().err


def _with_classifier_head(src: Path, dst: Path, weight: np.ndarray) -> None:
    """Copy a GGUF, adding ``cls.output.weight`` (a one-label classification head)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("cls.output.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_rank_pooling_needs_a_classification_head(tiny: Path, minilm: Path, tmp_path: Path) -> None:
    for headless in (tiny, minilm):
        with pytest.raises(ValueError, match="classification head"):
            Embedder(headless, pooling="rank", n_threads=THREADS)
    weight = np.random.default_rng(0).standard_normal((1, 384)).astype(np.float32)
    reranker = tmp_path / "minilm-head.gguf"
    _with_classifier_head(minilm, reranker, weight)
    texts = ["a cat sat on the mat", "the weather is fine", ""]
    # validate=False: this test writes the file, and tests the head, not the validator
    with Embedder(reranker, pooling="rank", n_threads=THREADS, validate=False) as rank:
        assert rank.model.has_classifier_head and rank.n_out == 1
        scores = rank.embed(texts)
        single = rank.embed(texts[0])
    with Embedder(reranker, pooling="cls", normalize="none", n_threads=THREADS, validate=False) as cls:
        expected = cls.embed(texts) @ weight[0]  # the head applied to the [CLS] hidden state
    assert scores.shape == (3,)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4)
    assert np.isclose(single, scores[0], atol=1e-4)


def test_close_from_a_listener_is_deferred(tiny: Path) -> None:
    e = Embedder(tiny, pooling="mean", n_batch=128, n_seq_max=2, n_threads=THREADS)
    seen: list[Any] = []

    def listener(event: EmbedPackEvent) -> None:
        seen.append(event)
        try:
            e.embed(["from the worker thread"])
        except RuntimeError as exc:  # it would wait for itself
            seen.append(exc)
        e.close()  # on the worker thread: takes effect when this pack ends
        seen.append(("after close", e.closed, e.context.closed))

    e.add_listener(listener)
    with pytest.raises(EngineClosed):
        e.embed(english_sentences(20))  # needs many packs: the first one closes the embedder
    e._worker.join(10)
    assert not e._worker.alive
    assert isinstance(seen[0], EmbedPackEvent) and isinstance(seen[1], RuntimeError)
    assert seen[2] == ("after close", True, False)  # not freed under the running pack
    assert len(seen) == 3  # no pack ran after the one that closed
    assert e.closed and e.context.closed and e._core.pool.n_outstanding == 0
    with pytest.raises(EngineClosed):
        e.embed(["after close"])
    e.close()
