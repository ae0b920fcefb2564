"""``llamabatch bench-chat``: multi-turn chat with more conversations than slots.

``C`` conversations run at once, each ``T`` turns; they share a system prompt of about
``--system-tokens`` tokens. Every turn's prompt is the whole conversation so far (the system
prompt, the earlier user messages and replies) plus a new user message, as a chat client
sends it. A conversation sends its next turn as soon as its reply is complete.

Over HTTP (``--url``) the requests are ``POST /v1/completions`` with a text prompt,
``max_tokens``, ``temperature: 0``, ``ignore_eos`` and ``stream: true``, which
``llamabatch serve`` and llama.cpp's ``llama-server`` accept alike, so both servers get the same
requests. Without ``--url`` the same conversations run through an in-process ``LLM`` built
with the engine flags given (``EngineConfig``'s defaults when none are).

Reported: the total time, the time to first token (p50 of the later turns, turn >= 2, and
of all turns), and the requests that failed (a server's ``400 context_length_exceeded``, say).
Also, as counts (``later_turns``): per later turn, its prompt tokens, those the server took from a
cache (``cached``) and those it computed; ``history_recomputed`` is what it computed beyond the
turn's new tokens (the conversation so far that no cache held: the target of a prompt cache),
``new`` = the prompt minus the previous turn's prompt and reply. Token counts come from the
usage the server reports (``llamabatch serve``: ``usage.prompt_tokens_details.cached_tokens``
with ``stream_options.include_usage``; llama-server: ``timings.cache_n``/``prompt_n``). The engine's
RAM-tier and scheduling counters (``engine``: restores, restored tokens, hits, misses, saves,
preemptions...) come from ``stats()`` in-process, from ``/metrics`` over HTTP where it answers;
in-process also ``kv_cells_per_tick``, the KV cells in use per tick (shared cells once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llamabatch.bench import options
from llamabatch.config import EngineConfig
from llamabatch.gguf.testing import english_sentences

__all__ = [
    "ChatResult",
    "Conversations",
    "add_arguments",
    "count_summary",
    "http_backend",
    "main",
    "run_chat",
]

#: a backend: (prompt text, max_tokens) -> (seconds to the first token, the reply's text), or
#: with a third item, the usage counts (``prompt_tokens``, ``cached_tokens``, ``completion_tokens``)
Backend = Callable[[str, int], "tuple[float, str] | tuple[float, str, dict[str, int]]"]

#: the engine counters reported as ``engine`` (``GenerationStats`` fields; ``/metrics`` gauges)
ENGINE_COUNTERS = (
    "ram_cache_hits",
    "ram_cache_misses",
    "ram_cache_saves",
    "ram_cache_restores",
    "ram_cache_restored_tokens",
    "ram_cache_restore_failures",
    "ram_cache_evictions",
    "preemptions",
    "evictions",
    "prefill_tokens",
    "reused_tokens",
)


@dataclass(frozen=True)
class Conversations:
    """What the conversations say: a shared system prompt and each one's user messages."""

    system: str
    users: list[list[str]]  # [conversation][turn]

    @classmethod
    def make(
        cls,
        n_conversations: int,
        n_turns: int,
        system_tokens: int = 450,
        user_tokens: int = 40,
        count: Callable[[str], int] | None = None,
    ) -> Conversations:
        """Sentences from the project's docstrings; ``count`` tokenizes (default: ~4 characters
        a token) to size the system prompt and the user messages."""
        count = count or (lambda text: len(text) // 4)
        pool = english_sentences(2000)
        system, i = "You are a helpful assistant.", 0
        while count(system) < system_tokens:
            system += " " + pool[i % len(pool)]
            i += 1
        users: list[list[str]] = []
        for _ in range(n_conversations):
            turns = []
            for _ in range(n_turns):
                text = ""
                while count(text) < user_tokens:
                    text += " " + pool[i % len(pool)]
                    i += 1
                turns.append(text.strip())
            users.append(turns)
        return cls(system, users)


@dataclass
class ChatResult:
    """One run: total seconds, each request's (turn, seconds to the first token), failures."""

    wall_s: float = 0.0
    ttfts: list[tuple[int, float]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    completed_turns: int = 0
    #: per later turn whose server reported usage: prompt, cached, computed, new tokens
    later_counts: list[dict[str, int]] = field(default_factory=list)
    #: the engine's counters over the run (``ENGINE_COUNTERS``), where known
    engine: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        later = [t for turn, t in self.ttfts if turn >= 1]
        every = [t for _, t in self.ttfts]
        out: dict[str, Any] = {
            "t_total_s": round(self.wall_s, 3),
            "ttft_p50_later_ms": round(statistics.median(later) * 1000, 1) if later else None,
            "ttft_p50_all_ms": round(statistics.median(every) * 1000, 1) if every else None,
            "completed_turns": self.completed_turns,
            "failures": dict(self.failures),
        }
        if self.later_counts:
            out["later_turns"] = count_summary(self.later_counts)
        if self.engine:
            out["engine"] = dict(self.engine)
        return out


def count_summary(rows: list[dict[str, int]]) -> dict[str, Any]:
    """Totals and medians of the later turns' token counts (see the module doc)."""
    out: dict[str, Any] = {"n": len(rows)}
    for key in ("prompt", "cached", "computed", "new", "history_recomputed"):
        values = [r[key] for r in rows]
        out[f"{key}_total"] = sum(values)
        out[f"{key}_p50"] = statistics.median(values)
        if key in ("computed", "history_recomputed"):
            out[f"{key}_max"] = max(values)
    return out


def run_chat(backend: Backend, conversations: Conversations, reply_tokens: int = 64) -> ChatResult:
    """Every conversation in a thread of its own, turn after turn; a failed turn ends its
    conversation (counted in ``failures`` by reason)."""
    result = ChatResult()
    lock = threading.Lock()

    def converse(users: list[str]) -> None:
        history = conversations.system
        before = 0  # the previous turn's prompt + reply tokens (usage), 0 before the first
        for turn, user in enumerate(users):
            history += f"\nUser: {user}\nAssistant:"
            try:
                ttft, reply, *rest = backend(history, reply_tokens)
            except Exception as exc:  # a benchmark counts failures, by reason
                with lock:
                    reason = getattr(exc, "reason_code", type(exc).__name__)
                    result.failures[reason] = result.failures.get(reason, 0) + 1
                return
            history += reply
            usage = rest[0] if rest else None
            with lock:
                result.ttfts.append((turn, ttft))
                result.completed_turns += 1
                if usage and turn >= 1 and before:
                    result.later_counts.append(turn_counts(usage, before))
            if usage:
                before = usage["prompt_tokens"] + usage["completion_tokens"]

    threads = [threading.Thread(target=converse, args=(users,), daemon=True) for users in conversations.users]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_s = time.perf_counter() - start
    return result


def turn_counts(usage: dict[str, int], before: int) -> dict[str, int]:
    """One later turn's counts from its usage; ``before``: the previous turn's prompt and
    reply tokens (what a cache could hold of this prompt)."""
    prompt, cached = usage["prompt_tokens"], usage["cached_tokens"]
    computed = prompt - cached
    new = max(0, prompt - before)
    return {
        "prompt": prompt,
        "cached": cached,
        "computed": computed,
        "new": new,
        "history_recomputed": max(0, computed - new),
    }


class HTTPFailure(RuntimeError):
    """A request the server refused (``reason_code``: the HTTP status and error code)."""

    def __init__(self, reason_code: str, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


def http_backend(url: str, model: str | None = None, timeout: float = 600.0) -> Backend:
    """Streaming ``/v1/completions`` requests to ``url``; the first chunk carrying text is the
    first token. The usage comes from the final chunks (``usage`` with
    ``stream_options.include_usage``, or llama-server's ``timings``) when the server sends it."""
    endpoint = url.rstrip("/") + "/v1/completions"

    def complete(prompt: str, max_tokens: int) -> tuple[float, str, dict[str, int]]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        request = urllib.request.Request(
            endpoint, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        ttft, parts = None, []
        usage: dict[str, int] = {}
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                for raw in response:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                    if text and ttft is None:
                        ttft = time.perf_counter() - start
                    parts.append(text)
                    usage = chunk_usage(chunk) or usage
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")
            try:
                code = json.loads(detail).get("error", {}).get("code") or ""
            except (ValueError, AttributeError):
                code = ""
            raise HTTPFailure(f"{exc.code} {code}".strip(), detail[:200]) from None
        return (ttft if ttft is not None else time.perf_counter() - start), "".join(parts), usage

    return complete


def chunk_usage(chunk: dict[str, Any]) -> dict[str, int] | None:
    """The token counts of a streamed chunk: OpenAI's ``usage`` (with
    ``prompt_tokens_details.cached_tokens``), else llama-server's ``timings``; None if neither."""
    usage = chunk.get("usage")
    if isinstance(usage, dict) and "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        return {
            "prompt_tokens": int(usage["prompt_tokens"]),
            "cached_tokens": int(details.get("cached_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
        }
    timings = chunk.get("timings")
    if isinstance(timings, dict) and "prompt_n" in timings:
        cached = int(timings.get("cache_n") or 0)
        return {
            "prompt_tokens": int(timings["prompt_n"]) + cached,
            "cached_tokens": cached,
            "completion_tokens": int(timings.get("predicted_n") or 0),
        }
    return None


def metrics_counters(url: str) -> dict[str, int]:
    """``ENGINE_COUNTERS`` a ``llamabatch serve`` exposes on ``/metrics`` (empty when it does
    not answer: llama-server without ``--metrics``, say)."""
    names = {f"llamabatch:{key}": key for key in ENGINE_COUNTERS}
    names["llamabatch:num_preemptions_total"] = "preemptions"
    out: dict[str, int] = {}
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return out
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        key = names.get(name.split("{", 1)[0])
        if key is not None:
            try:
                out[key] = out.get(key, 0) + int(float(value))
            except ValueError:
                continue
    return out


def engine_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What the counters grew by over the run (those known at both ends)."""
    return {k: after[k] - before[k] for k in ENGINE_COUNTERS if k in after and k in before}


def llm_backend(llm: Any) -> Backend:
    """The same requests through an in-process ``LLM`` (``llm.stream``)."""
    from llamabatch import SamplingParams

    def complete(prompt: str, max_tokens: int) -> tuple[float, str, dict[str, int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        ttft, parts = None, []
        usage: dict[str, int] = {}
        for delta in llm.stream(prompt, params):
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(delta.text)
            if delta.output is not None:
                u = delta.output.usage
                usage = {
                    "prompt_tokens": u.prompt_tokens,
                    "cached_tokens": u.reused_tokens,
                    "completion_tokens": u.completion_tokens,
                }
        return (ttft if ttft is not None else time.perf_counter() - start), "".join(parts), usage

    return complete


def stats_counters(llm: Any) -> dict[str, int]:
    """``ENGINE_COUNTERS`` from an in-process ``LLM``'s ``stats()``."""
    stats = llm.stats()
    return {k: int(getattr(stats, k)) for k in ENGINE_COUNTERS if getattr(stats, k, None) is not None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-chat``."""
    p.description = (
        "Multi-turn chat: C conversations (more than the server's slots) sharing a system prompt, "
        "T turns each, every turn resending the conversation so far. --url: over HTTP to any "
        "server with /v1/completions (llamabatch serve, llama-server); otherwise in-process with "
        "the engine flags given (EngineConfig's defaults when none are)."
    )
    p.add_argument("-m", "--model", default="135m", help="GGUF or a test-model preset (default: 135m)")
    p.add_argument("--url", default=None, help="a running server's base URL (default: run in-process)")
    p.add_argument("--served-model", default=None, help="the requests' model field (default: none)")
    p.add_argument("--conversations", type=options.positive_int, default=12, help="C (default 12)")
    p.add_argument("--turns", type=options.positive_int, default=4, help="T (default 4)")
    p.add_argument("--system-tokens", type=options.positive_int, default=450, help="default 450")
    p.add_argument("--user-tokens", type=options.positive_int, default=40, help="default 40")
    p.add_argument("--reply-tokens", type=options.positive_int, default=64, help="default 64")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    EngineConfig.add_cli_args(
        p,
        only=(
            "n_threads",
            "n_ctx",
            "n_parallel",
            "kv_unified",
            "type_k",
            "type_v",
            "flash_attn",
            "cache_ram",
        ),
        overrides={"n_threads": {"flags": ("-t", "--threads")}},
    )


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-chat``: run the conversations, print the summary."""
    from llamabatch._ffi.model import Model
    from llamabatch.bench.workloads import resolve_model

    model_path = str(resolve_model(args.model))
    with Model(model_path, vocab_only=True) as vocab:
        conversations = Conversations.make(
            args.conversations,
            args.turns,
            args.system_tokens,
            args.user_tokens,
            count=lambda text: len(vocab.tokenize(text, add_special=False)),
        )
    if args.url:
        before = metrics_counters(args.url)
        result = run_chat(http_backend(args.url, args.served_model), conversations, args.reply_tokens)
        result.engine = engine_delta(before, metrics_counters(args.url))
        where = args.url
    else:
        from llamabatch import LLM

        config = EngineConfig.from_cli_args(args)
        from llamabatch.runtime.telemetry import TickEvent

        with LLM(model_path, config=config) as llm:
            cells: list[int] = []  # KV cells in use per tick (shared cells once): what attention reads
            llm.add_listener(lambda e: cells.append(e.kv_cells_used) if isinstance(e, TickEvent) else None)
            before = stats_counters(llm)
            result = run_chat(llm_backend(llm), conversations, args.reply_tokens)
            result.engine = engine_delta(before, stats_counters(llm))
            result.engine["kv_cells_per_tick"] = round(statistics.mean(cells)) if cells else 0
            where = f"in-process (n_ctx={llm.n_ctx}, kv_unified={config.kv_unified})"
    summary = {"where": where, "conversations": args.conversations, "turns": args.turns, **result.summary()}
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0
