"""A chat answer read: the typed deltas of a streamed answer (``ChatStream``), the one
finish-reason rule, and the assistant message of a whole answer in OpenAI's shape.

Every reader of answers goes through ``ChatStream``: ``LLM.chat`` and the server's whole
answers (``ChatSetup.finish_output``: one ``feed`` then ``finish``), ``LLMEngine.step`` and
the server's streams (a ``feed`` per new piece of text). So a streamed answer's deltas add up
to the whole answer's split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, overload

from llamabatch.outputs import CompletionOutput, FinishReason, ToolCall
from llamabatch.toolcalls.stream import ChatDelta, ChatOutputParser

__all__ = [
    "ChatPiece",
    "ChatStream",
    "ContentDelta",
    "ReasoningDelta",
    "ToolCallArguments",
    "ToolCallHead",
    "answer_finish_reason",
    "assistant_message",
]


@dataclass(frozen=True)
class ContentDelta:
    """New answer text (the content, outside ``<think>`` blocks and tool calls)."""

    text: str

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's streamed ``delta``."""
        return {"content": self.text}


@dataclass(frozen=True)
class ReasoningDelta:
    """New text of the answer's ``<think>`` block."""

    text: str

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's streamed ``delta`` (``reasoning_content``, as vLLM and DeepSeek name it)."""
        return {"reasoning_content": self.text}


@dataclass(frozen=True)
class ToolCallHead:
    """A tool call begins: its ``index`` among the answer's calls, ``id`` and function ``name``
    (its ``ToolCallArguments`` follow)."""

    index: int
    id: str
    name: str

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's streamed ``delta``: the call's shape with empty arguments."""
        return {"tool_calls": [{"index": self.index, **ToolCall(self.id, self.name, "").to_dict()}]}


@dataclass(frozen=True)
class ToolCallArguments:
    """Arguments (JSON text) of the tool call at ``index``."""

    index: int
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's streamed ``delta``."""
        return {"tool_calls": [{"index": self.index, "function": {"arguments": self.arguments}}]}


#: one typed delta of a streamed chat answer
ChatPiece = ContentDelta | ReasoningDelta | ToolCallHead | ToolCallArguments


@overload
def answer_finish_reason(reason: FinishReason, tool_calls: list[ToolCall]) -> FinishReason: ...
@overload
def answer_finish_reason(reason: None, tool_calls: list[ToolCall]) -> None: ...
def answer_finish_reason(reason: FinishReason | None, tool_calls: list[ToolCall]) -> FinishReason | None:
    """``"tool_calls"`` for an answer that stopped after calls, else ``reason``: the one rule
    for whole and streamed answers."""
    return "tool_calls" if reason == "stop" and tool_calls else reason


class ChatStream:
    """One completion's answer, fed piece by piece: typed deltas out, and at the end the
    finish reason and the whole answer split. ``parser`` None: nothing is split (every piece
    is content)."""

    def __init__(self, parser: ChatOutputParser | None) -> None:
        self._parser = parser
        #: the answer's finish reason, once ``finish`` was called
        self.finish_reason: FinishReason | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far."""
        return self._parser.tool_calls if self._parser is not None else []

    def feed(self, text: str) -> list[ChatPiece]:
        """The deltas that the next piece of the answer resolves (text that may still begin a
        marker is held back)."""
        if not text:
            return []
        if self._parser is None:
            return [ContentDelta(text)]
        return _pieces(self._parser.feed(text))

    def finish(self, reason: FinishReason | None) -> list[ChatPiece]:
        """The answer ended with ``reason``: the deltas of what was held back (none after an
        error: its text is not split), and ``finish_reason`` set."""
        parser = self._parser
        pieces = _pieces(parser.finish()) if parser is not None and reason != "error" else []
        self.finish_reason = answer_finish_reason(reason, self.tool_calls)
        return pieces

    def output(self, out: CompletionOutput) -> CompletionOutput:
        """``out``, the whole answer of this stream after ``finish``, with its text split into
        content, ``reasoning`` and ``tool_calls`` (unchanged when nothing is split or it
        ended in an error)."""
        parser = self._parser
        if parser is None or out.finish_reason == "error":
            return out
        return dataclasses.replace(
            out,
            text=parser.content,
            reasoning=parser.reasoning or None,
            tool_calls=list(parser.tool_calls),
            finish_reason=answer_finish_reason(out.finish_reason, parser.tool_calls),
        )


def _pieces(delta: ChatDelta) -> list[ChatPiece]:
    pieces: list[ChatPiece] = []
    if delta.reasoning:
        pieces.append(ReasoningDelta(delta.reasoning))
    if delta.content:
        pieces.append(ContentDelta(delta.content))
    for index, call in delta.tool_calls:
        pieces.append(ToolCallHead(index, call.id, call.name))
        pieces.append(ToolCallArguments(index, call.arguments))
    return pieces


def assistant_message(out: CompletionOutput) -> dict[str, Any]:
    """The assistant message of a split answer in OpenAI's shape (``content``,
    ``reasoning_content`` when the model thought, ``tool_calls``; ``content`` None for an
    answer that is only calls): the server's reply, and the next turn's history."""
    message: dict[str, Any] = {"role": "assistant", "content": out.text}
    if out.reasoning is not None:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [call.to_dict() for call in out.tool_calls]
        if not out.text:
            message["content"] = None
    return message
