"""Structured output: JSON schemas and OpenAI ``response_format`` turned into GBNF grammars.

The grammar is what enforces the structure: llama.cpp's grammar sampler masks every token
that would leave the language, so even a random-weight model writes valid JSON, and once the
value is complete only an end-of-generation token is allowed.

The converter is llamabatch's own (``prompts/schema_grammar.py``, patterns through
``prompts/schema_regex.py``): its work is linear in the schema and bounded by a budget.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from llamabatch.prompts.grammar_check import GrammarLimits, check_grammar, get_grammar_limits
from llamabatch.prompts.schema_grammar import JSON_OBJECT_GBNF, schema_to_gbnf
from llamabatch.prompts.schema_regex import check_pattern

__all__ = [
    "check_schema",
    "json_object_grammar",
    "json_schema_grammar",
    "resolve_grammar",
    "response_format_grammar",
]

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


# -- schema validation ---------------------------------------------------------------------

_TYPES = frozenset(("string", "number", "integer", "boolean", "object", "array", "null"))
#: counts: non-negative ints, at most ``GrammarLimits.max_repetition`` (they become ``{m,n}``)
_COUNT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_COUNT_PAIRS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
#: keywords whose value is a schema, a mapping of names to schemas, or a list of schemas
_SCHEMA_KEYS = frozenset(
    ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
)
_SCHEMA_MAP_KEYS = frozenset(("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"))
_SCHEMA_LIST_KEYS = frozenset(("anyOf", "oneOf", "allOf", "prefixItems"))


def check_schema(schema: Any, *, what: str = "json_schema", limits: GrammarLimits | None = None) -> None:
    """Validate a JSON schema (parsed) before it is turned into a grammar.

    Walks it without recursion and refuses, with a ``ValueError`` naming ``what``, the path
    and the limit: more than ``max_schema_nodes`` values or nesting deeper than
    ``max_schema_depth``; NaN or infinite numbers (not JSON); length, item and property
    counts that are not non-negative ints, exceed ``max_repetition`` or have min > max; a
    ``pattern`` that is not a valid regular expression anchored with ``^...$`` or has a
    quantifier above ``max_repetition``; numeric bounds that are not numbers; a ``type``
    that is not a JSON type; an empty ``enum``; any ``$ref`` but a local ``#/...`` one that
    resolves inside the schema (a remote one would make the converter fetch a URL)."""
    limits = limits if limits is not None else get_grammar_limits()
    if not isinstance(schema, Mapping):
        raise ValueError(f"{what} must be a JSON schema object (a dict), got {type(schema).__name__}")
    # (value, path, depth, kind): kind is "schema", "map" (names -> schemas), "list" (schemas), "value"
    stack: list[tuple[Any, str, int, str]] = [(schema, "$", 1, "schema")]
    nodes = 0
    while stack:
        node, path, depth, kind = stack.pop()
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise ValueError(
                f"{what}: the schema has more than {limits.max_schema_nodes} values "
                "(GrammarLimits.max_schema_nodes)"
            )
        if depth > limits.max_schema_depth:
            raise ValueError(
                f"{what}: the schema nests deeper than {limits.max_schema_depth} levels at {path} "
                "(GrammarLimits.max_schema_depth)"
            )
        if isinstance(node, Mapping):
            if kind == "schema":
                _check_keywords(node, path, schema, what, limits)
            for key, value in node.items():
                if not isinstance(key, str):
                    raise ValueError(f"{what}: keys must be strings, got {key!r} at {path}")
                child = "value"
                if kind == "schema":
                    if key in _SCHEMA_KEYS:
                        child = "list" if isinstance(value, list) else "schema"
                        if isinstance(value, bool) and key == "additionalProperties":
                            child = "value"
                    elif key in _SCHEMA_MAP_KEYS:
                        child = "map"
                    elif key in _SCHEMA_LIST_KEYS:
                        child = "list"
                elif kind == "map":
                    child = "schema"
                stack.append((value, f"{path}.{key}", depth + 1, child))
        elif isinstance(node, (list, tuple)):
            if kind == "schema":
                raise ValueError(f"{what}: {path} must be a schema object, got a list")
            for i, value in enumerate(node):
                stack.append((value, f"{path}[{i}]", depth + 1, "schema" if kind == "list" else "value"))
        elif kind in ("schema", "map", "list"):
            raise ValueError(
                f"{what}: {path} must be a schema object, got {type(node).__name__} {node!r:.40}"
            )
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise ValueError(
                    f"{what}: {node!r} at {path} is not a JSON number (NaN and Infinity are refused)"
                )
        elif node is not None and not isinstance(node, (str, int, bool)):
            raise ValueError(f"{what}: {path} holds a {type(node).__name__}, which is not JSON")


def _check_keywords(node: Mapping[str, Any], path: str, root: Any, what: str, limits: GrammarLimits) -> None:
    def bad(key: str, message: str) -> ValueError:
        return ValueError(f"{what}: {key} at {path} {message}, got {node[key]!r:.60}")

    kind = node.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in _TYPES for k in kinds):
            raise bad("type", f"must be one of {', '.join(sorted(_TYPES))} (or a non-empty list of them)")
    for key in _COUNT_KEYS:
        if key in node:
            value = node[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, "must be a non-negative integer")
            if value > limits.max_repetition:
                raise ValueError(
                    f"{what}: {key} {value} at {path} exceeds the limit of {limits.max_repetition} "
                    "(GrammarLimits.max_repetition)"
                )
    for low, high in _COUNT_PAIRS:
        if low in node and high in node and node[low] > node[high]:
            raise ValueError(f"{what}: {low} {node[low]} is above {high} {node[high]} at {path}")
    for key in _NUMBER_KEYS:
        if key in node:
            value = node[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(key, "must be a finite number")
    if "pattern" in node:
        check_pattern(node["pattern"], path, what, limits)
    if "format" in node and not isinstance(node["format"], str):
        raise bad("format", "must be a string")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise bad("enum", "must be a non-empty list")
    if "required" in node and (
        not isinstance(node["required"], list) or not all(isinstance(k, str) for k in node["required"])
    ):
        raise bad("required", "must be a list of property names")
    for key in _SCHEMA_LIST_KEYS:
        if key in node and (not isinstance(node[key], list) or (key != "prefixItems" and not node[key])):
            raise bad(key, "must be a non-empty list of schemas")
    for key in _SCHEMA_MAP_KEYS:
        if key in node and not isinstance(node[key], Mapping):
            raise bad(key, "must be an object")
    if "$ref" in node:
        _check_ref(node["$ref"], path, root, what)


def _check_ref(ref: Any, path: str, root: Any, what: str) -> None:
    """Only local references (``#/...``) that resolve: the converter would fetch a remote
    ``https://`` one when assertions are off (``python -O``)."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise ValueError(
            f"{what}: $ref {ref!r:.80} at {path} is refused: only local references ('#/...') are "
            "allowed, remote schemas are never fetched"
        )
    target = root
    for part in ref[2:].split("/"):
        if not isinstance(target, Mapping) or part not in target:
            raise ValueError(f"{what}: $ref {ref!r:.80} at {path} does not resolve inside the schema")
        target = target[part]


