"""``ChatOutputParser``: one completion's text, streamed or whole, split into reasoning,
content and tool calls.

The same parser serves both: a whole answer is one ``feed`` then ``finish``, a stream is many
``feed`` calls, and each step only resolves what can no longer change (text that could still
begin a marker is held back), so the concatenated stream equals the whole answer's parse.
Trailing whitespace of the content is held until more content follows: an answer that ends in
calls drops it (and ``content`` is then empty: None in OpenAI's message).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamabatch.outputs import ToolCall
from llamabatch.toolcalls.base import ToolFormat
from llamabatch.toolcalls.reasoning import ReasoningSplitter, held_suffix

__all__ = ["ChatDelta", "ChatOutputParser"]


@dataclass
class ChatDelta:
    """What one piece of the answer resolved: content, reasoning and finished tool calls (each
    with its ``index`` among the answer's calls)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[int, ToolCall]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatOutputParser:
    """Parses one completion. ``fmt`` None: no tool calls are read; ``reasoning`` False: no
    ``<think>`` split; ``in_reasoning``: the prompt opened the ``<think>`` block."""

    def __init__(
        self,
        fmt: ToolFormat | None,
        *,
        reasoning: bool = True,
        in_reasoning: bool = False,
        parallel: bool = True,
    ) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self._splitter = ReasoningSplitter(in_reasoning) if reasoning else None
        self._buf = ""
        self._in_section = False
        self._section_read = 0  # how much of a waiting section was already read
        self._pending_ws = ""
        self._started = False  # non-whitespace content was emitted
        self._after_call = False
        self._finished = False
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []

    # -- feeding -----------------------------------------------------------------------------

    def feed(self, text: str) -> ChatDelta:
        """Resolve the next piece of the answer."""
        return self._step(text, final=False)

    def finish(self) -> ChatDelta:
        """Resolve everything held back: the answer has ended."""
        if self._finished:
            return ChatDelta()
        delta = self._step("", final=True)
        self._finished = True
        if self._pending_ws and not self.tool_calls:
            delta.content += self._pending_ws
            self.content += self._pending_ws
        self._pending_ws = ""
        return delta

    def _step(self, text: str, final: bool) -> ChatDelta:
        if self._finished:
            raise ValueError("ChatOutputParser: feed() after finish()")
        delta = ChatDelta()
        if self._splitter is not None:
            reasoning, text = self._splitter.feed(text, final)
            delta.reasoning = reasoning
            self.reasoning += reasoning
        self._buf += text
        if self.fmt is None:
            self._emit(self._buf, delta)
            self._buf = ""
        else:
            self._scan(delta, final)
        return delta

    def _emit(self, text: str, delta: ChatDelta) -> None:
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        if self._after_call:  # whitespace between a call and the content is not content
            self._pending_ws, self._after_call = "", False
            body = body.lstrip()
        text, self._pending_ws = self._pending_ws + body, text[len(text.rstrip()) :]
        self._started = True
        delta.content += text
        self.content += text

    def _add_calls(self, calls: list, delta: ChatDelta) -> None:
        assert self.fmt is not None
        self._pending_ws = ""  # whitespace between content and a call is not content
        self._after_call = True
        for call in calls:
            if self.tool_calls and not self.parallel:
                return
            tool_call = ToolCall(id=self.fmt.new_id(), name=call.name, arguments=call.arguments)
            delta.tool_calls.append((len(self.tool_calls), tool_call))
            self.tool_calls.append(tool_call)

    def _scan(self, delta: ChatDelta, final: bool) -> None:
        fmt = self.fmt
        assert fmt is not None
        while self._buf:
            buf = self._buf
            if self._in_section:
                fresh = buf[self._section_read :]
                if not final and not any(ch in fresh for ch in fmt.section_end_chars):
                    self._section_read = len(buf)
                    return  # cannot have completed: not parsed again (long calls stay linear)
                section = fmt.parse_section(buf, final)
                if section is None:
                    self._section_read = len(buf)
                    return
                self._section_read = 0
                consumed = max(section.consumed, 1)
                if section.calls is None:
                    self._emit(buf[:consumed], delta)
                    self._started = True
                else:
                    self._add_calls(section.calls, delta)
                self._buf, self._in_section = buf[consumed:], False
                continue
            if not self._started and fmt.leading_markers and not self.tool_calls:
                stripped = buf.lstrip()
                if any(stripped.startswith(m) for m in fmt.leading_markers):
                    self._pending_ws += buf[: len(buf) - len(stripped)]
                    self._buf, self._in_section = stripped, True
                    continue
                if not final and any(m.startswith(stripped) for m in fmt.leading_markers):
                    return  # may still become a leading marker
            starts = [(i, m) for m in fmt.start_markers if (i := buf.find(m)) >= 0]
            if starts:
                index = min(starts)[0]
                self._emit(buf[:index], delta)
                self._buf, self._in_section = buf[index:], True
                continue
            keep = 0 if final else held_suffix(buf, fmt.start_markers)
            self._emit(buf[: len(buf) - keep], delta)
            self._buf = buf[len(buf) - keep :]
            return
