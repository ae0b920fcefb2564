"""The generic fallback, for templates with no known tool-call markers: the answer is one JSON
object ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` (``{"tool_call": {...}}``
and a bare ``{"name": ..., "arguments": {...}}`` are read too)."""

from __future__ import annotations

from collections.abc import Sequence

from llamabatch.toolcalls.base import (
    Section,
    ToolFormat,
    ToolSpec,
    call_from_object,
    json_call_rules,
    json_value_end,
    load_json,
)


class GenericFormat(ToolFormat):
    """One JSON object holding the calls, as the whole answer."""

    name = "generic"
    leading_markers = ('{"tool_calls"', '{"tool_call"', '{"name"')
    lazy_leading_markers = ('{"tool_calls"',)  # the grammar writes {"tool_calls": [...]}

    def parse_section(self, text: str, final: bool) -> Section | None:
        end = json_value_end(text, 0)
        if end is None:
            return None if not final else Section(len(text), None)
        obj = load_json(text[:end])
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            items = obj["tool_calls"]
        elif isinstance(obj, dict) and "tool_call" in obj:
            items = [obj["tool_call"]]
        else:
            items = [obj]
        calls = [call_from_object(item) for item in items]
        if not calls or any(call is None for call in calls):
            return Section(end, None)
        return Section(end, calls)  # type: ignore[arg-type]

    def section_grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        more = ' ("," ws call)*' if parallel else ""
        root = f'root ::= "{{\\"tool_calls\\"" ws ":" ws "[" ws call{more} ws "]" ws "}}"'
        return "\n".join([root, json_call_rules(tools)])
