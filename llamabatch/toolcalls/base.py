"""What every tool-call format shares: the ``ToolFormat`` protocol, tool definitions, parsed
calls, JSON scanning and the GBNF helpers the formats build their grammars with.

A format is one small module (``hermes.py``, ``llama3.py``, ...) defining a ``ToolFormat``
subclass: the markers that identify it in a chat template, the markers that open a call in an
answer, a parser of one call section, and the grammar of a section (from the tools' parameter
schemas, through :func:`llamabatch.prompts.structured.json_schema_grammar`).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from llamabatch.prompts.structured import json_schema_grammar

__all__ = [
    "ParsedCall",
    "Section",
    "ToolFormat",
    "ToolSpec",
    "gbnf_literal",
    "json_value_end",
    "normalize_tools",
    "prefixed_rules",
]

#: OpenAI's rule for function names (dots allowed too, as some tool sets use them).
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: at most this many tools in one request (each adds grammar rules)
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: its name, description and JSON schema of its parameters."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]


def normalize_tools(tools: object, *, what: str = "tools") -> list[ToolSpec]:
    """Check OpenAI-shaped ``tools`` (``[{"type": "function", "function": {"name": ...,
    "parameters": {...}}}]``) and return them as ``ToolSpec``s; ``ValueError`` names the bad item."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"{what} must be a list of tool objects, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{what}: at most {MAX_TOOLS} tools, got {len(tools)}")
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"{what}[{i}] must be an object, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{what}[{i}].type must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{what}[{i}].function must be an object with a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(
                f"{what}[{i}].function.name must be 1 to 64 letters, digits, '_', '-' or '.', got {name!r}"
            )
        if name in seen:
            raise ValueError(f"{what}[{i}].function.name {name!r} is given twice")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{what}[{i}].function.parameters must be a JSON schema object")
        description = function.get("description")
        specs.append(ToolSpec(name, description if isinstance(description, str) else None, parameters))
    return specs


@dataclass(frozen=True)
class ParsedCall:
    """A tool call read from an answer: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class Section(NamedTuple):
    """What a format made of the text at the start of a call section: ``consumed`` characters
    hold ``calls``; ``calls`` None means that text is not a valid call and stays content."""

    consumed: int
    calls: list[ParsedCall] | None


class ToolFormat:
    """A model family's tool-call format. Subclasses set the markers and implement
    :meth:`parse_section` and :meth:`section_grammar`."""

    #: the name used by ``--tool-call-parser`` / ``LLM(tool_call_parser=...)``
    name: ClassVar[str] = ""
    #: a chat template containing any of these uses this format
    template_markers: ClassVar[tuple[str, ...]] = ()
    #: text opening a call section anywhere in an answer
    start_markers: ClassVar[tuple[str, ...]] = ()
    #: text opening a call section only at the start of an answer (after whitespace)
    leading_markers: ClassVar[tuple[str, ...]] = ()
    #: the leading markers the lazy grammar may wake on: each must begin the section grammar
    #: exactly (llama.cpp feeds the grammar from the marker, and text it rejects aborts)
    lazy_leading_markers: ClassVar[tuple[str, ...] | None] = None
    #: a section can only complete on text holding one of these (the parser skips re-reading
    #: a waiting section until one arrives)
    section_end_chars: ClassVar[str] = "}]>｜;"
    #: ids: this prefix and this many random letters and digits
    id_length: ClassVar[int] = 24
    id_prefix: ClassVar[str] = "call_"

    def parse_section(self, text: str, final: bool) -> Section | None:
        """Read the call section at the start of ``text`` (which begins with one of the
        markers). Returns None when more text is needed (never when ``final``: the answer
        ended), else a ``Section``: the calls and how much text they took, or ``calls=None``
        for text that is not a valid call (it stays content)."""
        raise NotImplementedError

    def section_grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        """A GBNF grammar (root ``root``) of one call section naming one of ``tools`` (several
        calls when ``parallel``), starting with the format's marker."""
        raise NotImplementedError

    def trigger_words(self) -> tuple[str, ...]:
        """The lazy grammar's triggers: the start markers, and the leading ones anchored at the
        start of the answer (``^``, see ``SamplingParams.grammar_triggers``). Each must begin
        :meth:`section_grammar`'s language."""
        leading = self.leading_markers if self.lazy_leading_markers is None else self.lazy_leading_markers
        return (*self.start_markers, *("^" + m for m in leading))

    def new_id(self) -> str:
        """A fresh tool-call id in this family's style."""
        alphabet = string.ascii_letters + string.digits
        return self.id_prefix + "".join(secrets.choice(alphabet) for _ in range(self.id_length))


