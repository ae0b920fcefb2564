"""``EngineChat``: an ``LLMEngine`` chat request's answers read step by step, through the same
``ChatStream`` as every other reader."""

from __future__ import annotations

import dataclasses

from llamabatch.chat.answer import ChatStream, ContentDelta, ReasoningDelta
from llamabatch.chat.setup import ChatSetup
from llamabatch.outputs import CompletionOutput, StepOutput
from llamabatch.status import RequestStatus

__all__ = ["EngineChat"]


class EngineChat:
    """One ``LLMEngine`` chat request's readers (one per completion): each ``StepOutput``'s
    text split into content, reasoning and tool calls, and the final outputs split alike."""

    def __init__(self, setup: ChatSetup) -> None:
        self.setup = setup
        self.streams: dict[int, ChatStream] = {}
        #: completion index -> its split final output
        self.outputs: dict[int, CompletionOutput] = {}

    def split(self, step: StepOutput) -> StepOutput:
        """``step`` with ``text`` the new content, ``reasoning`` and ``tool_calls`` set."""
        stream = self.streams.get(step.index)
        if stream is None:
            stream = self.streams[step.index] = self.setup.stream()
        n_calls = len(stream.tool_calls)
        pieces = stream.feed(step.text)
        output, finish_reason = step.output, step.finish_reason
        if step.finished:
            pieces += stream.finish(finish_reason)
            finish_reason = stream.finish_reason
            if output is not None:
                output = self.outputs[step.index] = stream.output(output)
        return dataclasses.replace(
            step,
            text="".join(p.text for p in pieces if isinstance(p, ContentDelta)),
            reasoning="".join(p.text for p in pieces if isinstance(p, ReasoningDelta)),
            tool_calls=stream.tool_calls[n_calls:],
            finish_reason=finish_reason,
            output=output,
            status=RequestStatus.FINISHED_TOOL_CALLS if finish_reason == "tool_calls" else step.status,
        )
