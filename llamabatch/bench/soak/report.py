"""The soak's report: its tables and the invariants, as ``llamabatch.bench.report`` prints them."""

from __future__ import annotations

from llamabatch.bench.report import Column, Report
from llamabatch.bench.soak.result import SoakResult

# ---------------------------------------------------------------------------------------------
# Report and command line
# ---------------------------------------------------------------------------------------------

_COLUMNS = (
    Column("layout", "KV layout"),
    Column("lives", "LLMs", "d"),
    Column("prompts_submitted", "prompts", "d"),
    Column("refused", "refused", "d"),
    Column("completions_submitted", "completions", "d"),
    Column("ended_stop", "stop", "d"),
    Column("ended_length", "length", "d"),
    Column("ended_cancelled", "cancelled", "d"),
    Column("ended_error", "error", "d"),
    Column("ended_exactly_once", "ended once", "d"),
    Column("preemptions", "preempted", "d"),
    Column("faults_injected", "faults", "d"),
    Column("faults_consumed", "faults hit", "d"),
)

_CHECK_COLUMNS = (
    Column("check", "invariant"),
    Column("expected", "expected"),
    Column("got", "got"),
    Column("ok", "ok"),
)


def soak_report(result: SoakResult) -> Report:
    """The shared report of a soak run: one row per KV layout and one for the whole run,
    then a table of the invariants."""
    total = result.total()
    cfg = result.config
    settings = {
        "model": result.model.rsplit("/", 1)[-1],
        "requests": cfg.requests,
        "threads": cfg.threads,
        "close_every": cfg.close_every,
        "n_parallel": cfg.n_parallel,
        "cancel_rate": cfg.cancel_rate,
        "fault_rate": cfg.fault_rate,
        "seed": cfg.seed,
    }
    checks = [
        {
            "check": "completions ended exactly once",
            "expected": f"all {total['completions_submitted']}",
            "got": f"{total['ended_exactly_once']} ({total['exactly_once_violations']} violations)",
            "ok": total["exactly_once_violations"] == 0 and total["never_ended"] == 0,
        },
        {
            "check": "KV cells in use at the end",
            "expected": "0",
            "got": str(total["kv_cells_used_end"]),
            "ok": total["kv_cells_used_end"] == 0,
        },
        {
            "check": "seq_pos_max of every sequence at the end",
            "expected": "-1",
            "got": str(total["seq_pos_max_end"]),
            "ok": total["seq_pos_max_end"] == -1,
        },
        {
            "check": "faults: injected = failed a batch + absorbed by a close",
            "expected": str(total["faults_injected"]),
            "got": f"{total['faults_consumed']} + {total['faults_absorbed_by_close']}",
            "ok": total["faults_injected"] == total["faults_consumed"] + total["faults_absorbed_by_close"],
        },
        {
            "check": "errors without an injected fault",
            "expected": "0",
            "got": str(total["unexplained_errors"]),
            "ok": total["unexplained_errors"] == 0,
        },
        {
            "check": "RSS growth, warm-up to end",
            "expected": "-" if cfg.max_rss_growth is None else f"<= {cfg.max_rss_growth:.0%}",
            "got": "-"
            if total["rss_growth_mb"] is None
            else f"{total['rss_growth_mb']:+.1f} MB ({total['rss_growth_pct']:+.1f}%)",
            "ok": not any(v.startswith("RSS grew") for v in result.violations),
        },
        {
            "check": "all invariants",
            "expected": "0 violations",
            "got": f"{len(result.violations)} violations",
            "ok": result.ok,
        },
    ]
    for row in checks:
        row["runner"] = "check"
    rss = (
        f"RSS {total['rss_start_mb']:.1f} MB after the first LLM (warm-up), {total['rss_end_mb']:.1f} MB "
        f"at the end ({total['rss_growth_mb']:+.1f} MB"
        + (
            ""
            if total["rss_growth_second_half_mb"] is None
            else f", {total['rss_growth_second_half_mb']:+.1f} MB over the second half of the LLMs"
        )
        + f"), peak {total['rss_peak_mb']:.1f} MB"
        if total["rss_growth_mb"] is not None
        else f"RSS peak {total['rss_peak_mb']:.1f} MB (one LLM only: no warm-up to compare with)"
    )
    notes = [
        f"{total['prompts_attempted']} requests in {total['wall_s']:.1f} s "
        f"({total['requests_per_s']:.1f}/s), "
        f"{total['closes']} closes ({total['drained_closes']} drained and checked), "
        f"{total['refused']} refused by a closing LLM, {total['anonymous_completions']} cancelled "
        "before their id was known",
        rss,
        "modes: " + ", ".join(f"{k} {v}" for k, v in total["modes"].items()),
        *(f"VIOLATION: {v}" for v in result.violations),
    ]
    rows = [{**row, "runner": "soak"} for row in result.layout_rows()] + [{**total, "runner": "soak"}]
    return Report(settings, rows, _COLUMNS, notes=notes, extra=[("Invariants", checks, _CHECK_COLUMNS)])
