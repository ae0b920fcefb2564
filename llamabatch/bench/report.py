"""Results and their one output format, shared by every ``llamabatch bench*`` command.

Every command ends in a :class:`Report`: a settings line, a Markdown table of result rows,
optionally a second table of ratios (one contender over the others, from :func:`ratio_rows`)
and ``note:`` lines. With ``--json`` the same report is one JSON object per row on stdout
(the settings merged into every row, the ratios merged into the rows they belong to), and
nothing else.

:class:`RunResult` is what a generation runner measured on one workload point; its
:meth:`~RunResult.row` is the flat row of the table and the JSON line.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from llamabatch.bench.workloads import BenchRequest
from llamabatch.outputs import slo_met

__all__ = [
    "GENERATION_COLUMNS",
    "RATIO_METRICS",
    "Column",
    "Report",
    "RunResult",
    "format_table",
    "json_lines",
    "progress_bar",
    "ratio_columns",
    "ratio_rows",
    "result_from_times",
]


# ---------------------------------------------------------------------------------------------
# Generation results
# ---------------------------------------------------------------------------------------------


def _percentiles(values: Sequence[float], scale: float = 1000.0) -> tuple[float, float, float]:
    if len(values) == 0:
        return (math.nan, math.nan, math.nan)
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return (float(p50) * scale, float(p90) * scale, float(p99) * scale)


def _tail(values: Sequence[float], scale: float = 1000.0) -> tuple[float, float]:
    """p99.9 and max, scaled (NaN when empty)."""
    if len(values) == 0:
        return (math.nan, math.nan)
    array = np.asarray(values, dtype=np.float64)
    return (float(np.percentile(array, 99.9)) * scale, float(array.max()) * scale)


def goodput(
    ttft: Sequence[float], request_itl: Sequence[float], slo_ttft_ms: float | None, slo_itl_ms: float | None
) -> float:
    """The share of requests that met the SLO (``outputs.slo_met``, the engine's definition):
    time to first token <= ``slo_ttft_ms`` and no gap between the request's tokens over
    ``slo_itl_ms`` (``request_itl``: each one's largest gap; a bound not given always holds)."""
    n = len(ttft)
    if n == 0:
        return math.nan
    slo_ttft = None if slo_ttft_ms is None else slo_ttft_ms / 1000.0
    slo_itl = None if slo_itl_ms is None else slo_itl_ms / 1000.0
    met = 0
    for i in range(n):
        itl_max = request_itl[i] if i < len(request_itl) else None
        met += slo_met(ttft[i], itl_max, slo_ttft, slo_itl)
    return met / n


@dataclass
class RunResult:
    """What one runner did on one workload point (times in seconds).

    Metrics of :meth:`row`:

    - ``total_tokens_per_s``: (prompt + generated tokens) / wall time;
    - ``gen_tokens_per_s``: generated tokens / wall time (the aggregate generation rate);
    - ``prompt_tokens_per_s``: prompt tokens / ``t_pp``, the time until every request had its
      first token (the prefill phase; for a sequential runner, the sum of its requests'
      prefill times); batched workload only;
    - ``decode_tokens_per_s``: tokens generated after the first / (wall time - ``t_pp``);
      batched workload only;
    - time to first token (from each request's arrival) and inter-token latency (gaps
      between consecutive tokens of a request) percentiles, in milliseconds (ITL also
      p99.9 and max);
    - with ``slo_ttft_ms`` / ``slo_itl_ms`` set: ``goodput``, the share of requests whose
      TTFT and every gap met them (:func:`goodput`), and ``slo_met`` (the run's TTFT p99 and ITL p99 within
      them: what ``bench-serve --find-capacity`` searches on);
    - where the runner knows it: the time inside ``llama_decode`` and the share of wall
      time outside it.
    """

    runner: str
    workload: str
    npp: int
    ntg: int
    npl: int
    n_requests: int
    prompt_tokens: int
    gen_tokens: int
    t_pp: float
    t_total: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    decode_time: float | None = None
    ticks: int | None = None
    tick_time: float | None = None
    rate: float | None = None
    notes: list[str] = field(default_factory=list)
    #: every request's largest gap between tokens (seconds; NaN under 2 tokens), in request order
    request_itl: list[float] = field(default_factory=list)
    #: (seconds since the run's start, gap) of every token gap, for ITL-over-time plots
    itl_series: list[tuple[float, float]] = field(default_factory=list, repr=False)
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None

    def row(self) -> dict[str, Any]:
        """One flat, JSON-ready dict (the ``--json`` row)."""
        t_tg = max(self.t_total - self.t_pp, 1e-12)
        ttft = _percentiles(self.ttft)
        itl = _percentiles(self.itl)
        itl_tail = _tail(self.itl)
        e2e = _percentiles(self.e2e)
        row: dict[str, Any] = {
            "workload": self.workload,
            "runner": self.runner,
            "npp": self.npp,
            "ntg": self.ntg,
            "npl": self.npl,
            "n_requests": self.n_requests,
            "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens,
            "t_pp_s": self.t_pp,
            "t_tg_s": self.t_total - self.t_pp,
            "t_total_s": self.t_total,
            "prompt_tokens_per_s": self.prompt_tokens / self.t_pp if self.t_pp > 0 else math.nan,
            "decode_tokens_per_s": max(self.gen_tokens - self.n_requests, 0) / t_tg,
            "gen_tokens_per_s": self.gen_tokens / self.t_total,
            "total_tokens_per_s": (self.prompt_tokens + self.gen_tokens) / self.t_total,
            "requests_per_s": self.n_requests / self.t_total,
            "ttft_p50_ms": ttft[0],
            "ttft_p90_ms": ttft[1],
            "ttft_p99_ms": ttft[2],
            "itl_p50_ms": itl[0],
            "itl_p90_ms": itl[1],
            "itl_p99_ms": itl[2],
            "itl_p99_9_ms": itl_tail[0],
            "itl_max_ms": itl_tail[1],
            "e2e_p50_ms": e2e[0],
            "e2e_p90_ms": e2e[1],
            "e2e_p99_ms": e2e[2],
        }
        if self.workload == "mixed":
            # Requests overlap at random: there are no prefill and decode phases to time.
            row.update(t_pp_s=None, t_tg_s=None, prompt_tokens_per_s=None, decode_tokens_per_s=None)
        if self.rate is not None:
            row["rate"] = self.rate
        if self.slo_ttft_ms is not None or self.slo_itl_ms is not None:
            row["slo_ttft_ms"], row["slo_itl_ms"] = self.slo_ttft_ms, self.slo_itl_ms
            row["goodput"] = goodput(self.ttft, self.request_itl, self.slo_ttft_ms, self.slo_itl_ms)
            row["slo_met"] = (self.slo_ttft_ms is None or ttft[2] <= self.slo_ttft_ms) and (
                self.slo_itl_ms is None or itl[2] <= self.slo_itl_ms
            )
        if self.decode_time is not None:
            row["decode_time_s"] = self.decode_time
            row["outside_decode_share"] = max(0.0, 1.0 - self.decode_time / self.t_total)
        if self.ticks is not None:
            row["ticks"] = self.ticks
            if self.ticks and self.tick_time is not None and self.decode_time is not None:
                row["overhead_per_tick_us"] = (self.tick_time - self.decode_time) / self.ticks * 1e6
        if self.notes:
            row["notes"] = list(self.notes)
        return row


def result_from_times(
    runner: str,
    workload: str,
    requests: Sequence[BenchRequest],
    first: Sequence[float],
    end: Sequence[float],
    gen_counts: Sequence[int],
    itl: list[float],
    start: float,
    npl: int,
    rate: float | None,
    t_pp: float | None = None,
    stamps: Sequence[Sequence[float]] | None = None,
) -> RunResult:
    """A :class:`RunResult` from absolute per-request times (``time.perf_counter()``): the
    first token and the end of every request, the run's ``start``. Latencies count from each
    request's arrival; the prefill phase lasts until the last first token unless ``t_pp``
    (a sequential runner's sum) is given. ``stamps``: every request's token times, for the
    per-request ITL figures (goodput) and the ITL-over-time series."""
    arrivals = [start + r.arrival for r in requests]
    request_itl: list[float] = []
    series: list[tuple[float, float]] = []
    for times in stamps or ():
        gaps = np.diff(np.asarray(times, dtype=np.float64))
        request_itl.append(float(gaps.max()) if len(gaps) else math.nan)
        series += [(t - start, g) for t, g in zip(times[1:], gaps.tolist(), strict=True)]
    series.sort()
    return RunResult(
        runner=runner,
        workload=workload,
        npp=round(sum(len(r.prompt) for r in requests) / len(requests)),
        ntg=round(sum(r.max_tokens for r in requests) / len(requests)),
        npl=npl,
        n_requests=len(requests),
        prompt_tokens=sum(len(r.prompt) for r in requests),
        gen_tokens=sum(gen_counts),
        t_pp=max(first) - start if t_pp is None else t_pp,
        t_total=max(end) - start,
        ttft=[f - a for f, a in zip(first, arrivals, strict=True)],
        itl=itl,
        e2e=[e - a for e, a in zip(end, arrivals, strict=True)],
        rate=rate,
        request_itl=request_itl,
        itl_series=series,
    )


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One table column: the row key, its title, a format spec and a suffix (``"x"``)."""

    key: str
    title: str
    spec: str = ""
    suffix: str = ""

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, bool):
            return "on" if value else "off"
        return format(value, self.spec) + self.suffix


#: The columns of a generation run (``llamabatch bench``, ``llamabatch bench-serve``).
GENERATION_COLUMNS: tuple[Column, ...] = (
    Column("runner", "runner"),
    Column("rate", "rate/s", "g"),
    Column("npp", "PP", "d"),
    Column("ntg", "TG", "d"),
    Column("npl", "B", "d"),
    Column("t_pp_s", "T_PP s", ".3f"),
    Column("prompt_tokens_per_s", "S_PP t/s", ".1f"),
    Column("t_tg_s", "T_TG s", ".3f"),
    Column("decode_tokens_per_s", "S_TG t/s", ".1f"),
    Column("t_total_s", "T s", ".3f"),
    Column("total_tokens_per_s", "S t/s", ".1f"),
    Column("gen_tokens_per_s", "gen t/s", ".1f"),
    Column("ttft_p50_ms", "TTFT p50", ".1f"),
    Column("ttft_p90_ms", "TTFT p90", ".1f"),
    Column("ttft_p99_ms", "TTFT p99", ".1f"),
    Column("itl_p50_ms", "ITL p50", ".2f"),
    Column("itl_p90_ms", "ITL p90", ".2f"),
    Column("itl_p99_ms", "ITL p99", ".2f"),
    Column("itl_p99_9_ms", "ITL p99.9", ".2f"),
    Column("itl_max_ms", "ITL max", ".2f"),
    Column("goodput", "goodput", ".2f"),
    Column("outside_decode_share", "outside", ".1%"),
)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A Markdown table of ``rows``: one line per row, right-aligned; a column whose key no
    row has is left out, a missing value is ``-``."""
    if not rows:
        return "(no results)"
    columns = [c for c in columns if any(c.key in row for row in rows)]
    header = [c.title for c in columns]
    body = [[c.cell(row) for c in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in body:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


#: The ratios of a generation run: name -> row key (subject / baseline).
RATIO_METRICS: dict[str, str] = {
    "total": "total_tokens_per_s",
    "gen": "gen_tokens_per_s",
    "ttft_p50": "ttft_p50_ms",
}


def ratio_rows(
    rows: Sequence[dict[str, Any]],
    *,
    subject: str,
    key: Sequence[str] = ("workload", "npp", "ntg", "npl", "rate"),
    metrics: Mapping[str, str] = RATIO_METRICS,
    inverse: Iterable[str] = (),
    by: str = "runner",
) -> list[dict[str, Any]]:
    """For every group of rows equal on ``key`` that has a row whose ``by`` is ``subject``:
    the subject's value of each metric over every other row's (``"baseline"``). Metrics
    named in ``inverse`` are baseline over subject (a time: how many times shorter). Each
    ratio row has the key fields, ``baseline`` and ``<metric>_ratio``; the ratios are also
    added to the subject's row as ``vs_<baseline>_<metric>``."""
    inverse = set(inverse)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in key), []).append(row)
    out = []
    for group_key, group in groups.items():
        subjects = [r for r in group if r[by] == subject]
        if not subjects:
            continue
        mine = subjects[0]
        for other in group:
            if other[by] == subject:
                continue
            baseline = str(other[by])
            ratio: dict[str, Any] = dict(zip(key, group_key, strict=True))
            ratio["baseline"] = baseline
            slug = baseline.replace("-", "_").replace(" ", "_")
            for name, metric in metrics.items():
                a, b = mine.get(metric), other.get(metric)
                if name in inverse:
                    a, b = b, a
                value = a / b if a is not None and b else math.nan
                ratio[f"{name}_ratio"] = value
                mine[f"vs_{slug}_{name}"] = value
            out.append(ratio)
    return out


def ratio_columns(
    title: str, key_columns: Sequence[Column], metrics: Sequence[tuple[str, str]]
) -> list[Column]:
    """The columns of a ratio table: the baseline under ``title`` (``"llamabatch vs"``), the
    key columns, then ``(metric name, title)`` pairs as ``1.23x``."""
    return [
        Column("baseline", title),
        *key_columns,
        *(Column(f"{name}_ratio", title, ".2f", "x") for name, title in metrics),
    ]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def json_lines(rows: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    """The rows as JSON lines (NaN written as null)."""
    for row in rows:
        yield json.dumps({k: _clean(v) for k, v in row.items()})


def _setting(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


@dataclass
class Report:
    """What a bench command prints (see the module docstring)."""

    settings: dict[str, Any]
    rows: list[dict[str, Any]]
    columns: Sequence[Column]
    ratios: list[dict[str, Any]] = field(default_factory=list)
    ratio_columns: Sequence[Column] = ()
    notes: list[str] = field(default_factory=list)
    #: further tables (title, rows, columns), printed after the ratios; in JSON their rows follow
    extra: list[tuple[str, list[dict[str, Any]], Sequence[Column]]] = field(default_factory=list)

    def json_rows(self) -> list[dict[str, Any]]:
        """Every row (the extra tables' too) with the settings merged in."""
        rows = [*self.rows, *(r for _, extra_rows, _ in self.extra for r in extra_rows)]
        return [{**row, **self.settings} for row in rows]

    def text(self) -> str:
        """The settings line, the tables and the notes."""
        parts = [" | ".join(f"{k} {_setting(v)}" for k, v in self.settings.items())]
        parts.append(format_table(self.rows, self.columns))
        if self.ratios:
            parts.append(format_table(self.ratios, self.ratio_columns))
        for title, rows, columns in self.extra:
            parts.append(f"{title}\n\n{format_table(rows, columns)}")
        notes = [*self.notes, *(f"{r['runner']}: {n}" for r in self.rows for n in r.get("notes", []))]
        if notes:
            parts.append("\n".join(f"note: {n}" for n in dict.fromkeys(notes)))
        return "\n\n".join(parts)

    def print(self, *, as_json: bool = False, file: TextIO | None = None) -> None:
        """Write the report to ``file`` (stdout): tables, or JSON lines with ``as_json``."""
        out = sys.stdout if file is None else file
        if as_json:
            for line in json_lines(self.json_rows()):
                print(line, file=out)
        else:
            print(self.text(), file=out)


def progress_bar(
    total: int, desc: str, enabled: bool = True
) -> tuple[Callable[[str], None], Callable[[], None]]:
    """A tqdm bar on stderr (only on a terminal); returns ``(advance(label), close())``."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="run", disable=None if enabled else True, file=sys.stderr)

    def advance(label: str) -> None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)

    return advance, bar.close
