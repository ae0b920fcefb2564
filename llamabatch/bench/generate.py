"""``llamabatch bench``: the engine against a raw static batch and llama-cpp-python.

The workloads (:mod:`llamabatch.bench.workloads`) run through up to three runners
(:mod:`llamabatch.bench.runners`) on exactly the same requests: the engine, the raw static
batch through the binding (``--raw``, batched workload only) and llama-cpp-python
(``--compare llama-cpp-python``). Repeats are interleaved (engine, raw, llama-cpp-python,
engine, ...) and the fastest run of each is kept. The report (:mod:`llamabatch.bench.report`)
has one row per runner and point, and the engine's ratios over the others.

:func:`run_workload` and the argument groups are shared with ``llamabatch bench-serve``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llamabatch.bench import latency, options
from llamabatch.bench.plots import check_plotting, plot_results
from llamabatch.bench.report import (
    GENERATION_COLUMNS,
    Column,
    Report,
    RunResult,
    progress_bar,
    ratio_columns,
    ratio_rows,
)
from llamabatch.bench.runners import (
    ENGINE,
    LLAMA_CPP_PYTHON,
    RAW,
    BenchConfig,
    EngineRunner,
    LlamaCppRunner,
    RawRunner,
    Runner,
)
from llamabatch.bench.workloads import (
    DEFAULT_MIX,
    WorkloadSpec,
    auto_n_ctx,
    batched_requests,
    mixed_requests,
    open_tokenizer,
    point_seed,
    repeat_requests,
    retry_requests,
    warm_prompt,
)

__all__ = [
    "RUNNERS",
    "add_arguments",
    "engine_settings",
    "generation_report",
    "main",
    "run_batched",
    "run_mixed",
    "run_workload",
]

#: The runners ``llamabatch bench`` knows, in the order their rows are printed.
RUNNERS = (ENGINE, RAW, LLAMA_CPP_PYTHON)

Progress = Callable[[str], None]

#: the runner name of the engine run without ``--target-itl-ms`` (``--baseline-no-target``)
NO_TARGET = "engine-no-target"


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def _best_run(results: list[RunResult]) -> RunResult:
    """The repeat with the shortest wall time (as ``timeit`` does: on a shared machine noise
    only ever slows a run down)."""
    chosen = min(results, key=lambda r: r.t_total)
    if len(results) > 1:
        chosen.notes.append(
            f"best of {len(results)} runs (t_total {', '.join(f'{r.t_total:.3f}' for r in results)} s)"
        )
    return chosen


def _measure(
    live: Mapping[str, Runner],
    requests: Sequence[Any],
    workload: str,
    npl: int,
    rate: float | None,
    repeat: int,
    progress: Progress | None,
    label: str,
) -> list[RunResult]:
    """Every runner of ``live`` on one point, ``repeat`` times interleaved; the best of each."""
    runs: dict[str, list[RunResult]] = {name: [] for name in live}
    for _ in range(repeat):
        for name, runner in live.items():
            runs[name].append(runner.run(requests, workload, npl, rate))
            if progress is not None:
                progress(f"{name} {label}")
    return [_best_run(r) for r in runs.values()]


def _check_runners(runners: Sequence[str]) -> None:
    unknown = set(runners) - set(RUNNERS)
    if unknown:
        raise ValueError(f"unknown runner(s) {sorted(unknown)}; choose from {list(RUNNERS)}")


def _close(runners: Mapping[str, Runner]) -> None:
    for runner in runners.values():
        runner.close()


def run_batched(
    config: BenchConfig,
    npps: Sequence[int],
    ntgs: Sequence[int],
    npls: Sequence[int],
    runners: Sequence[str] = (ENGINE,),
    repeat: int = 1,
    progress: Progress | None = None,
    *,
    n_requests: int | None = None,
    others: Mapping[str, Runner] | None = None,
    engine_name: str = ENGINE,
    repeat_prompts: bool = False,
    retry_prompts: bool = False,
) -> list[RunResult]:
    """llama-batched-bench's grid (every ``npp`` x ``ntg`` x ``npl``) through ``runners``
    (names of :data:`RUNNERS`) and the ready-made runners ``others`` (warmed up here, closed
    by the caller). The engine gets ``config.n_parallel`` slots (default ``npl``) and is
    named ``engine_name``. ``progress(label)`` is called after every run. ``repeat_prompts``:
    the ``repeat`` workload's prompts (:func:`repeat_requests`); ``retry_prompts``: the ``retry``
    workload's (:func:`retry_requests`: each request twice)."""
    _check_runners(runners)
    vocab = open_tokenizer(config.model)
    make = repeat_requests if repeat_prompts else retry_requests if retry_prompts else batched_requests
    try:
        points = [(npp, ntg, npl) for npp in npps for ntg in ntgs for npl in npls]
        grid = [
            (npp, ntg, npl, make(vocab, npp, ntg, npl, point_seed(config.seed, k), n_requests))
            for k, (npp, ntg, npl) in enumerate(points)
        ]
    finally:
        vocab.close()
    warm_tokens = warm_prompt([r for *_, reqs in grid for r in reqs])
    own: dict[str, Runner] = {}  # runners for the whole grid
    results: list[RunResult] = []
    try:
        if LLAMA_CPP_PYTHON in runners:  # one model for the whole grid: it serves one at a time
            n_ctx = config.n_ctx or max(auto_n_ctx(reqs, 1) for *_, reqs in grid)
            own[LLAMA_CPP_PYTHON] = LlamaCppRunner(config, n_ctx)
        shared = {**own, **(others or {})}
        if config.warmup:
            for runner in shared.values():
                runner.warmup(warm_tokens)
        for npp, ntg, npl, requests in grid:
            n_parallel = config.n_parallel or npl
            live: dict[str, Runner] = {}
            try:
                if ENGINE in runners:
                    n_ctx = config.n_ctx or auto_n_ctx(requests, n_parallel, config.kv_unified)
                    live[engine_name] = EngineRunner(config, n_parallel, n_ctx, engine_name)
                if RAW in runners:
                    n_seq = len(requests)  # a static batch: every request at once
                    n_ctx_raw = config.n_ctx or auto_n_ctx(requests, n_seq, config.kv_unified)
                    live[RAW] = RawRunner(config, n_seq, n_ctx_raw)
                if config.warmup:
                    for runner in live.values():
                        runner.warmup(warm_tokens)
                label = f"npp={npp} ntg={ntg} npl={npl}"
                results += _measure(
                    {**live, **shared}, requests, "batched", npl, None, repeat, progress, label
                )
            finally:
                _close(live)
    finally:
        _close(own)
    return results