# -- JSON ----------------------------------------------------------------------------------------


def json_value_end(text: str, start: int) -> int | None:
    """The end index of the JSON object or array starting at ``text[start]`` (balanced brackets
    outside strings), or None if the text ends first. Validity is not checked."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
    return None


def load_json(text: str) -> Any:
    """``json.loads``, or a sentinel ``_INVALID`` for text that is not one JSON value."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return _INVALID


_INVALID = object()


def arguments_json(arguments: Any) -> str | None:
    """Arguments as OpenAI's JSON string: an object is dumped, a string holding a JSON object is
    normalised; anything else is None (not valid arguments)."""
    if isinstance(arguments, str):
        arguments = load_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def call_from_object(
    obj: Any, arguments_keys: Sequence[str] = ("arguments", "parameters")
) -> ParsedCall | None:
    """A call from ``{"name": ..., "arguments": {...}}`` (or another arguments key); None if not one."""
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "function" and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in arguments_keys:
        if key in obj:
            arguments = arguments_json(obj[key])
            return None if arguments is None else ParsedCall(name, arguments)
    return ParsedCall(name, "{}")


# -- GBNF ----------------------------------------------------------------------------------------


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_IDENT = re.compile(r"[A-Za-z0-9-]+")


def _rename_body(body: str, names: set[str], prefix: str) -> str:
    out: list[str] = []
    i, n = 0, len(body)
    while i < n:
        ch = body[i]
        if ch in '"[':  # a string literal or a character class: copied as is
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and body[j] != close:
                j += 2 if body[j] == "\\" else 1
            out.append(body[i : j + 1])
            i = j + 1
        elif ch == "{":  # a repetition count {m,n}
            j = body.index("}", i)
            out.append(body[i : j + 1])
            i = j + 1
        else:
            match = _IDENT.match(body, i)
            if match:
                word = match.group()
                out.append(prefix + word if word in names else word)
                i = match.end()
            else:
                out.append(ch)
                i += 1
    return "".join(out)


def prefixed_rules(grammar: str, prefix: str) -> str:
    """The rules of ``grammar`` (one ``name ::= body`` per line, as the JSON-schema converter
    writes them) with every rule name prefixed, so several grammars can be combined."""
    rules = []
    for line in grammar.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, body = line.partition("::=")
        if not sep:
            raise ValueError(f"unexpected grammar line: {line!r}")
        rules.append((name.strip(), body.strip()))
    names = {name for name, _ in rules}
    return "\n".join(f"{prefix}{name} ::= {_rename_body(body, names, prefix)}" for name, body in rules)


def arguments_rules(tools: Sequence[ToolSpec]) -> tuple[str, list[str]]:
    """The rules of every tool's arguments (rule ``t<i>-root`` for tool i), and those root names."""
    pieces, roots = [], []
    for i, tool in enumerate(tools):
        grammar = json_schema_grammar(tool.parameters, what=f"tools[{i}].function.parameters")
        pieces.append(prefixed_rules(grammar, f"t{i}-"))
        roots.append(f"t{i}-root")
    return "\n".join(pieces), roots


#: optional whitespace inside a call (bounded, so a weak model cannot pad forever)
WS_RULE = "ws ::= [ \\t\\n]{0,4}"


def json_call_rules(tools: Sequence[ToolSpec], arguments_key: str = "arguments") -> str:
    """Rules with ``call`` = one JSON object ``{"name": "<tool>", "<arguments_key>": {...}}``
    naming one of ``tools``, its arguments constrained by that tool's schema."""
    args, roots = arguments_rules(tools)
    alternatives = []
    for tool, root in zip(tools, roots, strict=True):
        alternatives.append(
            '"{\\"name\\"" ws ":" ws '
            + gbnf_literal(json.dumps(tool.name))
            + ' ws "," ws '
            + gbnf_literal(json.dumps(arguments_key))
            + f' ws ":" ws {root} ws "}}"'
        )
    return "\n".join([f"call ::= {' | '.join(alternatives)}", WS_RULE, args])
