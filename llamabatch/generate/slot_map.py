"""Which request runs in which slot: the engine core's one record of it."""

from __future__ import annotations

from llamabatch.generate.request import Request

__all__ = ["SlotMap"]


class SlotMap:
    """Which request runs in which slot: the one record of it (the slot table knows what
    each slot's sequence holds, not whose it is)."""

    __slots__ = ("_by_key", "requests")

    def __init__(self, n_slots: int) -> None:
        #: slot -> the request running there, or None (read-only for everyone but the core)
        self.requests: list[Request | None] = [None] * n_slots
        self._by_key: dict[int, int] = {}

    def assign(self, slot: int, request: Request) -> None:
        assert self.requests[slot] is None, f"slot {slot} is taken"
        self.requests[slot] = request
        self._by_key[request.arrival] = slot

    def release(self, slot: int) -> Request | None:
        request = self.requests[slot]
        if request is not None:
            self.requests[slot] = None
            del self._by_key[request.arrival]
        return request

    def move(self, src: int, dst: int) -> None:
        """The request of slot ``src`` runs in the idle slot ``dst`` now (``compaction.py``)."""
        request = self.release(src)
        assert request is not None, f"slot {src} is idle"
        self.assign(dst, request)

    def slot_of(self, request: Request) -> int:
        """The slot ``request`` runs in, or -1."""
        return self._by_key.get(request.arrival, -1)

    def busy(self) -> list[tuple[int, Request]]:
        return [(s, r) for s, r in enumerate(self.requests) if r is not None]
