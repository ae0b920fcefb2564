"""Tool calls and reasoning content in chat answers: one small module per model family.

Each family (``hermes``, ``llama3``, ``mistral``, ``deepseek``, ``generic``) is a
:class:`~llamabatch.toolcalls.base.ToolFormat`: its markers, a parser of one call section, and
the grammar of a section built from the tools' parameter schemas. :func:`detect_format` picks
one from the chat template's source; ``--tool-call-parser NAME`` / ``LLM(tool_call_parser=...)``
overrides it. :class:`~llamabatch.toolcalls.stream.ChatOutputParser` splits an answer (whole or
streamed) into reasoning, content and calls. The chat pipeline (:mod:`llamabatch.chat`) joins
them to a request: ``tools`` and ``tool_choice`` as grammars, the answers read.

Adding a family: a module with a ``ToolFormat`` subclass, one line in ``FORMATS`` (and, if
its template has a telling marker, in ``_DETECTION_ORDER``), and its tests.
"""

from __future__ import annotations

from llamabatch.toolcalls.base import ParsedCall, Section, ToolFormat, ToolSpec, normalize_tools
from llamabatch.toolcalls.deepseek import DeepSeekFormat, DeepSeekV31Format
from llamabatch.toolcalls.generic import GenericFormat
from llamabatch.toolcalls.hermes import HermesFormat
from llamabatch.toolcalls.llama3 import Llama3Format
from llamabatch.toolcalls.mistral import MistralFormat

__all__ = [
    "FORMATS",
    "TOOL_CALL_PARSERS",
    "ParsedCall",
    "Section",
    "ToolFormat",
    "ToolSpec",
    "check_tool_call_parser",
    "detect_format",
    "get_format",
    "normalize_tools",
]

#: every format by name
FORMATS: dict[str, type[ToolFormat]] = {
    cls.name: cls
    for cls in (HermesFormat, Llama3Format, MistralFormat, DeepSeekFormat, DeepSeekV31Format, GenericFormat)
}
_ALIASES = {"qwen": "hermes", "qwen3": "hermes", "deepseek": "deepseek_r1", "deepseek_v3": "deepseek_r1"}
#: the values ``tool_call_parser`` takes: "auto" (from the template), a format, or "none"
TOOL_CALL_PARSERS = ("auto", "none", *FORMATS, *_ALIASES)
#: the most specific markers first (Hermes 3 templates for Llama 3.1 also mention python_tag)
_DETECTION_ORDER = ("mistral", "deepseek_v31", "deepseek_r1", "hermes", "llama3")


def check_tool_call_parser(value: object, *, what: str = "tool_call_parser") -> str:
    """``value`` if it names a parser (``TOOL_CALL_PARSERS``), else ``ValueError``."""
    if value not in TOOL_CALL_PARSERS:
        raise ValueError(f"{what} must be one of {', '.join(TOOL_CALL_PARSERS)}; got {value!r}")
    return value  # type: ignore[return-value]


def get_format(name: str) -> ToolFormat:
    """The format called ``name`` (or one of its aliases); ``ValueError`` for an unknown name."""
    check_tool_call_parser(name)
    cls = FORMATS.get(_ALIASES.get(name, name))
    if cls is None:
        raise ValueError(f"{name!r} is not a tool-call format")
    return cls()


def detect_format(template: str | None) -> ToolFormat:
    """The format a chat template's source speaks, found by its markers; ``generic`` if none."""
    if template:
        for name in _DETECTION_ORDER:
            if any(marker in template for marker in FORMATS[name].template_markers):
                return FORMATS[name]()
    return GenericFormat()