def json_object_grammar() -> str:
    """A GBNF grammar of any JSON object (OpenAI's ``{"type": "json_object"}``)."""
    return JSON_OBJECT_GBNF


def json_schema_grammar(schema: Mapping[str, Any] | str, *, what: str = "json_schema") -> str:
    """The GBNF grammar of the JSON values ``schema`` (a dict or a JSON string) accepts.

    Raises ``ValueError`` (naming ``what``) for a schema that is not a JSON object or that the
    converter cannot handle (e.g. a remote ``$ref``)."""
    limits = get_grammar_limits()
    if isinstance(schema, str):
        size = len(schema.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise ValueError(
                f"{what}: the schema is {size} bytes, above the limit of {limits.max_bytes} "
                "(GrammarLimits.max_bytes)"
            )
        try:
            parsed = json.loads(schema, parse_constant=_refuse_constant)
        except ValueError as exc:  # JSONDecodeError, or NaN / Infinity
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError(f"{what}: the schema nests too deeply") from None
    else:
        parsed = schema
    if not isinstance(parsed, Mapping):
        raise ValueError(f"{what} must be a JSON schema object (a dict), got {type(parsed).__name__}")
    check_schema(parsed, what=what, limits=limits)
    try:
        text = json.dumps(parsed, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None
    if len(text) > limits.max_bytes:
        raise ValueError(
            f"{what}: the schema is {len(text)} bytes as JSON, above the limit of {limits.max_bytes} "
            "(GrammarLimits.max_bytes)"
        )
    grammar = _convert(text, what, limits)
    check_grammar(grammar, what=f"{what} (the grammar made from it)", limits=limits)
    return grammar


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@lru_cache(maxsize=128)
def _convert(schema_json: str, what: str, limits: GrammarLimits) -> str:
    try:
        return schema_to_gbnf(json.loads(schema_json), what=what, limits=limits)
    except (TypeError, AttributeError, KeyError, IndexError, RecursionError) as exc:
        # a keyword of the wrong type where check_schema does not look (inside a $ref target)
        raise ValueError(f"{what}: cannot convert the JSON schema to a grammar: {exc!r:.200}") from None


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
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    owner: str = "SamplingParams.",
) -> str | None:
    """The one grammar that ``grammar``, ``json_schema``, ``response_format``, ``regex`` and
    ``choice`` ask for.

    At most one of them may constrain the output (``response_format={"type": "text"}``
    constrains nothing); two raise ``ValueError``."""
    from llamabatch.prompts.text_grammar import choice_grammar, regex_grammar

    made = {
        "grammar": grammar,
        "json_schema": None
        if json_schema is None
        else json_schema_grammar(json_schema, what=f"{owner}json_schema"),
        "response_format": None
        if response_format is None
        else response_format_grammar(response_format, what=f"{owner}response_format"),
        "regex": None if regex is None else regex_grammar(regex, what=f"{owner}regex"),
        "choice": None if choice is None else choice_grammar(choice, what=f"{owner}choice"),
    }
    given = [name for name, value in made.items() if value is not None]
    if len(given) > 1:
        raise ValueError(
            f"{owner}{given[1]} conflicts with {owner}{given[0]}: give only one way to constrain the output"
        )
    return made[given[0]] if given else None
