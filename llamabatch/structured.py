"""Structured output: JSON schemas and OpenAI ``response_format`` turned into GBNF grammars.

The grammar is what enforces the structure: llama.cpp's grammar sampler masks every token
that would leave the language, so even a random-weight model writes valid JSON, and once the
value is complete only an end-of-generation token is allowed.

The JSON-schema converter is the one shipped with the pinned dependency
(``llama_cpp.llama_grammar.json_schema_to_gbnf``, a port of llama.cpp's own converter). Its
module is loaded from its file rather than imported as ``llama_cpp.llama_grammar``: importing
the ``llama_cpp`` package would load its ctypes binding, which installs its own llama.cpp log
callback over llamabatch's.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "json_object_grammar",
    "json_schema_grammar",
    "resolve_grammar",
    "response_format_grammar",
]

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@lru_cache(maxsize=1)
def _grammar_module() -> ModuleType:
    spec = importlib.util.find_spec("llama_cpp")  # locates the package without running it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "llama_grammar.py"
        if path.is_file():
            module_spec = importlib.util.spec_from_file_location("llamabatch._llama_cpp_grammar", path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
    raise ImportError(
        "structured output needs llama_cpp/llama_grammar.py from the llama-cpp-python package, "
        "which was not found"
    )


def json_object_grammar() -> str:
    """A GBNF grammar of any JSON object (OpenAI's ``{"type": "json_object"}``)."""
    return _grammar_module().JSON_GBNF


def json_schema_grammar(schema: Mapping[str, Any] | str, *, what: str = "json_schema") -> str:
    """The GBNF grammar of the JSON values ``schema`` (a dict or a JSON string) accepts.

    Raises ``ValueError`` (naming ``what``) for a schema that is not a JSON object or that the
    converter cannot handle (e.g. a remote ``$ref``)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
    else:
        parsed = schema
    if not isinstance(parsed, Mapping):
        raise ValueError(f"{what} must be a JSON schema object (a dict), got {type(parsed).__name__}")
    try:
        text = json.dumps(parsed)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None
    return _convert(text, what)


# The converter's string character rule lets raw control characters (U+0000..U+001F) into
# strings, which JSON forbids (llama.cpp's own converter has since excluded them, as the
# generic JSON grammar shipped beside it does): narrow that one rule.
_LOOSE_CHAR_RULE = re.compile(r'^char ::= \[\^"\\\\\] \|', re.MULTILINE)
_STRICT_CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] |'


@lru_cache(maxsize=128)
def _convert(schema_json: str, what: str) -> str:
    try:
        grammar = _grammar_module().json_schema_to_gbnf(schema_json)
    except ImportError:
        raise
    except Exception as exc:  # the converter raises assorted errors on what it cannot express
        raise ValueError(f"{what}: cannot convert the JSON schema to a grammar: {exc}") from None
    return _LOOSE_CHAR_RULE.sub(lambda _: _STRICT_CHAR_RULE, grammar)


def response_format_grammar(
    response_format: Mapping[str, Any], *, what: str = "response_format"
) -> str | None:
    """The grammar for an OpenAI ``response_format``; None for ``{"type": "text"}``.

    Accepts ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object; a ``schema``
    key, as llama.cpp's server allows, constrains it) and ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (without ``schema``: any
    JSON object). ``strict`` changes nothing: the grammar always enforces the schema."""
    if not isinstance(response_format, Mapping):
        raise ValueError(f"{what} must be an object with a 'type', got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"{what}.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is None:
            return json_object_grammar()
        return json_schema_grammar(schema, what=f"{what}.schema")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError(f"{what}.json_schema must be an object with a 'schema' (type json_schema)")
    schema = spec.get("schema")
    if schema is None:
        return json_object_grammar()
    return json_schema_grammar(schema, what=f"{what}.json_schema.schema")


def resolve_grammar(
    grammar: str | None,
    json_schema: Mapping[str, Any] | str | None,
    response_format: Mapping[str, Any] | None,
    *,
    owner: str = "SamplingParams.",
) -> str | None:
    """The one grammar that ``grammar``, ``json_schema`` and ``response_format`` ask for.

    At most one of them may constrain the output (``response_format={"type": "text"}``
    constrains nothing); two raise ``ValueError``."""
    from_format = (
        response_format_grammar(response_format, what=f"{owner}response_format")
        if response_format is not None
        else None
    )
    from_schema = (
        json_schema_grammar(json_schema, what=f"{owner}json_schema") if json_schema is not None else None
    )
    given = [
        name
        for name, value in (
            ("grammar", grammar),
            ("json_schema", from_schema),
            ("response_format", from_format),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"{owner}{given[1]} conflicts with {owner}{given[0]}: give only one way to constrain the output"
        )
    return grammar if grammar is not None else from_schema if from_schema is not None else from_format
