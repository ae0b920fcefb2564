"""The one chat pipeline, shared by ``LLM.chat``, ``LLMEngine.add_request`` and the server's
``/v1/chat/completions``.

* ``prepare(facade, messages, params, tools, ...)`` returns ``(tokens, setup)``: the
  conversation rendered with the chat template and tokenized (``render``), then the request's
  ``ChatSetup`` (``RenderedChat.setup``: ``tools`` and ``tool_choice`` as grammars, the
  tool-call format, whether ``<think>`` blocks are split). Its errors
  (``ChatRequestError``) name the request field at fault.
* ``setup.finish_output(out)`` splits a whole answer into content, ``reasoning`` and
  ``tool_calls``; ``setup.stream()`` reads a streamed one piece by piece as typed deltas
  (``ContentDelta``, ``ReasoningDelta``, ``ToolCallHead``, ``ToolCallArguments``). A stop after
  tool calls is ``finish_reason`` ``"tool_calls"`` (``answer_finish_reason``).
* ``assistant_message(out)``, ``ToolCall.to_dict`` and the deltas' ``to_dict`` are OpenAI's
  shapes.

The text-level pieces live in ``toolcalls/``: the formats of each model family, the parser of
one answer (``toolcalls/stream.py``) and the ``<think>`` splitter (``toolcalls/reasoning.py``).
"""

from __future__ import annotations

from llamabatch.chat.answer import (
    ChatPiece,
    ChatStream,
    ContentDelta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallHead,
    answer_finish_reason,
    assistant_message,
)
from llamabatch.chat.engine import EngineChat
from llamabatch.chat.request import (
    ChatFacade,
    ChatOptions,
    ChatRequest,
    ChatRequestOptions,
    RenderedChat,
    is_conversation,
    prepare,
    render,
)
from llamabatch.chat.setup import ChatRequestError, ChatSetup, check_tool_choice, prepare_chat

__all__ = [
    "ChatFacade",
    "ChatOptions",
    "ChatPiece",
    "ChatRequest",
    "ChatRequestError",
    "ChatRequestOptions",
    "ChatSetup",
    "ChatStream",
    "ContentDelta",
    "EngineChat",
    "ReasoningDelta",
    "RenderedChat",
    "ToolCallArguments",
    "ToolCallHead",
    "answer_finish_reason",
    "assistant_message",
    "check_tool_choice",
    "is_conversation",
    "prepare",
    "prepare_chat",
    "render",
]
