"""Reproducible examples of a hypothesis strategy outside ``@given`` (a child process's
inputs, a table of cases): shared by the fuzz tests."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def draw_examples(strategy: st.SearchStrategy, n: int) -> list[Any]:
    """``n`` examples of ``strategy``, reproducibly (hypothesis, derandomized)."""
    out: list[Any] = []

    @settings(
        max_examples=n,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    collect()
    return out[:n]
