"""``llamabatch bench-prefix``: prefix-reuse workloads, each run with reuse on and off side by side.

- ``shared_system_prompt``: requests that share a long system prompt, each with a few
  unique tokens, all submitted at once: total time and median time to first token.
- ``multi_turn_chat``: conversations whose every turn resends the whole history (as a
  chat client does): prompt tokens actually computed, with and without reuse.

Conversations are built from token ids (prompt + the reply's tokens + the next user turn)
so that a history is a token prefix of the next turn, as it is for a real model whose
replies re-tokenize the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llamabatch import LLM, SamplingParams
from llamabatch.bench import options
from llamabatch.bench.report import Column, Report, ratio_columns, ratio_rows
from llamabatch.bench.runners.engine import completion
from llamabatch.gguf.testing import english_sentences

__all__ = [
    "PrefixRun",
    "add_arguments",
    "compare",
    "main",
    "multi_turn_chat",
    "prefix_report",
    "shared_system_prompt",
]


@dataclass(frozen=True)
class PrefixRun:
    """One workload run with reuse on or off."""

    prefix_cache: bool
    wall_s: float
    median_ttft_s: float
    prompt_tokens: int
    prefill_tokens: int
    reused_tokens: int


def _prompt_counters(llm: LLM) -> tuple[int, int]:
    """Prompt tokens the engine computed and reused so far."""
    stats = llm.stats()
    return stats.prefill_tokens, stats.reused_tokens


def _tokens_of(llm: LLM, text: str, n: int, add_special: bool = False) -> list[int]:
    tokens = llm.tokenize(text, add_special=add_special)
    while len(tokens) < n:
        tokens += tokens
    return tokens[:n]


def shared_system_prompt(
    model_path: str,
    *,
    n_requests: int = 16,
    system_tokens: int = 512,
    unique_tokens: int = 32,
    new_tokens: int = 32,
    n_parallel: int = 8,
    prefix_cache: bool = True,
    **llm_kwargs: Any,
) -> PrefixRun:
    """``n_requests`` prompts = one system prompt + unique tokens each, submitted at once."""
    sentences = english_sentences(n_requests + 200)
    n_ctx = n_parallel * (system_tokens + unique_tokens + new_tokens) + 512
    with LLM(model_path, n_ctx=n_ctx, n_parallel=n_parallel, prefix_cache=prefix_cache, **llm_kwargs) as llm:
        system = [llm.model.bos, *_tokens_of(llm, " ".join(sentences[:200]), system_tokens - 1)]
        prompts = [
            system + _tokens_of(llm, " " + sentences[200 + i], unique_tokens) for i in range(n_requests)
        ]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate([[llm.model.bos, 100, 200]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        if prefix_cache:
            llm.clear_prefix_cache()
        computed, reused = _prompt_counters(llm)
        start = time.perf_counter()
        outs = [completion(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        wall = time.perf_counter() - start
        computed_after, reused_after = _prompt_counters(llm)
    return PrefixRun(
        prefix_cache,
        wall,
        statistics.median(o.timings.time_to_first_token or 0.0 for o in outs),
        sum(o.usage.prompt_tokens for o in outs),
        computed_after - computed,
        reused_after - reused,
    )


def multi_turn_chat(
    model_path: str,
    *,
    n_conversations: int = 8,
    n_turns: int = 4,
    system_tokens: int = 128,
    user_tokens: int = 48,
    reply_tokens: int = 48,
    n_parallel: int = 8,
    prefix_cache: bool = True,
    **llm_kwargs: Any,
) -> PrefixRun:
    """Conversations advancing in lockstep; each turn sends the whole history again."""
    sentences = english_sentences(n_conversations * n_turns + 100)
    per_conversation = system_tokens + n_turns * (user_tokens + reply_tokens)
    n_ctx = n_parallel * per_conversation + 512
    with LLM(model_path, n_ctx=n_ctx, n_parallel=n_parallel, prefix_cache=prefix_cache, **llm_kwargs) as llm:
        system = [llm.model.bos, *_tokens_of(llm, " ".join(sentences[:100]), system_tokens - 1)]
        histories = [list(system) for _ in range(n_conversations)]
        params = SamplingParams(max_tokens=reply_tokens, temperature=0, ignore_eos=True)
        computed, reused = _prompt_counters(llm)
        ttfts, prompt_tokens = [], 0
        start = time.perf_counter()
        for turn in range(n_turns):
            for c, history in enumerate(histories):
                history += _tokens_of(llm, " " + sentences[100 + c * n_turns + turn], user_tokens)
            outs = [completion(o) for o in llm.generate(histories, params, use_tqdm=False)]
            for history, out in zip(histories, outs, strict=True):
                prompt_tokens += out.usage.prompt_tokens
                ttfts.append(out.timings.time_to_first_token or 0.0)
                history += out.token_ids
        wall = time.perf_counter() - start
        computed_after, reused_after = _prompt_counters(llm)
    return PrefixRun(
        prefix_cache,
        wall,
        statistics.median(ttfts),
        prompt_tokens,
        computed_after - computed,
        reused_after - reused,
    )


def _row(workload: str, run: PrefixRun) -> dict[str, Any]:
    return {
        "workload": workload,
        "prefix_cache": "on" if run.prefix_cache else "off",
        "t_total_s": run.wall_s,
        "ttft_p50_ms": run.median_ttft_s * 1000,
        "prompt_tokens": run.prompt_tokens,
        "prefill_tokens": run.prefill_tokens,
        "reused_tokens": run.reused_tokens,
    }


_COLUMNS = (
    Column("workload", "workload"),
    Column("prefix_cache", "reuse"),
    Column("t_total_s", "T s", ".2f"),
    Column("ttft_p50_ms", "TTFT p50", ".1f"),
    Column("prompt_tokens", "prompt tokens", "d"),
    Column("prefill_tokens", "computed", "d"),
    Column("reused_tokens", "reused", "d"),
)


def compare(
    model_path: str,
    *,
    shared: Mapping[str, int] | None = None,
    chat: Mapping[str, int] | None = None,
    **llm_kwargs: Any,
) -> list[dict[str, Any]]:
    """Both workloads with reuse off and on, side by side: one row per workload and setting.
    ``shared`` and ``chat`` change the sizes of :func:`shared_system_prompt` and
    :func:`multi_turn_chat`; ``llm_kwargs`` go to every ``LLM``."""
    workloads = {
        "shared_system_prompt": (shared_system_prompt, shared or {}),
        "multi_turn_chat": (multi_turn_chat, chat or {}),
    }
    rows = []
    for workload, (run, sizes) in workloads.items():
        for reuse in (False, True):
            rows.append(_row(workload, run(model_path, prefix_cache=reuse, **sizes, **llm_kwargs)))
    return rows


def prefix_report(rows: list[dict[str, Any]], settings: dict[str, Any]) -> Report:
    """The report of :func:`compare`'s rows: the rows with reuse on get the ratios to reuse
    off (``vs_off_time``: total time off / on, ``vs_off_ttft_p50``: median time to first
    token off / on, ``vs_off_computed``: computed prompt tokens on / off)."""
    metrics = {"time": "t_total_s", "ttft_p50": "ttft_p50_ms", "computed": "prefill_tokens"}
    inverse = ("time", "ttft_p50")
    ratios = ratio_rows(
        rows, subject="on", key=("workload",), metrics=metrics, inverse=inverse, by="prefix_cache"
    )
    titles = [("time", "T s (off/on)"), ("ttft_p50", "TTFT p50 (off/on)"), ("computed", "computed (on/off)")]
    columns = ratio_columns("reuse on vs", [Column("workload", "workload")], titles)
    notes = []
    for r in ratios:
        if r["workload"] == "shared_system_prompt":
            notes.append(
                f"shared system prompt: with reuse the total time is {r['time_ratio']:.2f}x shorter, "
                f"the median TTFT {r['ttft_p50_ratio']:.2f}x lower"
            )
        else:
            notes.append(
                f"multi-turn chat: with reuse the engine computes {r['computed_ratio']:.1%} "
                "of the no-reuse run's prompt tokens"
            )
    return Report(settings, rows, _COLUMNS, ratios, columns, notes)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-prefix``."""
    p.description = (
        "16 requests sharing a 512-token system prompt (32 unique + 32 new tokens each, 8 "
        "slots), and 8 conversations x 4 turns resending the whole history, each run with "
        "prefix reuse off and on (llamabatch.bench.prefix)."
    )
    p.add_argument("-m", "--model", default="135m", help="GGUF or a test-model preset (default: 135m)")
    p.add_argument(
        "-t", "--threads", type=options.positive_int, default=None, help="CPU threads (default: all cores)"
    )
    p.add_argument("-b", "--n-batch", type=options.positive_int, default=512)
    p.add_argument("-fa", "--flash-attn", type=options.on_off, default=True, metavar="on|off")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-prefix``: run both workloads, print the report."""
    from llamabatch.bench.workloads import resolve_model

    model = resolve_model(args.model)
    rows = compare(str(model), n_threads=args.threads, n_batch=args.n_batch, flash_attn=args.flash_attn)
    settings = {
        "model": model.name,
        "n_threads": args.threads or os.cpu_count(),
        "n_batch": args.n_batch,
        "flash_attn": args.flash_attn,
    }
    prefix_report(rows, settings).print(as_json=args.json)
    return 0
