"""``RequestStatus``: the named states of a generation request and their allowed edges, and
``FinishReason``: the names of its ends.

A leaf module (``outputs.py`` and ``request.py`` both use it).
"""

from __future__ import annotations

import enum
from typing import Literal

__all__ = ["STATUS_EDGES", "FinishReason", "InvalidTransition", "RequestStatus"]

#: why a completion ended (OpenAI's ``finish_reason``)
FinishReason = Literal["stop", "length", "cancelled", "error", "tool_calls"]


class RequestStatus(enum.Enum):
    """Where a request is in its life; changed only by :meth:`Request.transition`, along
    the edges of :data:`STATUS_EDGES` (as ``SlotState``'s in the Cython slot table).

    ``WAITING`` (queued) -> ``RUNNING`` (holds a slot) -> one of the ``FINISHED_*`` ends; a
    running request may be ``PREEMPTED`` (its KV freed, back in the queue, recomputed when
    it runs again). ``FINISHED_TOOL_CALLS`` is never an engine state: the chat layer marks a
    ``StepOutput`` with it when an answer the engine ended as ``FINISHED_STOPPED`` held tool
    calls (its ``finish_reason`` is then ``"tool_calls"``)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_CANCELLED = "cancelled"
    FINISHED_ERROR = "error"
    FINISHED_TOOL_CALLS = "tool_calls"

    @property
    def finished(self) -> bool:
        """Whether this is an end (no edge leaves it)."""
        return self.value in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The ``finish_reason`` of an end (``"stop"``, ``"length"``, ...), else None."""
        return self.value if self.value in _FINISH_REASONS else None  # type: ignore[return-value]

    @classmethod
    def finished_with(cls, reason: FinishReason) -> RequestStatus:
        """The end that ``reason`` names."""
        status = cls(reason)
        if not status.finished:
            raise ValueError(f"not a finish reason: {reason!r}")
        return status


_FINISH_REASONS = frozenset({"stop", "length", "cancelled", "error", "tool_calls"})
_ENDS = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_CANCELLED,
        RequestStatus.FINISHED_ERROR,
    }
)
#: the allowed edges: a waiting (or preempted) request starts or is ended (cancelled, or
#: failed when the engine closes or crashes); a running one is preempted or ends any way
STATUS_EDGES: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_ERROR}
    ),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED} | _ENDS),
    RequestStatus.PREEMPTED: frozenset(
        {RequestStatus.RUNNING, RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_ERROR}
    ),
    RequestStatus.FINISHED_STOPPED: frozenset(),
    RequestStatus.FINISHED_LENGTH: frozenset(),
    RequestStatus.FINISHED_CANCELLED: frozenset(),
    RequestStatus.FINISHED_ERROR: frozenset(),
    RequestStatus.FINISHED_TOOL_CALLS: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A request status change along no edge of :data:`STATUS_EDGES` (an engine bug)."""
