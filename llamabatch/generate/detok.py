"""Incremental detokenization and stop strings, per request.

Token pieces are bytes and a UTF-8 character may span tokens: bytes are decoded with an
incremental decoder that holds back an incomplete character. Text that could be the
start of a stop string is held back until it is resolved.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class StopMatcher:
    """Feeds text through, holding back what might begin a stop string."""

    __slots__ = ("_held", "_max_len", "include", "stops")

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = tuple(stops)
        #: the matched stop string stays in the text (vLLM's ``include_stop_str_in_output``)
        self.include = include
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the stop string matched or None). After a match, the
        emitted text ends just before the stop string (with ``include``, just after it)."""
        if not self.stops:
            return text, None
        buf = self._held + text
        first_at, first_stop = -1, None
        for stop in self.stops:
            at = buf.find(stop)
            if at != -1 and (first_at == -1 or at < first_at):
                first_at, first_stop = at, stop
        if first_stop is not None:
            self._held = ""
            return buf[: first_at + (len(first_stop) if self.include else 0)], first_stop
        # Hold back the longest tail that is a proper prefix of some stop string.
        hold = 0
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                hold = k
                break
        self._held = buf[len(buf) - hold :] if hold else ""
        return (buf[: len(buf) - hold] if hold else buf), None

    def flush(self) -> str:
        """Text still held when the generation ends for another reason."""
        held, self._held = self._held, ""
        return held


class IncrementalDetokenizer:
    """Token pieces (bytes) in, whole UTF-8 text out."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
