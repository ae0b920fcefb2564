"""The chat path shared by ``LLM.chat`` and ``LLMEngine.add_request``: a conversation rendered
with its tools, and the ``ChatSetup`` that samples and reads its answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from llamabatch.outputs import CompletionOutput, StepOutput
from llamabatch.params import SamplingParams
from llamabatch.prompts.chat_template import chat_prompt_tokens, render_chat
from llamabatch.status import RequestStatus
from llamabatch.toolcalls import check_tool_call_parser
from llamabatch.toolcalls.chat import ChatSetup, prepare_chat
from llamabatch.toolcalls.reasoning import check_reasoning_format
from llamabatch.toolcalls.stream import ChatDelta, ChatOutputParser

__all__ = ["ChatOptions", "ChatRequestOptions", "EngineChat", "chat_request", "is_conversation"]


class ChatOptions:
    """An engine's chat defaults: ``tool_call_parser`` ("auto": from the chat template, a
    format name, or "none") and ``reasoning_format`` ("auto" or "none")."""

    def __init__(self, tool_call_parser: str = "auto", reasoning_format: str = "auto") -> None:
        self.tool_call_parser = check_tool_call_parser(tool_call_parser)
        self.reasoning_format = check_reasoning_format(reasoning_format)


def is_conversation(prompt: object) -> bool:
    """Whether ``prompt`` is a list of chat messages (mappings), not text or token ids."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and isinstance(prompt[0], Mapping)
    )


def chat_request(
    host: Any,
    options: ChatOptions,
    conversation: Sequence[Mapping[str, Any]],
    params: SamplingParams | Mapping[str, Any] | None,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: object = None,
    parallel_tool_calls: bool = True,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], ChatSetup]:
    """The prompt tokens of ``conversation`` for ``host``'s model (an ``LLM`` or ``LLMEngine``;
    the caller keeps the model alive) and the request's ``ChatSetup``."""
    text = render_chat(
        host.model,
        conversation,
        tools=None if tool_choice == "none" else tools,  # "none": the model is not offered them
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
    )
    setup = prepare_chat(
        SamplingParams.coerce(params),
        template=chat_template if chat_template is not None else host.model.chat_template,
        prompt=text,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        tool_call_parser=options.tool_call_parser,
        reasoning_format=options.reasoning_format,
    )
    return chat_prompt_tokens(host.model, text), setup


class ChatRequestOptions(TypedDict, total=False):
    """``LLMEngine.add_request``'s options for a conversation (as ``LLM.chat`` takes them)."""

    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool
    chat_template: str | None
    add_generation_prompt: bool
    chat_template_kwargs: Mapping[str, Any] | None


class EngineChat:
    """One ``LLMEngine`` chat request's parsers (one per completion): each ``StepOutput``'s
    text split into content, reasoning and tool calls, and the final outputs split alike."""

    def __init__(self, setup: ChatSetup) -> None:
        self.setup = setup
        self.parsers: dict[int, ChatOutputParser] = {}
        #: completion index -> its split final output
        self.outputs: dict[int, CompletionOutput] = {}

    def split(self, step: StepOutput) -> StepOutput:
        """``step`` with ``text`` the new content, ``reasoning`` and ``tool_calls`` set."""
        parser = self.parsers.get(step.index)
        if parser is None:
            parser = self.parsers[step.index] = self.setup.parser()
        delta = parser.feed(step.text) if step.text else ChatDelta()
        output, finish_reason = step.output, step.finish_reason
        if step.finished and finish_reason not in ("error", "cancelled"):
            tail = parser.finish()
            delta.content += tail.content
            delta.reasoning += tail.reasoning
            delta.tool_calls += tail.tool_calls
            if parser.tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            if output is not None and finish_reason is not None:
                output = dataclasses.replace(
                    output,
                    text=parser.content,
                    reasoning=parser.reasoning or None,
                    tool_calls=list(parser.tool_calls),
                    finish_reason=finish_reason,
                )
                self.outputs[step.index] = output
        return dataclasses.replace(
            step,
            text=delta.content,
            reasoning=delta.reasoning,
            tool_calls=[call for _, call in delta.tool_calls],
            finish_reason=finish_reason,
            output=output,
            status=RequestStatus.FINISHED_TOOL_CALLS if finish_reason == "tool_calls" else step.status,
        )
