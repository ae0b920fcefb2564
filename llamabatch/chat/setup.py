"""``ChatSetup``: how one chat request samples (``tools``, ``tool_choice`` and the reasoning
format turned into its sampling parameters) and how its answers are read.

``tool_choice``:

* ``"none"``: the tools are still shown to the template, nothing is parsed or forced;
* ``"auto"`` (the default with tools): free text; a lazy grammar wakes up when the family's
  tool-call marker appears and constrains the call to the tools' JSON schemas;
* ``"required"``: the whole answer is a call section (a grammar from the schemas forces it);
* ``{"type": "function", "function": {"name": NAME}}``: the answer is one call of NAME.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llamabatch.chat.answer import ChatStream
from llamabatch.outputs import CompletionOutput
from llamabatch.params import SamplingParams
from llamabatch.toolcalls import ToolFormat, ToolSpec, detect_format, get_format, normalize_tools
from llamabatch.toolcalls.reasoning import check_reasoning_format, prompt_opens_reasoning
from llamabatch.toolcalls.stream import ChatOutputParser

__all__ = ["ChatRequestError", "ChatSetup", "check_tool_choice", "prepare_chat"]

TOOL_CHOICES = ("none", "auto", "required")


class ChatRequestError(ValueError):
    """A chat request's field is wrong; ``param`` names it (``"messages"``, ``"tools"``,
    ``"tool_choice"``, ``"parallel_tool_calls"``, ``"chat_template_kwargs"``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tool_choice(tool_choice: object, tools: Sequence[ToolSpec]) -> tuple[str, str | None]:
    """``(mode, name)``: mode "none", "auto", "required" or "function" (then ``name`` is the
    function's). ``ChatRequestError`` (``param="tool_choice"``) names what is wrong."""

    def error(message: str) -> ChatRequestError:
        return ChatRequestError(message, "tool_choice")

    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise error(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                f"{{'type': 'function', 'function': {{'name': ...}}}}; got {tool_choice!r}"
            )
        if tool_choice == "required" and not tools:
            raise error("tool_choice 'required' needs tools")
        return tool_choice, None
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise error("tool_choice must be {'type': 'function', 'function': {'name': NAME}}")
        if name not in {tool.name for tool in tools}:
            raise error(f"tool_choice names the function {name!r}, which is not in tools")
        return "function", name
    raise error(f"tool_choice must be a string or an object, got {type(tool_choice).__name__}")


@dataclass(frozen=True)
class ChatSetup:
    """How one chat request samples (``params``) and how its answers are read: ``fmt`` the
    tool-call format (None: no calls are read), ``reasoning`` whether ``<think>`` blocks are
    split out, ``in_reasoning`` whether the prompt opened one, ``parallel`` whether more than
    one call is read."""

    params: SamplingParams
    fmt: ToolFormat | None
    reasoning: bool
    in_reasoning: bool
    parallel: bool

    def parser(self) -> ChatOutputParser:
        """A fresh parser for one completion of the request."""
        return ChatOutputParser(
            self.fmt, reasoning=self.reasoning, in_reasoning=self.in_reasoning, parallel=self.parallel
        )

    @property
    def parses(self) -> bool:
        """Whether answers are split at all (tool calls or reasoning)."""
        return self.fmt is not None or self.reasoning

    def stream(self) -> ChatStream:
        """A reader of one completion's answer, fed piece by piece: typed deltas (content,
        reasoning, tool-call head, arguments), then the finish reason and the split answer."""
        return ChatStream(self.parser() if self.parses else None)

    def finish_output(self, out: CompletionOutput) -> CompletionOutput:
        """``out`` (a whole answer) with its text split into content, ``reasoning`` and
        ``tool_calls``, and ``finish_reason`` ``"tool_calls"`` when it stopped after calls."""
        stream = self.stream()
        stream.feed(out.text)
        stream.finish(out.finish_reason)
        return stream.output(out)


def prepare_chat(
    params: SamplingParams,
    *,
    template: str | None,
    prompt: str,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: object = None,
    parallel_tool_calls: bool = True,
    tool_call_parser: str = "auto",
    reasoning_format: str = "auto",
) -> ChatSetup:
    """The sampling parameters and answer reader of a chat request whose rendered prompt is
    ``prompt`` (``template``: the chat template's source, to detect the tool-call format).

    Raises ``ChatRequestError`` naming the field for bad tools, a bad ``tool_choice`` or
    ``parallel_tool_calls``, or a forced call combined with another grammar (``grammar``,
    ``json_schema`` or ``response_format``)."""
    check_reasoning_format(reasoning_format)
    if not isinstance(parallel_tool_calls, bool):
        raise ChatRequestError(
            f"parallel_tool_calls must be True or False, got {parallel_tool_calls!r}", "parallel_tool_calls"
        )
    try:
        specs = normalize_tools(tools) if tools is not None else []
    except ValueError as exc:
        raise ChatRequestError(str(exc), "tools") from exc
    mode, name = check_tool_choice(tool_choice, specs)
    fmt: ToolFormat | None = None
    if mode != "none" and tool_call_parser != "none":
        fmt = get_format(tool_call_parser) if tool_call_parser != "auto" else detect_format(template)
    reasoning = reasoning_format != "none"
    if fmt is not None:
        # the markers may be special tokens: they must reach the text to be parsed
        changes: dict[str, Any] = {"skip_special_tokens": False}
        try:
            if mode in ("required", "function"):
                if params.effective_grammar is not None:
                    raise ChatRequestError(
                        f"tool_choice {tool_choice!r} forces a tool call; it cannot be combined with "
                        "grammar, json_schema or response_format",
                        "tool_choice",
                    )
                chosen = [t for t in specs if t.name == name] if mode == "function" else specs
                changes["grammar"] = fmt.section_grammar(chosen, parallel_tool_calls and mode == "required")
            elif params.effective_grammar is None and fmt.trigger_words():
                changes["grammar"] = fmt.section_grammar(specs, parallel_tool_calls)
                changes["grammar_triggers"] = fmt.trigger_words()
            params = dataclasses.replace(params, **changes)
        except ChatRequestError:
            raise
        except ValueError as exc:  # the tools' schemas as a grammar
            raise ChatRequestError(str(exc), "tools") from exc
    forced = fmt is not None and mode in ("required", "function")  # the call starts at once
    in_reasoning = reasoning and not forced and prompt_opens_reasoning(prompt)
    return ChatSetup(params, fmt, reasoning, in_reasoning, parallel_tool_calls)
