"""Figures of generation runs (``--plot OUT.png``), drawn with matplotlib (``llamabatch[plot]``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_plotting", "plot_attainment", "plot_results"]


def check_plotting() -> None:
    """Raise ``ImportError`` with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, an optional extra: pip install 'llamabatch[plot]' "
            "(or pip install matplotlib)"
        ) from None


def plot_results(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw total and generated tokens/s against concurrency (``npl``; the arrival rate for
    the mixed workload), one line per runner and (npp, ntg); write ``path`` (PNG, SVG...)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed = any(r["workload"] == "mixed" for r in rows)
    xkey = "rate" if mixed else "npl"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for row in rows:
        label_key = (row["runner"], row["npp"], row["ntg"]) if not mixed else (row["runner"], 0, 0)
        series.setdefault(label_key, []).append(row)
    for (runner, npp, ntg), points in series.items():
        points = sorted(points, key=lambda r: r[xkey])
        xs = [p[xkey] for p in points]
        label = runner if mixed else f"{runner} (pp {npp}, tg {ntg})"
        for ax, metric in zip(axes, ("total_tokens_per_s", "gen_tokens_per_s"), strict=True):
            ax.plot(xs, [p[metric] for p in points], marker="o", label=label)
    for ax, name in zip(axes, ("total tokens/s", "generated tokens/s"), strict=True):
        ax.set_xlabel("arrival rate (requests/s)" if mixed else "parallel sequences (npl)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        if not mixed:
            ticks = sorted({r[xkey] for r in rows})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
    axes[0].legend(fontsize="small")
    return _save(fig, path, title)


def plot_attainment(
    rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str = "", *, key: str = "server"
) -> Path:
    """Draw SLO attainment (``goodput``: the share of requests meeting the SLO, in %) and
    total tokens/s against the arrival rate (``rate``), one line per ``rows[key]`` (the
    server); write ``path``. Rows without ``goodput`` are left out of the attainment panel."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (attained, tokens) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        series.setdefault(str(row[key]), []).append(row)
    for name, points in series.items():
        points = sorted(points, key=lambda r: r["rate"])
        scored = [p for p in points if p.get("goodput") is not None]
        attained.plot(
            [p["rate"] for p in scored], [100.0 * p["goodput"] for p in scored], marker="o", label=name
        )
        tokens.plot(
            [p["rate"] for p in points], [p["total_tokens_per_s"] for p in points], marker="o", label=name
        )
    attained.set_ylabel("requests meeting the SLO (%)")
    attained.set_ylim(-3, 103)
    tokens.set_ylabel("total tokens/s")
    rates = sorted({r["rate"] for r in rows})
    for ax in (attained, tokens):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_xscale("log")  # rates are spread over a decade (0.1 to 1 req/s)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    attained.legend(fontsize="small")
    return _save(fig, path, title)


def _save(fig: Any, path: str | os.PathLike[str], title: str) -> Path:
    """Title, lay out, write and close ``fig``."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
