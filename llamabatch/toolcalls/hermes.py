"""Hermes / Qwen 2.5 - 3: each call is a JSON object in ``<tool_call>...</tool_call>``.

I'll check.<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

from collections.abc import Sequence

from llamabatch.toolcalls.base import (
    Section,
    ToolFormat,
    ToolSpec,
    call_from_object,
    json_call_rules,
    load_json,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

    name = "hermes"
    template_markers = (OPEN,)
    start_markers = (OPEN,)

    def parse_section(self, text: str, final: bool) -> Section | None:
        end = text.find(CLOSE, len(OPEN))
        if end < 0:
            if not final:
                return None
            # the answer ended inside the block: a complete object still counts as a call
            call = call_from_object(load_json(text[len(OPEN) :].strip()))
            return Section(len(text), [call] if call is not None else None)
        call = call_from_object(load_json(text[len(OPEN) : end].strip()))
        return Section(end + len(CLOSE), [call] if call is not None else None)

    def section_grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        block = f'"{OPEN}" "\\n"? call "\\n"? "{CLOSE}"'
        root = 'root ::= block ("\\n"? block)*' if parallel else "root ::= block"
        return "\n".join([root, f"block ::= {block}", json_call_rules(tools, "arguments")])
