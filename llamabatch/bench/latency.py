"""Latency under load: SLOs and goodput, the capacity search, ITL-over-time figures.

- :func:`apply_slo` marks runs with ``--slo-ttft-ms`` / ``--slo-itl-ms`` (their rows then
  carry ``goodput`` and ``slo_met``).
- :func:`find_capacity` searches the arrival rate for the highest one at which a run meets
  the SLO (``bench-serve --find-capacity``): it doubles the rate from ``--rate`` until the
  SLO fails (or halves it until it holds), then bisects between the last rate that held
  and the first that failed. A run meets the SLO when its TTFT p99 and ITL p99 (all gaps of
  all requests) are within the bounds given.
- :func:`plot_itl` draws every run's inter-token latency over time (``--plot-itl``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llamabatch.bench.plots import check_plotting
from llamabatch.bench.report import Column, RunResult
from llamabatch.bench.runners.base import BenchConfig

__all__ = ["CAPACITY_COLUMNS", "apply_slo", "find_capacity", "goodput_at_least", "plot_itl"]

#: the columns of the capacity table
CAPACITY_COLUMNS: tuple[Column, ...] = (
    Column("subject", "server"),
    Column("capacity_rate", "capacity req/s", ".3g"),
    Column("slo_ttft_ms", "SLO TTFT ms", "g"),
    Column("slo_itl_ms", "SLO ITL p99 ms", "g"),
    Column("probes", "probes", "d"),
)


def apply_slo(results: Sequence[RunResult], config: BenchConfig) -> None:
    """Give every run the SLO of ``config`` (nothing when neither bound is set)."""
    for result in results:
        result.slo_ttft_ms = config.slo_ttft_ms
        result.slo_itl_ms = config.slo_itl_ms


def slo_met(result: RunResult) -> bool:
    """Whether a run (with its SLO set) met it: TTFT p99 and ITL p99 within the bounds."""
    return bool(result.row().get("slo_met", True))


def goodput_at_least(share: float) -> Callable[[RunResult], bool]:
    """A run meets it when at least ``share`` (0..1) of its requests met the SLO (goodput)."""
    return lambda run: (run.row().get("goodput") or 0.0) >= share


def find_capacity(
    probe: Callable[[float], RunResult],
    start_rate: float,
    *,
    steps: int = 7,
    meets: Callable[[RunResult], bool] = slo_met,
) -> tuple[float | None, list[RunResult]]:
    """The highest arrival rate (requests/s) at which ``probe(rate)`` ``meets`` its SLO
    (default :func:`slo_met`; :func:`goodput_at_least`: by goodput), found in at most
    ``steps`` probes, and the runs made (in order). ``None`` when even the lowest rate tried
    failed."""
    if start_rate <= 0 or steps < 1:
        raise ValueError("the capacity search needs a positive start rate and at least one step")
    good: float | None = None
    bad: float | None = None
    runs: list[RunResult] = []
    rate = start_rate
    for _ in range(steps):
        run = probe(rate)
        runs.append(run)
        if meets(run):
            good = rate
        else:
            bad = rate
        if bad is None:
            rate = rate * 2
        elif good is None:
            rate = rate / 2
        else:
            rate = (good + bad) / 2
    return good, runs


def plot_itl(results: Sequence[RunResult], path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw each run's token gaps against the time they happened (one series per runner and
    rate, log scale); write ``path``."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for result in results:
        if not result.itl_series:
            continue
        xs = [t for t, _ in result.itl_series]
        ys = [g * 1000.0 for _, g in result.itl_series]
        label = result.runner if result.rate is None else f"{result.runner} @ {result.rate:g}/s"
        ax.plot(xs, ys, marker=".", linestyle="none", markersize=2, alpha=0.6, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", markerscale=4)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def capacity_row(subject: str, capacity: float | None, config: BenchConfig, probes: int) -> dict[str, Any]:
    """The capacity table's row."""
    return {
        "subject": subject,
        "capacity_rate": capacity,
        "slo_ttft_ms": config.slo_ttft_ms,
        "slo_itl_ms": config.slo_itl_ms,
        "probes": probes,
    }
