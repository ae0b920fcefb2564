"""Tool calls and reasoning content on ``/v1/chat/completions``: the request's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` read, the answer split into ``content``,
``reasoning_content`` and ``tool_calls`` (OpenAI's message shape), and the streamed deltas in
OpenAI's chunk shape: each call's ``index``, ``id``, ``type`` and ``name`` first, then its
``arguments``. Built on :mod:`llamabatch.toolcalls`; the handler in ``app.py`` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llamabatch.outputs import CompletionOutput, ToolCall
from llamabatch.params import SamplingParams
from llamabatch.server.protocol import Body, bad_request
from llamabatch.toolcalls.chat import ChatSetup, prepare_chat
from llamabatch.toolcalls.host import ChatOptions
from llamabatch.toolcalls.stream import ChatDelta, ChatOutputParser

__all__ = ["ChatStream", "ToolRequest", "chat_message", "read_tool_request", "setup_chat"]


@dataclass(frozen=True)
class ToolRequest:
    """The request's tool fields: ``tools`` as given (None without), ``tool_choice``,
    ``parallel_tool_calls``."""

    tools: list[Any] | None
    tool_choice: Any
    parallel_tool_calls: bool

    @property
    def template_tools(self) -> list[Any] | None:
        """The tools the chat template shows the model (none with ``tool_choice: "none"``)."""
        return None if self.tool_choice == "none" else self.tools


def read_tool_request(body: Body) -> ToolRequest:
    """Read ``tools``, ``tool_choice`` and ``parallel_tool_calls`` from ``body`` (types only;
    :func:`setup_chat` checks the rest)."""
    tools = body.get("tools", "list")
    tool_choice = body.data.get("tool_choice")
    body.read.add("tool_choice")
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise bad_request("'tool_choice' must be a string or an object", param="tool_choice")
    parallel = body.get("parallel_tool_calls", "bool", True)
    return ToolRequest(tools, tool_choice, parallel)


def setup_chat(
    params: SamplingParams, tool_request: ToolRequest, options: ChatOptions, template: str | None, prompt: str
) -> ChatSetup:
    """The request's ``ChatSetup`` (grammar building: call it off the event loop); a bad tool
    or ``tool_choice`` is a 400 naming it."""
    try:
        return prepare_chat(
            params,
            template=template,
            prompt=prompt,
            tools=tool_request.tools,
            tool_choice=tool_request.tool_choice,
            parallel_tool_calls=tool_request.parallel_tool_calls,
            tool_call_parser=options.tool_call_parser,
            reasoning_format=options.reasoning_format,
        )
    except ValueError as exc:
        text = str(exc)
        param = "tool_choice" if text.startswith("tool_choice") else "tools"
        raise bad_request(text, param=param) from None


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(out: CompletionOutput) -> dict[str, Any]:
    """The assistant message of a finished (already split) output."""
    message: dict[str, Any] = {"role": "assistant", "content": out.text}
    if out.reasoning is not None:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [_tool_call(call) for call in out.tool_calls]
        if not out.text:
            message["content"] = None
    return message


class ChatStream:
    """One choice's streamed deltas, split as :func:`chat_message` splits the whole answer."""

    def __init__(self, setup: ChatSetup) -> None:
        self.parser: ChatOutputParser | None = setup.parser() if setup.parses else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The OpenAI ``delta`` objects for the next piece of text."""
        if self.parser is None:
            return [{"content": text}] if text else []
        return _deltas(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of everything held back, at the end of the answer."""
        return _deltas(self.parser.finish()) if self.parser is not None else []

    def finish_reason(self, reason: str) -> str:
        """``"tool_calls"`` for an answer that stopped after calls, else ``reason``."""
        if reason == "stop" and self.parser is not None and self.parser.tool_calls:
            return "tool_calls"
        return reason


def _deltas(delta: ChatDelta) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if delta.reasoning:
        out.append({"reasoning_content": delta.reasoning})
    if delta.content:
        out.append({"content": delta.content})
    for index, call in delta.tool_calls:
        head = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        out.append({"tool_calls": [head]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return out
