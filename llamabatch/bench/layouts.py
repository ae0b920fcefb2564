"""``llamabatch bench-layouts``: the KV layouts (and the defaults) on the workloads below.

Each workload runs once per layout, in-process, with the same requests:

- ``per-stream``: ``kv_unified=False`` with ``--n-ctx`` (one stream of ``n_ctx / n_parallel``
  cells per sequence);
- ``unified``: ``kv_unified=True`` with ``--n-ctx``;
- ``defaults``: ``LLM(model)`` with no options but ``n_threads`` (and the slots of the uniform
  and mixed workloads): the model's trained context, in the layout chosen at load
  (``generate/kv_memory.py``).

Workloads:

- ``uniform``: llama-batched-bench's: ``--npl`` requests of ``--npp`` + ``--ntg`` tokens at
  once, on ``--npl`` slots;
- ``mixed``: ``--mixed-requests`` Poisson arrivals at ``--rate``/s (16 + 128, 128 + 64 and 512 +
  16 tokens), on ``--mixed-slots`` slots;
- ``shared_prefix``: ``--shared-requests`` requests sharing a ``--prefix-tokens`` prompt (plus
  16 unique tokens each), prefix reuse on, all submitted at once;
- ``long_among_short``: one ``--long-tokens`` prompt among 16 short ones (64-token prompts),
  submitted together: a request over a stream's size is refused (counted in ``failures``);
- ``chat``: :mod:`llamabatch.bench.chat`'s multi-turn chat, in-process.

``--rounds N`` runs the workload N times in the same ``LLM`` (a quiet moment between rounds,
where the defaults' layout may switch to follow the workload: ``generate/layout_switch.py``);
the row reports the last round, every round's time, and the switches made.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from llamabatch.bench import options
from llamabatch.bench.chat import Conversations, llm_backend, run_chat
from llamabatch.bench.workloads import batched_requests, mixed_requests
from llamabatch.config import EngineConfig
from llamabatch.errors import PromptTooLong
from llamabatch.runtime.telemetry import TickEvent

__all__ = ["LAYOUTS", "WORKLOADS", "add_arguments", "main", "run_layout"]

#: the layouts, by name: the LLM options each adds (``n_ctx`` is added to the explicit ones)
LAYOUTS: dict[str, dict[str, Any]] = {
    "per-stream": {"kv_unified": False},
    "unified": {"kv_unified": True},
    "defaults": {},
}


def _tokens(llm: Any, n: int, seed: int) -> list[int]:
    """``n`` ordinary token ids (deterministic for ``seed``)."""
    n_vocab = llm.model.n_vocab
    return [(seed * 7919 + i * 104729) % (n_vocab - 300) + 256 for i in range(n)]


def _timed(
    llm: Any, prompts: list[list[int]], max_tokens: int | list[int], arrivals: list[float] | None = None
) -> dict[str, Any]:
    """Submit every prompt (at once, or each at its arrival time in seconds from the start);
    total time, tokens per second (prompt and generated, as llama-batched-bench's total), TTFT
    p50 / p90, refusals, prompt counters."""
    from llamabatch import SamplingParams

    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    before = llm.stats()
    start = time.perf_counter()
    handles, refused = [], 0
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        if arrivals is not None:
            time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        try:
            handles.append(llm.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
        except PromptTooLong:
            refused += 1
    outs = [h.result() for h in handles]
    wall = time.perf_counter() - start
    after = llm.stats()
    ttfts = sorted(o.outputs[0].timings.time_to_first_token or 0.0 for o in outs)
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return {
        "t_total_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000, 1) if ttfts else None,
        "failures": {"PromptTooLong": refused} if refused else {},
        "reused_tokens": after.reused_tokens - before.reused_tokens,
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "preemptions": after.preemptions - before.preemptions,
        **_ticks(before, after),
    }


def _ticks(before: Any, after: Any) -> dict[str, Any]:
    """Ticks, tokens per tick and seconds per tick inside ``llama_decode``: more ticks is the
    scheduler's doing, slower ticks the layout's."""
    ticks = after.ticks - before.ticks
    return {
        "ticks": ticks,
        "tokens_per_tick": round((after.batch_tokens - before.batch_tokens) / ticks, 1) if ticks else 0,
        "decode_ms_per_tick": round((after.decode_time_s - before.decode_time_s) / ticks * 1000, 2)
        if ticks
        else 0,
    }


def uniform(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """llama-batched-bench's workload: ``--npl`` requests of ``--npp`` prompt tokens and
    ``--ntg`` new tokens, all at once, on ``--npl`` slots."""
    requests = batched_requests(llm, args.npp, args.ntg, args.npl, seed=args.seed)
    return _timed(llm, [list(r.prompt) for r in requests], args.ntg)


def mixed(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``--mixed-requests`` Poisson arrivals at ``--rate`` per second, lengths from the bench's
    default mix (16 + 128, 128 + 64 and 512 + 16 tokens), on ``--mixed-slots`` slots."""
    requests = mixed_requests(llm, args.mixed_requests, args.rate, seed=args.seed)
    return _timed(
        llm,
        [list(r.prompt) for r in requests],
        [r.max_tokens for r in requests],
        [r.arrival for r in requests],
    )


def shared_prefix(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    prefix = [llm.model.bos, *_tokens(llm, args.prefix_tokens - 1, 1)]
    prompts = [prefix + _tokens(llm, 16, 100 + i) for i in range(args.shared_requests)]
    return _timed(llm, prompts, args.max_tokens)


def long_among_short(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    prompts = [[llm.model.bos, *_tokens(llm, 63, 200 + i)] for i in range(16)]
    prompts.insert(8, [llm.model.bos, *_tokens(llm, args.long_tokens - 1, 2)])
    return _timed(llm, prompts, args.max_tokens)


def chat(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    conversations = Conversations.make(
        args.conversations, args.turns, count=lambda text: len(llm.tokenize(text, add_special=False))
    )
    before = llm.stats()
    result = run_chat(llm_backend(llm), conversations, args.max_tokens).summary()
    after = llm.stats()
    return {
        "t_total_s": result["t_total_s"],
        "ttft_p50_ms": result["ttft_p50_later_ms"],
        "failures": result["failures"],
        "reused_tokens": after.reused_tokens - before.reused_tokens,
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "preemptions": after.preemptions - before.preemptions,
        **_ticks(before, after),
    }


WORKLOADS: dict[str, Callable[[Any, argparse.Namespace], dict[str, Any]]] = {
    "uniform": uniform,
    "mixed": mixed,
    "shared_prefix": shared_prefix,
    "long_among_short": long_among_short,
    "chat": chat,
}

#: the workloads whose slot count is part of the workload: every layout, the defaults too, runs
#: them with it (a user picks ``n_parallel`` for the concurrency they have)
SLOTS: dict[str, Callable[[argparse.Namespace], int]] = {
    "uniform": lambda args: args.npl,
    "mixed": lambda args: args.mixed_slots,
}


def run_layout(model_path: str, layout: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """One workload on one layout, in a fresh ``LLM`` (warmed up with one short request)."""
    from llamabatch import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(LAYOUTS[layout])
    if args.threads:
        kwargs["n_threads"] = args.threads
    kwargs.update(type_k=args.type_k, type_v=args.type_v)  # f16 unless -ctk / -ctv say otherwise
    if args.flash_attn is not None:
        kwargs["flash_attn"] = args.flash_attn
    if layout != "defaults":
        kwargs.update(n_ctx=args.n_ctx, n_parallel=args.n_parallel)
    if workload in SLOTS:
        kwargs["n_parallel"] = SLOTS[workload](args)
    with LLM(model_path, **kwargs) as llm:
        llm.generate([[llm.model.bos, 300, 400]], SamplingParams(max_tokens=2), use_tqdm=False)
        cells: list[int] = []
        llm.add_listener(
            lambda event: cells.append(event.kv_cells_used) if isinstance(event, TickEvent) else None
        )
        rounds = [WORKLOADS[workload](llm, args) for _ in range(args.rounds)]
        row = rounds[-1]
        if args.rounds > 1:
            row["t_rounds_s"] = [round(r["t_total_s"], 3) for r in rounds]
        stats = llm.stats()
        row.update(
            layout_switches=stats.layout_switches,
            layout_switch_reasons=stats.layout_switch_reasons,
            layout_switch_time_s=round(stats.layout_switch_time_s, 3),
            final_layout=("unified" if stats.kv_unified else "per-stream") + f", fa={stats.flash_attn}",
        )
        # KV cells in use per decode tick (shared cells once): what each tick's attention reads
        row["kv_cells_per_tick"] = round(statistics.mean(cells)) if cells else 0
        kv = f"{args.type_k}/{args.type_v}"
        return {
            "workload": workload,
            "layout": layout,
            "kv": kv,
            "flash_attn": "auto" if args.flash_attn is None else args.flash_attn,
            "n_ctx": llm.n_ctx,
            "n_ctx_seq": llm.n_ctx_seq,
            "n_parallel": llm.n_parallel,
            **row,
        }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-layouts``."""
    p.description = (
        "The KV layouts (per-stream, unified) and LLM's defaults side by side on uniform batches, "
        "mixed arrivals, a shared prefix, one long request among short ones and a multi-turn chat "
        "(llamabatch.bench.layouts)."
    )
    p.add_argument("-m", "--model", default="135m", help="GGUF or a test-model preset (default: 135m)")
    p.add_argument("-t", "--threads", type=options.positive_int, default=None, help="CPU threads")
    p.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    p.add_argument("--layout", choices=(*LAYOUTS, "all"), default="all")
    p.add_argument("-c", "--n-ctx", type=options.positive_int, default=16384, help="explicit layouts' n_ctx")
    p.add_argument("--n-parallel", type=options.positive_int, default=8, help="explicit layouts' slots")
    p.add_argument("--max-tokens", type=options.positive_int, default=64, help="new tokens a request")
    p.add_argument("--npp", type=options.positive_int, default=128, help="uniform: prompt tokens")
    p.add_argument("--ntg", type=options.positive_int, default=128, help="uniform: new tokens")
    p.add_argument("--npl", type=options.positive_int, default=8, help="uniform: requests and slots")
    p.add_argument("--mixed-requests", type=options.positive_int, default=32)
    p.add_argument("--rate", type=options.positive_float, default=2.0, help="mixed: arrivals per second")
    p.add_argument("--mixed-slots", type=options.positive_int, default=16)
    p.add_argument("--seed", type=int, default=0, help="uniform and mixed: the prompts' seed")
    p.add_argument("--shared-requests", type=options.positive_int, default=16)
    p.add_argument("--prefix-tokens", type=options.positive_int, default=1452)
    p.add_argument("--long-tokens", type=options.positive_int, default=6000)
    p.add_argument("--conversations", type=options.positive_int, default=12)
    p.add_argument("--turns", type=options.positive_int, default=4)
    p.add_argument(
        "--rounds", type=options.positive_int, default=1, help="runs of the workload in one LLM (default 1)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    EngineConfig.add_cli_args(p, only=("type_k", "type_v", "flash_attn"))


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-layouts``: every chosen workload on every chosen layout."""
    from llamabatch.bench.workloads import resolve_model

    model = str(resolve_model(args.model))
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    layouts = list(LAYOUTS) if args.layout == "all" else [args.layout]
    for workload in workloads:
        for layout in layouts:
            row = run_layout(model, layout, workload, args)
            print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0
