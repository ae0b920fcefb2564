"""Latency figures of an engine's finished requests, from its telemetry.

:class:`LatencyTracker` is a telemetry listener (``llm.add_listener(tracker)``) that keeps
every finished request's time to first token and every gap between its tokens (the
``RequestEvent`` carries them), and reports their percentiles, and the goodput under an
SLO, as the bench commands do::

    tracker = LatencyTracker()
    llm.add_listener(tracker)
    ...
    tracker.summary(slo_ttft_ms=2000, slo_itl_ms=200)
    # {'requests': 40, 'ttft_p50_ms': ..., 'itl_p99_9_ms': ..., 'itl_max_ms': ..., 'goodput': 0.95}
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from llamabatch.outputs import slo_met
from llamabatch.runtime.telemetry import RequestEvent

__all__ = ["LatencyTracker"]


class LatencyTracker:
    """A listener keeping the latency figures of finished requests (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ttft: list[float] = []
        self._gaps: list[float] = []
        #: per request: (ttft or None, its own ITL p99 or None)
        self._requests: list[tuple[float | None, float | None]] = []

    def __call__(self, event: Any) -> None:
        if not isinstance(event, RequestEvent):
            return
        with self._lock:
            if event.time_to_first_token is not None:
                self._ttft.append(event.time_to_first_token)
            self._gaps.extend(event.inter_token_latencies)
            self._requests.append((event.time_to_first_token, event.itl_max))

    def clear(self) -> None:
        """Forget what was recorded."""
        with self._lock:
            self._ttft.clear()
            self._gaps.clear()
            self._requests.clear()

    def summary(self, *, slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None) -> dict[str, Any]:
        """``requests``; TTFT p50/p90/p99 and ITL p50/p90/p99/p99.9/max over every token gap
        (milliseconds; None without data); with an SLO, ``goodput``: the share of requests
        that met it (``outputs.slo_met``: the first token in time, no gap over the ITL bound;
        a request without a first token missed it)."""
        with self._lock:
            ttft = np.asarray(self._ttft, dtype=np.float64) * 1000.0
            gaps = np.asarray(self._gaps, dtype=np.float64) * 1000.0
            requests = list(self._requests)
        out: dict[str, Any] = {"requests": len(requests)}
        for name, values, points in (
            ("ttft", ttft, (50, 90, 99)),
            ("itl", gaps, (50, 90, 99, 99.9)),
        ):
            figures = np.percentile(values, points).tolist() if len(values) else [None] * len(points)
            for p, v in zip(points, figures, strict=True):
                out[f"{name}_p{p:g}_ms".replace(".", "_")] = v
        out["itl_max_ms"] = float(gaps.max()) if len(gaps) else None
        if slo_ttft_ms is not None or slo_itl_ms is not None:
            slo_ttft = None if slo_ttft_ms is None else slo_ttft_ms / 1000.0
            slo_itl = None if slo_itl_ms is None else slo_itl_ms / 1000.0
            met = sum(slo_met(first, itl_max, slo_ttft, slo_itl) for first, itl_max in requests)
            out["goodput"] = met / len(requests) if requests else None
        return out
