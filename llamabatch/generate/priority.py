"""Request priorities: the order of the waiting queue, and whom a higher priority preempts.

A request's ``priority`` is an int, lower first (as vLLM); the default 0 for all keeps
first come, first served. The queue is ordered by :func:`wait_key`: priority, then
preempted requests before new ones (they were admitted once), then arrival. When a
waiting request cannot start (no idle slot, or with a unified KV cache no room for its
prompt) and a request of a lower priority (a higher number) runs, the most recently
admitted such request is preempted: its KV cells are freed and it goes back to the queue,
to be recomputed later with what it generated so far (invisible to its caller, as a
preemption for KV room).

No starvation of a running request: one that was already preempted
``MAX_PRIORITY_PREEMPTIONS`` times (for any reason) is no longer preempted for priority,
so it runs to its end once admitted again. Waiting requests of a low priority wait while
higher ones keep arriving (as in vLLM): priorities are an order, not a share.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from llamabatch.generate.request import Request, RequestKind
from llamabatch.status import RequestStatus

__all__ = ["MAX_PRIORITY_PREEMPTIONS", "check_priority", "enqueue", "priority_victim", "wait_key"]

#: how often one request may be preempted (for any reason) and still be preempted for priority
MAX_PRIORITY_PREEMPTIONS = 2


def check_priority(priority: object) -> int:
    """``priority`` as an int; ``ValueError`` for anything else (a bool included)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int (lower runs first), got {priority!r}")
    if not -(2**31) <= priority < 2**31:
        raise ValueError(f"priority must fit 32 bits, got {priority!r}")
    return priority


def wait_key(request: Request) -> tuple[int, int, int]:
    """A waiting request's place: priority, preempted before new, then arrival."""
    return (request.priority, 0 if request.status is RequestStatus.PREEMPTED else 1, request.arrival)


def enqueue(waiting: deque[Request], requests: Iterable[Request]) -> None:
    """Put ``requests`` into ``waiting`` at their places (:func:`wait_key`)."""
    for request in requests:
        key = wait_key(request)
        if not waiting or wait_key(waiting[-1]) <= key:
            waiting.append(request)
        else:
            waiting.insert(bisect.bisect_right(waiting, key, key=wait_key), request)


def priority_victim(running: Iterable[tuple[int, Request]], priority: int) -> int:
    """The slot of the most recently admitted running request of a priority lower than
    ``priority`` (a higher number) that may still be preempted, or -1."""
    best_slot, best_order = -1, -1
    for slot, request in running:
        if (
            request.priority > priority
            and request.n_preemptions < MAX_PRIORITY_PREEMPTIONS
            and request.kind is not RequestKind.PIN
            and request.admitted_order > best_order
        ):
            best_slot, best_order = slot, request.admitted_order
    return best_slot