def run_mixed(
    config: BenchConfig,
    rates: Sequence[float],
    n_requests: int,
    mix: Sequence[tuple[int, int, float]] = DEFAULT_MIX,
    runners: Sequence[str] = (ENGINE,),
    repeat: int = 1,
    progress: Progress | None = None,
    *,
    others: Mapping[str, Runner] | None = None,
    engine_name: str = ENGINE,
) -> list[RunResult]:
    """The mixed-arrival workload at every ``rate`` (requests/s) through ``runners`` (the raw
    runner does not apply: it serves only static batches) and ``others``, as
    :func:`run_batched`. The engine gets ``config.n_parallel`` slots (default 16)."""
    _check_runners(runners)
    vocab = open_tokenizer(config.model)
    try:
        workloads = [
            (rate, mixed_requests(vocab, n_requests, rate, mix, point_seed(config.seed, k)))
            for k, rate in enumerate(rates)
        ]
    finally:
        vocab.close()
    warm_tokens = warm_prompt([r for _, reqs in workloads for r in reqs])
    n_parallel = config.n_parallel or 16
    live: dict[str, Runner] = {}
    results: list[RunResult] = []
    try:
        if ENGINE in runners:
            n_ctx = config.n_ctx or max(
                auto_n_ctx(reqs, n_parallel, config.kv_unified) for _, reqs in workloads
            )
            live[engine_name] = EngineRunner(config, n_parallel, n_ctx, engine_name)
        if LLAMA_CPP_PYTHON in runners:
            n_ctx = config.n_ctx or max(auto_n_ctx(reqs, 1) for _, reqs in workloads)
            live[LLAMA_CPP_PYTHON] = LlamaCppRunner(config, n_ctx)
        everyone = {**live, **(others or {})}
        if config.warmup:
            for runner in everyone.values():
                runner.warmup(warm_tokens)
        for rate, requests in workloads:
            results += _measure(
                everyone, requests, "mixed", n_parallel, rate, repeat, progress, f"rate={rate:g}/s"
            )
    finally:
        _close(live)
    return results


def run_workload(
    config: BenchConfig,
    workload: WorkloadSpec,
    runners: Sequence[str],
    *,
    repeat: int = 1,
    show_progress: bool = True,
    others: Mapping[str, Runner] | None = None,
    engine_name: str = ENGINE,
    command: str = "llamabatch bench",
) -> list[RunResult]:
    """:func:`run_batched` or :func:`run_mixed` for ``workload``, with a progress bar named
    ``command``."""
    if workload.kind == "mixed":
        runners = [r for r in runners if r != RAW]
    n_runs = workload.n_points * (len(runners) + len(others or {})) * repeat
    advance, close = progress_bar(n_runs, command, show_progress)
    try:
        if workload.kind in ("batched", "repeat", "retry"):
            return run_batched(
                config,
                workload.npps,
                workload.ntgs,
                workload.npls,
                runners,
                repeat,
                advance,
                n_requests=workload.n_requests,
                others=others,
                engine_name=engine_name,
                repeat_prompts=workload.kind == "repeat",
                retry_prompts=workload.kind == "retry",
            )
        return run_mixed(
            config,
            workload.rates,
            workload.n_requests or 32,
            workload.mix,
            runners,
            repeat,
            advance,
            others=others,
            engine_name=engine_name,
        )
    finally:
        close()


