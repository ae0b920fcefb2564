"""``llamabatch bench-serve``: a running OpenAI-compatible server under concurrent clients.

The same workloads as ``llamabatch bench`` (:mod:`llamabatch.bench.workloads`), sent over
HTTP by :class:`~llamabatch.bench.runners.HTTPRunner` to any server that speaks OpenAI's
``/v1/completions`` with token-id prompts and streaming: ``llamabatch serve``, llama.cpp's
``llama-server``, vLLM. The prompts are made with the tokenizer of ``-m MODEL``, which must
be the GGUF the server serves. ``--compare in-process`` runs the same requests through an
in-process :class:`~llamabatch.LLM` with the engine options given here, side by side, and
reports the server's ratios over it (what the HTTP layer costs).

Batched workload: ``npl`` concurrent clients, ``--requests`` requests in all (default
``npl``: one each). Mixed workload: requests sent at their Poisson arrival times, at most
``--max-concurrency`` in flight.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from llamabatch.bench import images, latency, options
from llamabatch.bench.generate import engine_settings, generation_report, run_workload
from llamabatch.bench.plots import check_plotting, plot_results
from llamabatch.bench.report import RunResult
from llamabatch.bench.runners import ENGINE, HTTP, BenchConfig, HTTPRunner
from llamabatch.bench.workloads import WorkloadSpec, point_seed

__all__ = ["IN_PROCESS", "add_arguments", "main"]

#: The ``runner`` name of the in-process engine in this benchmark.
IN_PROCESS = "in-process"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-serve``."""
    p.description = (
        "Benchmark a running OpenAI-compatible server (llamabatch serve, llama-server, vLLM) with "
        "concurrent streaming clients on the batched or mixed workload: the same requests (token-id "
        "prompts, ignore_eos) and the same columns as 'llamabatch bench'. -m must be the GGUF the "
        "server serves (its tokenizer makes the prompts). --compare in-process also runs the "
        "requests through an in-process LLM with the engine options below, side by side."
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server's base URL (default %(default)s)"
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--served-model", default=None, help="the requests' model field (default: the first of /v1/models)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument(
        "--max-concurrency",
        type=options.positive_int,
        default=None,
        help="mixed: the most requests in flight (default: no limit)",
    )
    p.add_argument("--compare", choices=(IN_PROCESS,), default=None, help="also run the in-process engine")
    p.add_argument(
        "--find-capacity",
        action="store_true",
        help="search the arrival rate (mixed workload, from the first --rate) for the highest rate "
        "at which the run's TTFT p99 and ITL p99 meet --slo-ttft-ms / --slo-itl-ms",
    )
    p.add_argument(
        "--min-goodput",
        type=float,
        default=None,
        metavar="SHARE",
        help="--find-capacity by goodput: the highest rate at which at least SHARE (0..1] of the "
        "requests meet the SLO",
    )
    p.add_argument(
        "--capacity-steps",
        type=options.positive_int,
        default=7,
        help="probes of the capacity search (default 7)",
    )
    options.add_engine_arguments(p)
    options.add_workload_arguments(p, npl_help="concurrent clients")
    options.add_run_arguments(p)
    images.add_image_arguments(p)


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-serve``: run the workload against the server (and in-process with
    ``--compare in-process``), print the report, draw ``--plot``."""
    if args.images is not None:  # chat requests with images: a workload of its own
        return images.main(args)
    if args.plot:
        check_plotting()
    config = options.config_from_args(args)
    workload = options.workload_from_args(args)
    if args.find_capacity and config.slo_ttft_ms is None and config.slo_itl_ms is None:
        raise SystemExit("llamabatch bench-serve: --find-capacity needs --slo-itl-ms and/or --slo-ttft-ms")
    if args.min_goodput is not None and not 0 < args.min_goodput <= 1:
        raise SystemExit(f"llamabatch bench-serve: --min-goodput must be in (0, 1], got {args.min_goodput}")
    server = HTTPRunner(
        args.url,
        model=args.served_model,
        api_key=args.api_key,
        timeout=args.timeout,
        max_concurrency=args.max_concurrency,
    )
    capacity: list[dict[str, object]] = []
    try:
        if args.find_capacity:
            results, capacity = _find_capacity(args, config, workload, server)
        else:
            results = run_workload(
                config,
                workload,
                [ENGINE] if args.compare == IN_PROCESS else [],
                repeat=args.repeat,
                show_progress=not args.no_progress,
                others={HTTP: server},
                engine_name=IN_PROCESS,
                command="llamabatch bench-serve",
            )
            latency.apply_slo(results, config)
    finally:
        server.close()
    settings = {"url": server.url, "served_model": server.model, **engine_settings(config, workload)}
    if args.compare != IN_PROCESS:  # the engine options apply only to the in-process run
        for key in ("n_threads", "n_batch", "strategy", "flash_attn", "kv_unified", "target_itl_ms"):
            settings.pop(key, None)
    report = generation_report(results, settings, subject=HTTP)
    if capacity:
        report.extra.append(("capacity under the SLO", capacity, latency.CAPACITY_COLUMNS))
    report.print(as_json=args.json)
    title = f"{server.model} at {server.url}"
    if args.plot:
        out = plot_results(report.rows, args.plot, title=title)
        print(f"wrote {out}", file=sys.stderr)
    if args.plot_itl:
        print(f"wrote {latency.plot_itl(results, args.plot_itl, title)}", file=sys.stderr)
    return 0


def _find_capacity(
    args: argparse.Namespace, config: BenchConfig, workload: WorkloadSpec, server: HTTPRunner
) -> tuple[list[RunResult], list[dict[str, object]]]:
    """The capacity search against the server (mixed workload, one rate per probe)."""

    probes = 0

    def probe(rate: float) -> RunResult:
        nonlocal probes
        spec = dataclasses.replace(workload, kind="mixed", rates=(rate,))
        # fresh prompts for every probe: a server's prompt cache must not serve a probe
        # from an earlier probe's identical prompts (that would measure cache hits, not load)
        seeded = dataclasses.replace(config, seed=point_seed(config.seed, probes))
        probes += 1
        (run,) = run_workload(seeded, spec, [], show_progress=False, others={HTTP: server})
        latency.apply_slo([run], config)
        row = run.row()
        print(
            f"bench-serve: rate {rate:.3g}/s: ITL p99 {row['itl_p99_ms']:.1f} ms, TTFT p99 "
            f"{row['ttft_p99_ms']:.1f} ms, goodput {row.get('goodput') or 0.0:.2f}, SLO "
            f"{'met' if meets(run) else 'missed'}",
            file=sys.stderr,
        )
        return run

    meets = latency.slo_met if args.min_goodput is None else latency.goodput_at_least(args.min_goodput)
    found, runs = latency.find_capacity(probe, workload.rates[0], steps=args.capacity_steps, meets=meets)
    return runs, [latency.capacity_row(server.url, found, config, len(runs))]
