"""bench-chat's counts (``later_turns``, ``engine``): what each later turn computed and what
the caches gave back, in-process and over HTTP, on the tiny model (no timings asserted)."""

from __future__ import annotations

import json

import pytest

from llamabatch import LLM
from llamabatch.bench import chat
from llamabatch.cli import main as cli_main
from llamabatch.gguf.testing import model_path

OLD_KEYS = {"where", "conversations", "turns", "t_total_s", "ttft_p50_later_ms", "ttft_p50_all_ms"}


def test_usage_of_both_servers_chunks() -> None:
    ours = {"choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 8, "total_tokens": 98,
                                     "prompt_tokens_details": {"cached_tokens": 70}}}  # fmt: skip
    expected = {"prompt_tokens": 90, "cached_tokens": 70, "completion_tokens": 8}
    assert chat.chunk_usage(ours) == expected
    llama_server = {"choices": [{"text": ""}], "timings": {"cache_n": 70, "prompt_n": 20, "predicted_n": 8}}
    assert chat.chunk_usage(llama_server) == expected
    assert chat.chunk_usage({"choices": [{"text": "x"}]}) is None
    row = chat.turn_counts({"prompt_tokens": 200, "cached_tokens": 150, "completion_tokens": 8}, before=160)
    assert row == {"prompt": 200, "cached": 150, "computed": 50, "new": 40, "history_recomputed": 10}


def _check_counts(summary: dict, n_later: int) -> None:
    later = summary["later_turns"]
    assert later["n"] == n_later
    assert later["computed_total"] == later["prompt_total"] - later["cached_total"]
    assert 0 <= later["history_recomputed_total"] <= later["computed_total"]
    assert later["new_total"] > 0


def test_in_process_counts_and_engine_counters(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench-chat", "-m", "tiny", "-t", "1", "-np", "2", "-c", "2048", "--conversations", "4"]
    args += ["--turns", "3", "--system-tokens", "100", "--user-tokens", "10", "--reply-tokens", "8", "--json"]
    assert cli_main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert OLD_KEYS <= set(summary) and summary["completed_turns"] == 12
    _check_counts(summary, 8)
    engine = summary["engine"]
    assert engine["ram_cache_restores"] > 0 and engine["ram_cache_restored_tokens"] > 0
    assert engine["ram_cache_hits"] >= engine["ram_cache_restores"]
    assert engine["kv_cells_per_tick"] > 100
    # (not ``cached_total >= ram_cache_restored_tokens``: a restored state can be evicted or
    # its request preempted before the turn's usage counts it, which a run shows now and then)
    assert summary["later_turns"]["cached_total"] > 0


def test_counts_over_http_against_llamabatch_serve() -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    from test_server import serve

    from llamabatch.server import create_app

    with LLM(str(model_path("tiny")), n_ctx=2048, n_parallel=2, n_threads=1) as llm:
        with serve(create_app(llm, model_name="tiny")) as url:
            count = lambda text: len(llm.tokenize(text, add_special=False))  # noqa: E731
            conversations = chat.Conversations.make(4, 3, system_tokens=100, user_tokens=10, count=count)
            before = chat.metrics_counters(url)
            result = chat.run_chat(chat.http_backend(url, "tiny"), conversations, reply_tokens=8)
            result.engine = chat.engine_delta(before, chat.metrics_counters(url))
        stats = llm.stats()
    summary = result.summary()
    assert summary["completed_turns"] == 12 and not summary["failures"]
    _check_counts(summary, 8)
    assert result.engine["ram_cache_restores"] == stats.ram_cache_restores > 0
    assert result.engine["ram_cache_restored_tokens"] == stats.ram_cache_restored_tokens