def generation_report(
    results: Sequence[RunResult], settings: dict[str, Any], *, subject: str = ENGINE
) -> Report:
    """The report of generation runs: one row per run, ``subject``'s ratios over the others."""
    rows = [r.row() for r in results]
    ratios = ratio_rows(rows, subject=subject)
    key_columns = [
        Column("npp", "PP", "d"),
        Column("ntg", "TG", "d"),
        Column("npl", "B", "d"),
        Column("rate", "rate/s", "g"),
    ]
    metrics = [("total", "total t/s"), ("gen", "gen t/s"), ("ttft_p50", "TTFT p50")]
    return Report(
        settings, rows, GENERATION_COLUMNS, ratios, ratio_columns(f"{subject} vs", key_columns, metrics)
    )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench``."""
    p.description = (
        "Benchmark the engine. 'batched' (llama-batched-bench's workload): for every NPL, NPL "
        "requests of NPP prompt tokens and NTG generated tokens submitted at once. 'mixed': "
        "Poisson arrivals at --rate requests/s with prompt/output lengths from --mix. Reports "
        "prompt, generation and total tokens/s, time to first token and inter-token latency "
        "percentiles. --compare llama-cpp-python serves the same requests one after another "
        "through llama-cpp-python and prints the ratios; --raw drives the same static batch "
        "through the binding with no scheduler (the engine's ceiling)."
    )
    options.add_engine_arguments(p)
    options.add_workload_arguments(p)
    p.add_argument("--compare", choices=(LLAMA_CPP_PYTHON,), default=None, help="also run this baseline")
    p.add_argument("--raw", action="store_true", help="also run the static batch through the binding")
    p.add_argument(
        "--baseline-no-target",
        action="store_true",
        help="with --target-itl-ms: also run the engine without the target (runner 'engine-no-target')",
    )
    options.add_run_arguments(p)


def engine_settings(config: BenchConfig, workload: WorkloadSpec) -> dict[str, Any]:
    """The settings line (and JSON fields) of a generation report."""
    settings: dict[str, Any] = {
        "model": config.model.name,
        "n_threads": config.threads,
        "n_batch": config.n_batch,
        "strategy": config.strategy,
        "flash_attn": config.flash_attn,
        "kv_unified": config.kv_unified,
        "workload": workload.kind,
    }
    if (config.type_k, config.type_v) != ("f16", "f16"):
        settings["kv_types"] = f"{config.type_k}/{config.type_v}"
    if config.target_itl_ms is not None:
        settings["target_itl_ms"] = config.target_itl_ms
    if config.speculative_config is not None:
        spec = config.speculative_config
        settings["speculative"] = f"{spec['method']}:{spec['num_speculative_tokens']}"
    if workload.kind == "mixed":
        settings["mix"] = ",".join(f"{npp}:{ntg}:{w:g}" for npp, ntg, w in workload.mix)
    return settings


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench``: run the workload, print the report (``--json``: JSON lines),
    draw ``--plot``. Returns the exit status."""
    import sys

    if args.plot:
        check_plotting()
    config = options.config_from_args(args)
    workload = options.workload_from_args(args)
    if workload.kind == "mixed" and args.raw:
        print("llamabatch bench: --raw applies to the batched workload only; ignored", file=sys.stderr)
    runners = [ENGINE, *([RAW] if args.raw else []), *([args.compare] if args.compare else [])]
    results = run_workload(config, workload, runners, repeat=args.repeat, show_progress=not args.no_progress)
    if args.baseline_no_target and config.target_itl_ms is not None:
        results += run_workload(
            dataclasses.replace(config, target_itl_ms=None),
            workload,
            [ENGINE],
            repeat=args.repeat,
            show_progress=not args.no_progress,
            engine_name=NO_TARGET,
        )
    latency.apply_slo(results, config)
    report = generation_report(results, engine_settings(config, workload))
    report.print(as_json=args.json)
    title = f"{config.model.name}, {config.threads} threads"
    if args.plot:
        out = plot_results(report.rows, args.plot, title=title)
        print(f"wrote {out}", file=sys.stderr)
    if args.plot_itl:
        target = "" if config.target_itl_ms is None else f", target ITL {config.target_itl_ms:g} ms"
        print(f"wrote {latency.plot_itl(results, args.plot_itl, title + target)}", file=sys.stderr)
    return 0
