"""The Embedder against real llama.cpp, continued from ``test_embedder.py``: decode failures
retried by halving, texts longer than a sequence's cells, closing with calls pending,
telemetry, and the command line (``embed``, ``bench-embed``)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embed_models import THREADS, wait_for

from llamabatch import Embedder, EmbedderStats, EngineClosed, KVCacheFull, PromptTooLong
from llamabatch.cli import main
from llamabatch.gguf.testing import english_sentences
from llamabatch.runtime.telemetry import EmbedPackEvent

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
        wait_for(lambda: e.stats().queue_depth == 2)
        callers[1].start()
        wait_for(lambda: e.stats().queue_depth == 14)
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
    wait_for(lambda: e.stats().queue_depth == 65)
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
