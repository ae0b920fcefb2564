"""Command-line pieces shared by the subcommands: argument types, and the argument groups of
the generation benchmarks (``bench``, ``bench-serve``) with their typed results.

The types raise ``argparse.ArgumentTypeError``, so a bad value is reported by argparse
itself: one line naming the option, exit status 2.
"""

from __future__ import annotations

import argparse

from llamabatch.bench.runners.base import BenchConfig
from llamabatch.bench.workloads import DEFAULT_MIX, WorkloadSpec, parse_mix, resolve_model
from llamabatch.config import EngineConfig, on_off, positive_float, positive_int
from llamabatch.generate.kv_memory import choose_flash_attn
from llamabatch.generate.spec_config import spec_config_from_cli

__all__ = [
    "add_engine_arguments",
    "add_run_arguments",
    "add_workload_arguments",
    "config_from_args",
    "flash_attn_list",
    "non_negative_int",
    "on_off",
    "positive_float_list",
    "positive_int",
    "positive_int_list",
    "workload_from_args",
]


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated ints >= 1 (``"1,8,16"``)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


def positive_float_list(text: str) -> list[float]:
    """Comma-separated numbers > 0 (``"0.5,2"``)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not min(values) > 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r}")
    return values


_FLASH: dict[str, bool | str] = {"on": True, "off": False, "auto": "auto"}


def flash_attn_list(text: str) -> list[bool | str]:
    """Comma-separated ``on``/``off``/``auto`` as ``flash_attn`` values (True, False, "auto")."""
    try:
        values: list[bool | str] = [_FLASH[v.strip()] for v in text.split(",") if v.strip()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"expected on, off or auto (comma-separated), got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected on, off or auto, got {text!r}")
    return values


# ---------------------------------------------------------------------------------------------
# The generation benchmarks' arguments
# ---------------------------------------------------------------------------------------------


def _mix(text: str) -> tuple[tuple[int, int, float], ...]:
    try:
        return parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_workload_arguments(p: argparse.ArgumentParser, *, npl_help: str = "parallel requests") -> None:
    """``--workload``, ``--npp``, ``--ntg``, ``--npl``, ``--requests``, ``--rate``, ``--mix``."""
    p.add_argument(
        "--workload",
        choices=("batched", "mixed", "repeat", "retry"),
        default="batched",
        help="repeat: as batched, each prompt a short passage repeated (speculative decoding's case); "
        "retry: as batched, every prompt asked again after its first answer (drafts across requests)",
    )
    p.add_argument(
        "--npp",
        type=positive_int_list,
        default=[128],
        help="prompt tokens per request, comma list (default 128)",
    )
    p.add_argument(
        "--ntg",
        type=positive_int_list,
        default=[64],
        help="tokens generated per request, comma list (default 64)",
    )
    p.add_argument(
        "--npl",
        type=positive_int_list,
        default=[1, 8, 16],
        help=f"{npl_help}, comma list (default 1,8,16)",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="requests per point (batched: default NPL, all arriving at once; mixed: default 32)",
    )
    p.add_argument(
        "--rate",
        type=positive_float_list,
        default=[2.0],
        help="mixed: arrival rates in requests/s, comma list (default 2)",
    )
    p.add_argument(
        "--mix",
        type=_mix,
        default=None,
        help="mixed: NPP:NTG[:WEIGHT],... (default 16:128,128:64,512:16, equal weights)",
    )


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's settings (``-m`` included), the same for every runner that takes them."""
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="GGUF file, or a test-model preset (tiny, small, 135m: random weights, Q8_0); "
        "default: SmolLM2-135M-Instruct (Q4_1)",
    )
    # the engine's own flags, generated from EngineConfig (with the benchmark's defaults:
    # n_ctx and n_parallel fit the workload, flash attention on as LLM's "auto" picks on CPU)
    EngineConfig.add_cli_args(
        p,
        only=(
            "n_threads",
            "n_ctx",
            "n_batch",
            "n_ubatch",
            "chunk_size",
            "n_parallel",
            "strategy",
            "flash_attn",
            "kv_unified",
            "type_k",
            "type_v",
            "prefix_cache",
            "target_itl_ms",
            "cache_ram",
            "speculative_config",
        ),
        overrides={
            "n_threads": {"flags": ("-t", "--threads")},
            "n_ctx": {
                "flags": ("-c", "--n-ctx"),
                "default": None,
                "help": "KV cache size (default: fits the workload)",
            },
            # the benchmark's settings for every runner, as its published figures were taken
            "n_batch": {"flags": ("-b", "--n-batch"), "default": 512},
            "n_ubatch": {"flags": ("-ub", "--n-ubatch"), "help": "default: n_batch"},
            "chunk_size": {"default": 512},
            "n_parallel": {
                "flags": ("--n-parallel",),
                "default": None,
                "help": "engine slots (default: NPL; mixed: 16)",
            },
            "flash_attn": {
                "type": on_off,
                "default": None,
                "metavar": "on|off",
                "help": (
                    "default: what LLM picks on CPU for the layout, off with --kv-unified off, on with on "
                    "(every runner gets the same)"
                ),
            },
            "kv_unified": {
                "action": None,
                "type": on_off,
                "default": False,
                "metavar": "on|off",
                "help": (
                    "off (default here, as llama-batched-bench; LLM chooses at load): one KV stream "
                    "per sequence; on: one buffer for all"
                ),
            },
            "prefix_cache": {
                "action": "store_true",
                "default": False,
                "help": "let the engine reuse prompt prefixes",
            },
        },
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="consume the engine's requests as streams (a thread each) and time every delta",
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Repeats, seed, warm-up, progress and output."""
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="runs per point, interleaved; the fastest is reported",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")
    p.add_argument(
        "--plot", metavar="OUT.png", default=None, help="draw throughput vs concurrency (matplotlib)"
    )
    p.add_argument(
        "--plot-itl",
        metavar="OUT.png",
        default=None,
        help="draw every run's inter-token latency over time (matplotlib)",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=positive_float,
        default=None,
        help="SLO: time to first token (ms); reports goodput, the share of requests meeting the SLO "
        "(the in-process engine schedules for it: EngineConfig.slo_ttft_ms)",
    )
    p.add_argument(
        "--slo-itl-ms",
        type=positive_float,
        default=None,
        help="SLO: no gap between a request's tokens over it (ms); reports goodput (the in-process "
        "engine schedules for it: EngineConfig.slo_itl_ms)",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of parsed engine and run arguments."""
    return BenchConfig(
        model=resolve_model(args.model),
        n_threads=args.n_threads,
        n_ctx=args.n_ctx,
        n_batch=args.n_batch,
        n_ubatch=args.n_ubatch,
        chunk_size=args.chunk_size,
        strategy=args.strategy,
        # LLM's choice for the layout, made here so that the raw and llama-cpp-python runners
        # get the same
        flash_attn=bool(
            choose_flash_attn(
                EngineConfig(kv_unified=args.kv_unified, flash_attn=args.flash_attn, type_v=args.type_v)
            )
        ),
        n_parallel=args.n_parallel,
        stream=args.stream,
        warmup=not args.no_warmup,
        seed=args.seed,
        prefix_cache=args.prefix_cache,
        kv_unified=args.kv_unified,
        type_k=args.type_k,
        type_v=args.type_v,
        target_itl_ms=args.target_itl_ms,
        cache_ram=args.cache_ram,
        speculative_config=spec_config_from_cli(args),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
    )


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """The :class:`WorkloadSpec` of parsed workload arguments."""
    return WorkloadSpec(
        kind=args.workload,
        npps=tuple(args.npp),
        ntgs=tuple(args.ntg),
        npls=tuple(args.npl),
        rates=tuple(args.rate),
        n_requests=args.requests,
        mix=args.mix or DEFAULT_MIX,
    )
