"""``runtime/thread_priority.py``: a thread's niceness is raised for it alone, counted from
the main thread's, inherited by the threads it starts, and never lowered."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from llamabatch.runtime.thread_priority import MAX_NICE, lower_thread_priority, thread_niceness

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def on_new_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own (niceness cannot be lowered back: never the test's)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(10)
    return out[0]


def main_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


def test_the_calling_thread_alone_is_niced_from_the_main_threads_niceness() -> None:
    before = main_nice()
    done, nice = on_new_thread(lambda: (lower_thread_priority(3), thread_niceness()))
    assert done and nice == min(MAX_NICE, before + 3)
    assert main_nice() == before and thread_niceness() == before


def test_threads_started_by_a_niced_thread_inherit_its_niceness() -> None:
    def parent() -> int:
        lower_thread_priority(4)
        return on_new_thread(thread_niceness)  # type: ignore[no-any-return]

    assert on_new_thread(parent) == min(MAX_NICE, main_nice() + 4)


def test_niceness_is_never_lowered_and_zero_does_nothing() -> None:
    def twice() -> tuple[bool, int | None, bool, int | None]:
        lower_thread_priority(6)
        return lower_thread_priority(2), thread_niceness(), lower_thread_priority(0), thread_niceness()

    kept, nice, zero, after = on_new_thread(twice)
    assert kept and nice == after == min(MAX_NICE, main_nice() + 6)
    assert zero is False


def test_niceness_is_capped_at_19() -> None:
    def most() -> int | None:
        lower_thread_priority(MAX_NICE)
        lower_thread_priority(MAX_NICE)
        return thread_niceness()

    assert on_new_thread(most) == MAX_NICE


@pytest.mark.parametrize("bad", [-1, 20, 2.0, True, "5", None])
def test_a_bad_niceness_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="nice"):
        lower_thread_priority(bad)


def test_elsewhere_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert lower_thread_priority(5) is False and thread_niceness() is None
