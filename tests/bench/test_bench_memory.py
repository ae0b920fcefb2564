"""The issue-23 workloads (bench-chat, bench-layouts) on the tiny model: they run, count what
they should, and the chat completes over HTTP against ``llamabatch serve`` with its defaults."""

from __future__ import annotations

import argparse

import pytest

from llamabatch import LLM
from llamabatch.bench import chat, layouts
from llamabatch.cli import build_parser
from llamabatch.gguf.testing import model_path


def test_conversations_are_sized_by_the_tokenizer() -> None:
    conversations = chat.Conversations.make(3, 2, system_tokens=100, user_tokens=10, count=len)
    assert len(conversations.system) >= 100 and len(conversations.users) == 3
    assert all(len(turns) == 2 and all(len(u) >= 10 for u in turns) for turns in conversations.users)


def test_chat_in_process_more_conversations_than_slots() -> None:
    with LLM(str(model_path("tiny")), n_ctx=2048, n_parallel=2, n_threads=1) as llm:
        conversations = chat.Conversations.make(
            4, 3, system_tokens=120, user_tokens=10, count=lambda t: len(llm.tokenize(t))
        )
        result = chat.run_chat(chat.llm_backend(llm), conversations, reply_tokens=8)
        assert llm.stats().reused_tokens > 0  # later turns reuse the conversation so far
    summary = result.summary()
    assert summary["completed_turns"] == 12 and not summary["failures"]
    assert summary["ttft_p50_later_ms"] is not None


def test_chat_over_http_against_llamabatch_serve() -> None:
    pytest.importorskip("uvicorn")
    from test_server import serve

    from llamabatch.server import create_app

    with LLM(str(model_path("tiny")), n_ctx=2048, n_parallel=2, n_threads=1) as llm:
        with serve(create_app(llm, model_name="tiny")) as url:
            conversations = chat.Conversations.make(3, 2, system_tokens=100, user_tokens=10)
            result = chat.run_chat(chat.http_backend(url, "tiny"), conversations, reply_tokens=6)
            assert result.completed_turns == 6 and not result.failures
            # a prompt over the context is a counted failure, not a crash
            huge = chat.Conversations("word " * 5000, [["hi"]])
            refused = chat.run_chat(chat.http_backend(url, "tiny"), huge, reply_tokens=4)
            assert refused.completed_turns == 0 and sum(refused.failures.values()) == 1
            assert next(iter(refused.failures)).startswith("400")


def _args(**changes: object) -> argparse.Namespace:
    args = build_parser().parse_args(["bench-layouts", "-m", "tiny"])
    for key, value in {
        "threads": 1,
        "n_ctx": 2048,
        "n_parallel": 4,
        "max_tokens": 4,
        "shared_requests": 6,
        "prefix_tokens": 200,
        "long_tokens": 700,
        "conversations": 3,
        "turns": 2,
        **changes,
    }.items():
        setattr(args, key, value)
    return args


def test_layouts_shared_prefix_reuses_in_both_layouts() -> None:
    path = str(model_path("tiny"))
    rows = [
        layouts.run_layout(path, layout, "shared_prefix", _args()) for layout in ("per-stream", "unified")
    ]
    assert [r["n_ctx_seq"] for r in rows] == [512, 2048]
    assert all(r["reused_tokens"] > 0 and not r["failures"] for r in rows)
    # same schedule (ticks, tokens, reuse), but per-stream holds a copy of the shared prefix per
    # stream, so every decode tick attends several times the KV cells (README: the shared-prefix gap)
    per_stream, unified = rows
    for key in ("ticks", "tokens_per_tick", "reused_tokens", "prefill_tokens"):
        assert per_stream[key] == unified[key]
    assert per_stream["kv_cells_per_tick"] > 2 * unified["kv_cells_per_tick"]


def test_layouts_uniform_and_mixed_run_every_layout_on_the_workloads_slots() -> None:
    path = str(model_path("tiny"))
    args = _args(npl=3, ntg=4, npp=16, mixed_requests=4, rate=50.0, mixed_slots=2)
    for layout in layouts.LAYOUTS:
        uniform = layouts.run_layout(path, layout, "uniform", args)
        assert uniform["tok_s"] > 0 and uniform["prefill_tokens"] == 3 * 16 and not uniform["failures"]
        mixed = layouts.run_layout(path, layout, "mixed", args)
        assert mixed["tok_s"] > 0 and mixed["ttft_p90_ms"] >= mixed["ttft_p50_ms"] and not mixed["failures"]
    # the defaults' slots are the workload's: 3 streams of the trained context, flash attention off
    assert uniform["n_ctx"] == 3 * 4096 and uniform["flash_attn"] == "auto"


def test_layouts_long_prompt_is_refused_per_stream_only() -> None:
    path = str(model_path("tiny"))
    per_stream = layouts.run_layout(path, "per-stream", "long_among_short", _args())
    unified = layouts.run_layout(path, "unified", "long_among_short", _args())
    assert per_stream["failures"] == {"PromptTooLong": 1}  # 700 tokens > 2048 / 4 per stream
    assert not unified["failures"]
    defaults = layouts.run_layout(path, "defaults", "long_among_short", _args())
    # the tiny model's trained context in each stream (per-stream fits the budget), a stream a slot
    assert defaults["n_ctx"] == defaults["n_parallel"] * 4096 and defaults["n_parallel"] >= 8
    assert defaults["n_ctx_seq"] == 4096 and not defaults["failures"]


def test_issue_chat_completes_over_http_with_the_defaults() -> None:
    """Issue 23's "done when": 12 conversations x 4 turns with a ~450-token system prompt, more
    conversations than slots, complete against a server on LLM's defaults (no per-request cap
    below the trained context)."""
    pytest.importorskip("uvicorn")
    from test_server import serve

    from llamabatch.server import create_app

    with LLM(str(model_path("tiny")), n_threads=1) as llm:
        assert llm.n_ctx_seq == 4096  # the trained context, for every request
        with serve(create_app(llm, model_name="tiny")) as url:
            count = lambda text: len(llm.tokenize(text, add_special=False))  # noqa: E731
            conversations = chat.Conversations.make(12, 4, system_tokens=450, count=count)
            result = chat.run_chat(chat.http_backend(url, "tiny"), conversations, reply_tokens=16)
        stats = llm.stats()
    assert result.completed_turns == 48 and not result.failures
    assert stats.reused_tokens > 0
    # the old defaults (n_ctx=4096 in 8 streams: 512 tokens a request) refuse the later turns
    with LLM(str(model_path("tiny")), n_ctx=4096, kv_unified=False, n_threads=1) as old:
        with serve(create_app(old, model_name="tiny")) as url:
            refused = chat.run_chat(chat.http_backend(url, "tiny"), conversations, reply_tokens=16)
    assert refused.completed_turns < 48
    assert set(refused.failures) == {"400 context_length_exceeded"}
