"""Llama 3.1 - 3.3: a call is a bare JSON object ``{"name": ..., "parameters": {...}}`` at the
start of the answer, or follows ``<|python_tag|>``; several are separated by ``;``.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

from collections.abc import Sequence

from llamabatch.toolcalls.base import (
    ParsedCall,
    Section,
    ToolFormat,
    ToolSpec,
    call_from_object,
    json_call_rules,
    json_value_end,
    load_json,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3Format(ToolFormat):
    """Llama 3.x JSON function objects (``"parameters"``, or ``"arguments"``)."""

    name = "llama3"
    template_markers = (PYTHON_TAG, '"parameters": dictionary of argument name')
    start_markers = (PYTHON_TAG,)
    leading_markers = ('{"name"', '{"type"')
    lazy_leading_markers = ('{"name"',)  # the grammar writes {"name": ...}

    def parse_section(self, text: str, final: bool) -> Section | None:
        pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        calls: list[ParsedCall] = []
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos >= len(text):
                if final and calls:
                    return Section(pos, calls)
                return None if not final else Section(len(text), None)
            if text[pos] != "{":
                return Section(len(text), None) if not calls else Section(pos, calls)
            end = json_value_end(text, pos)
            if end is None:
                return None if not final else Section(len(text), None)
            call = call_from_object(load_json(text[pos:end]), ("parameters", "arguments"))
            if call is None:
                return Section(end, None)
            calls.append(call)
            pos = end
            rest = text[pos:].lstrip()
            if rest.startswith(";"):
                pos = len(text) - len(rest) + 1
            elif rest or final:
                return Section(pos, calls)
            else:
                return None  # ";" and another call may follow

    def section_grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        root = 'root ::= "<|python_tag|>"? call' + (' (";" ws call)*' if parallel else "")
        return "\n".join([root, json_call_rules(tools, "parameters")])
