"""DeepSeek R1 / V3: calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``.

R1 and V3 (``DeepSeekFormat``, ``deepseek_r1``) write the type, the name and fenced JSON::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (``DeepSeekV31Format``, ``deepseek_v31``) writes the name and the bare JSON::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>   (on one line)

Both parsers read both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

from llamabatch.toolcalls.base import (
    ParsedCall,
    Section,
    ToolFormat,
    ToolSpec,
    arguments_json,
    arguments_rules,
    gbnf_literal,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _parse_call(block: str) -> ParsedCall | None:
    head, sep, body = block.partition(SEP)
    if not sep:
        return None
    if head.strip() == "function":  # R1 / V3: the name, then fenced JSON
        name, _, rest = body.partition("\n")
        rest = rest.strip()
        if rest.startswith("```"):
            rest = rest[3:]
            if rest.startswith("json"):
                rest = rest[4:]
            if rest.rstrip().endswith("```"):
                rest = rest.rstrip()[:-3]
    else:  # V3.1: the name, then the JSON
        name, rest = head, body
    name = name.strip()
    arguments = arguments_json(rest.strip())
    if not name or arguments is None:
        return None
    return ParsedCall(name, arguments)


class DeepSeekFormat(ToolFormat):
    """DeepSeek R1 / V3 calls (``function<｜tool▁sep｜>name`` and a fenced JSON block)."""

    name = "deepseek_r1"
    template_markers = (CALLS_BEGIN,)
    start_markers = (CALLS_BEGIN,)

    def parse_section(self, text: str, final: bool) -> Section | None:
        end = text.find(CALLS_END)
        if end < 0 and not final:
            return None
        body = text[len(CALLS_BEGIN) : end if end >= 0 else len(text)]
        consumed = end + len(CALLS_END) if end >= 0 else len(text)
        calls = []
        pos = 0
        while True:
            start = body.find(CALL_BEGIN, pos)
            if start < 0:
                break
            if body[pos:start].strip():
                return Section(consumed, None)
            stop = body.find(CALL_END, start)
            if stop < 0:
                return Section(consumed, None)  # truncated inside a call
            call = _parse_call(body[start + len(CALL_BEGIN) : stop])
            if call is None:
                return Section(consumed, None)
            calls.append(call)
            pos = stop + len(CALL_END)
        if not calls or body[pos:].strip():
            return Section(consumed, None)
        return Section(consumed, calls)

    def _call_rule(self, tools: Sequence[ToolSpec], roots: Sequence[str]) -> str:
        alternatives = [
            gbnf_literal(f"function{SEP}{tool.name}\n```json\n") + f' {root} "\\n```"'
            for tool, root in zip(tools, roots, strict=True)
        ]
        return f"call ::= {gbnf_literal(CALL_BEGIN)} ({' | '.join(alternatives)}) {gbnf_literal(CALL_END)}"

    def section_grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        args, roots = arguments_rules(tools)
        more = ' ("\\n"? call)*' if parallel else ""
        root = f"root ::= {gbnf_literal(CALLS_BEGIN)} call{more} {gbnf_literal(CALLS_END)}"
        return "\n".join([root, self._call_rule(tools, roots), args])


class DeepSeekV31Format(DeepSeekFormat):
    """DeepSeek V3.1 calls (``name<｜tool▁sep｜>`` and the bare JSON arguments)."""

    name = "deepseek_v31"
    template_markers = ("<｜tool▁call▁begin｜>'+ tool['function']['name']",)

    def _call_rule(self, tools: Sequence[ToolSpec], roots: Sequence[str]) -> str:
        alternatives = [
            gbnf_literal(f"{tool.name}{SEP}") + f" {root}" for tool, root in zip(tools, roots, strict=True)
        ]
        return f"call ::= {gbnf_literal(CALL_BEGIN)} ({' | '.join(alternatives)}) {gbnf_literal(CALL_END)}"
