"""``llamabatch bench-soak``: its arguments and ``main``."""

from __future__ import annotations

import argparse

from llamabatch.bench import options
from llamabatch.bench.soak.config import MAX_SEQ_TOKENS, SoakConfig
from llamabatch.bench.soak.report import soak_report
from llamabatch.bench.soak.run import run_soak
from llamabatch.config import EngineConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-soak``."""
    p.description = (
        "Soak the engine: many mixed requests from many threads with random cancellations, "
        "close()/reopen cycles (both KV layouts) and injected decode faults; checks that every "
        "request ends exactly once and that no KV cell is left in use (llamabatch.bench.soak). "
        "Exit status 1 when an invariant is violated."
    )
    p.add_argument("-m", "--model", default="tiny", help="GGUF or a test-model preset (default: tiny)")
    p.add_argument("-n", "--requests", type=options.positive_int, default=10_000, help="prompts in all")
    p.add_argument("-T", "--threads", type=options.positive_int, default=8, help="client threads (default 8)")
    p.add_argument("--async-tasks", type=options.positive_int, default=4, help="tasks in the asyncio thread")
    p.add_argument(
        "--close-every", type=options.positive_int, default=500, help="close and reopen every K requests"
    )
    p.add_argument("--cancel-rate", type=float, default=0.15, help="share of requests cancelled (0..1)")
    p.add_argument(
        "--fault-rate",
        type=float,
        default=0.02,
        help="injected decode faults per request (default 0.02: one every 50 requests; 0: none)",
    )
    # the engine's --n-parallel, generated from EngineConfig (same name); a fixed default, as
    # each LLM's n_ctx is sized by its slots
    slots = {"flags": ("--n-parallel",), "help": "slots per LLM", "default": SoakConfig.n_parallel}
    EngineConfig.add_cli_args(p, only=["n_parallel"], overrides={"n_parallel": slots})
    p.add_argument(
        "--unified-n-ctx",
        type=options.positive_int,
        default=2 * MAX_SEQ_TOKENS,
        help=f"KV cells of the unified layout (tight, so requests are preempted; >= {MAX_SEQ_TOKENS})",
    )
    p.add_argument(
        "-t", "--n-threads", type=options.positive_int, default=1, help="llama.cpp CPU threads (default 1)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a wait counts as a hang")
    p.add_argument(
        "--max-rss-growth",
        type=float,
        default=None,
        metavar="PCT",
        help="fail when RSS grows more than PCT percent from warm-up to the end (default: report only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-soak``: run the soak, print the report; 1 when an invariant failed."""
    config = SoakConfig(
        model=args.model,
        requests=args.requests,
        threads=args.threads,
        async_tasks=args.async_tasks,
        close_every=args.close_every,
        cancel_rate=args.cancel_rate,
        fault_rate=args.fault_rate,
        n_parallel=args.n_parallel,
        unified_n_ctx=args.unified_n_ctx,
        n_threads=args.n_threads,
        timeout=args.timeout,
        max_rss_growth=None if args.max_rss_growth is None else args.max_rss_growth / 100.0,
        seed=args.seed,
        progress=not args.no_progress and not args.json,
    )
    result = run_soak(config)
    soak_report(result).print(as_json=args.json)
    return 0 if result.ok else 1
