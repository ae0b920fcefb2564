"""Mistral: ``[TOOL_CALLS]`` then a JSON array of calls (Mistral 7B v0.3, Nemo, Small 3), or,
in the newer tekken templates, ``[TOOL_CALLS]name[ARGS]{...}`` per call.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from llamabatch.toolcalls.base import (
    ParsedCall,
    Section,
    ToolFormat,
    ToolSpec,
    arguments_json,
    call_from_object,
    json_call_rules,
    json_value_end,
    load_json,
)

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})")


class MistralFormat(ToolFormat):
    """``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects."""

    name = "mistral"
    template_markers = (MARKER,)
    start_markers = (MARKER,)
    # Mistral's templates require ids of 9 letters and digits
    id_prefix = ""
    id_length = 9

    def parse_section(self, text: str, final: bool) -> Section | None:
        pos = len(MARKER)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return None if not final else Section(len(text), None)
        if text[pos] == "[":
            end = json_value_end(text, pos)
            if end is None:
                return None if not final else Section(len(text), None)
            items = load_json(text[pos:end])
            if not isinstance(items, list) or not items:
                return Section(end, None)
            calls = [call_from_object(item) for item in items]
            if any(call is None for call in calls):
                return Section(end, None)
            return Section(end, calls)  # type: ignore[arg-type]
        return self._parse_args_form(text, pos, final)

    def _parse_args_form(self, text: str, pos: int, final: bool) -> Section | None:
        """``name[ARGS]{...}`` (optionally ``name[CALL_ID]id[ARGS]{...}``)."""
        match = _NAME.match(text, pos)
        if match is None:
            return Section(len(text), None)
        name, pos = match.group(1), match.end()
        if text.startswith(CALL_ID, pos):
            close = text.find(ARGS, pos)
            if close < 0:
                return None if not final else Section(len(text), None)
            pos = close
        if not text.startswith(ARGS, pos):
            waiting = ARGS.startswith(text[pos:]) or CALL_ID.startswith(text[pos:])
            return None if waiting and not final else Section(len(text), None)
        pos += len(ARGS)
        if pos >= len(text) or text[pos] != "{":
            return None if pos >= len(text) and not final else Section(len(text), None)
        end = json_value_end(text, pos)
        if end is None:
            return None if not final else Section(len(text), None)
        arguments = arguments_json(text[pos:end])
        return Section(end, [ParsedCall(name, arguments)] if arguments is not None else None)

    def section_grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        more = ' ("," ws call)*' if parallel else ""
        root = f'root ::= "{MARKER}" ws "[" ws call{more} ws "]"'
        return "\n".join([root, json_call_rules(tools)])
