"""What a soak measured (``SoakResult``) and the invariants it checks."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from llamabatch.bench.soak.config import MB, REASONS, SoakConfig
from llamabatch.bench.soak.ledger import Ledger, Life

# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    """What a soak run found; :attr:`violations` is empty when every invariant held."""

    config: SoakConfig
    model: str
    lives: list[Life]
    ledger: Ledger
    wall_s: float
    prompts_attempted: int
    rss_start: int | None
    rss_end: int | None
    rss_peak: int
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def total(self) -> dict[str, Any]:
        """The whole run as one flat, JSON-ready dict."""
        ledger = self.ledger
        reasons: Counter[str] = Counter()
        for life in self.lives:
            reasons.update(life.ended)
        once = sum(life.ended_once for life in self.lives)
        prompts = sum(life.prompts for life in self.lives)
        refused = sum(life.refused for life in self.lives)
        completions = sum(life.completions for life in self.lives)
        final = self.lives[-1] if self.lives else None
        growth = None if self.rss_start is None or self.rss_end is None else self.rss_end - self.rss_start
        closes = [life.rss_after_close for life in self.lives if life.rss_after_close]
        row: dict[str, Any] = {
            "layout": "all",
            "lives": len(self.lives),
            "closes": sum(1 for life in self.lives if life.closing),
            "drained_closes": sum(1 for life in self.lives if life.closing and life.drained),
            "prompts_attempted": self.prompts_attempted,
            "prompts_submitted": prompts,
            "refused": refused,
            "refused_queue_full": self.ledger.refused_queue_full,
            "completions_submitted": completions,
            "probes": sum(life.probes for life in self.lives),
            "completions_ended": ledger.n_ends,
            **{f"ended_{r}": reasons.get(r, 0) for r in REASONS},
            "ended_exactly_once": once,
            "ended_more_than_once": ledger.n_twice,
            "never_ended": ledger.n_never,
            "finish_reason_mismatches": ledger.n_mismatch,
            "exactly_once_violations": completions - once,
            "anonymous_completions": ledger.n_anonymous,
            "preemptions": sum(life.preemptions for life in self.lives),
            "evictions": sum(life.evictions for life in self.lives),
            "decode_retries": sum(life.decode_retries for life in self.lives),
            "faults_injected": sum(life.faults_injected for life in self.lives),
            "faults_consumed": sum(life.faults_consumed for life in self.lives),
            "faults_absorbed_by_close": sum(life.faults_absorbed for life in self.lives),
            "unexplained_errors": sum(life.unexplained_errors for life in self.lives),
            "kv_cells_used_end": final.kv_cells_used if final is not None else None,
            "seq_pos_max_end": max(final.seq_pos_max) if final is not None and final.seq_pos_max else None,
            "rss_start_mb": None if self.rss_start is None else self.rss_start / MB,
            "rss_end_mb": None if self.rss_end is None else self.rss_end / MB,
            "rss_peak_mb": self.rss_peak / MB,
            "rss_after_each_close_mb": [round(r / MB, 1) for r in closes],
            # a leak grows on; allocator warm-up levels off: the second half tells them apart
            "rss_growth_second_half_mb": (closes[-1] - closes[len(closes) // 2]) / MB
            if len(closes) >= 4
            else None,
            "rss_growth_mb": None if growth is None else growth / MB,
            "rss_growth_pct": None if growth is None else 100.0 * growth / max(self.rss_start or 1, 1),
            "wall_s": self.wall_s,
            "requests_per_s": self.prompts_attempted / self.wall_s if self.wall_s > 0 else math.nan,
            "completions_per_s": completions / self.wall_s if self.wall_s > 0 else math.nan,
            "modes": dict(sorted(self.ledger.modes.items())),
            "violations": len(self.violations),
        }
        return row

    def layout_rows(self) -> list[dict[str, Any]]:
        """One row per KV layout."""
        rows = []
        for unified in (True, False):
            lives = [life for life in self.lives if life.unified == unified]
            if not lives:
                continue
            reasons: Counter[str] = Counter()
            for life in lives:
                reasons.update(life.ended)
            n_ctx = lives[0].n_ctx
            rows.append(
                {
                    "layout": f"{lives[0].layout} (n_ctx {n_ctx})",
                    "lives": len(lives),
                    "prompts_submitted": sum(life.prompts for life in lives),
                    "refused": sum(life.refused for life in lives),
                    "completions_submitted": sum(life.completions for life in lives),
                    **{f"ended_{r}": reasons.get(r, 0) for r in REASONS},
                    "ended_exactly_once": sum(life.ended_once for life in lives),
                    "preemptions": sum(life.preemptions for life in lives),
                    "faults_injected": sum(life.faults_injected for life in lives),
                    "faults_consumed": sum(life.faults_consumed for life in lives),
                }
            )
        return rows


# ---------------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------------


def check_invariants(result: SoakResult) -> list[str]:
    """Every invariant that failed, in words (empty: all held)."""
    ledger = result.ledger
    out = list(ledger.violations)
    completions = sum(life.completions for life in result.lives)
    if completions != ledger.n_known + ledger.n_anonymous:
        out.append(
            f"{completions} completions submitted, but callers know {ledger.n_known} and "
            f"{ledger.n_anonymous} more without ids"
        )
    once = sum(life.ended_once for life in result.lives)
    if once != completions:
        out.append(f"{once} of {completions} completions ended exactly once")
    for life in result.lives:
        name = f"LLM #{life.index} ({life.layout})"
        if life.faults_injected != life.faults_consumed + life.faults_absorbed:
            out.append(
                f"{name}: {life.faults_injected} faults injected, {life.faults_consumed} failed a batch, "
                f"{life.faults_absorbed} were absorbed by the close"
            )
        if life.unexplained_errors:
            out.append(f"{name}: {life.unexplained_errors} requests ended 'error' without an injected fault")
        if not life.drained or life.probe_ok is None:
            continue
        if not life.probe_ok:
            out.append(f"{name}: after its faults, a probe request did not complete normally")
        if life.kv_cells_used != 0:
            out.append(f"{name}: {life.kv_cells_used} KV cells in use after every request ended")
        if life.seq_pos_max is None or any(p != -1 for p in life.seq_pos_max):
            out.append(
                f"{name}: sequences still hold KV positions at the end: seq_pos_max {life.seq_pos_max}"
            )
        if life.busy_slots:
            out.append(f"{name}: {life.busy_slots} slots busy after every request ended")
        ended = sum(life.ended.values())
        if life.engine_requests is not None and life.engine_requests != ended:
            out.append(f"{name}: the engine counted {life.engine_requests} ends, the listener {ended}")
    if result.lives and result.lives[-1].kv_cells_used is None and not out:
        out.append("the last LLM was never checked")
    cfg = result.config
    if cfg.max_rss_growth is not None and result.rss_start and result.rss_end is not None:
        growth = result.rss_end / result.rss_start - 1.0
        if growth > cfg.max_rss_growth:
            out.append(f"RSS grew {growth:.1%} from warm-up to the end (limit {cfg.max_rss_growth:.1%})")
    if result.prompts_attempted < cfg.requests and not out:
        out.append(f"only {result.prompts_attempted} of {cfg.requests} requests were attempted")
    return out
