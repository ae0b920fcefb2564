"""JSON schemas as GBNF grammars: llamabatch's own converter, bounded by construction.

The schema (already walked by ``structured.check_schema``) is visited once: each schema node
becomes at most a few rules of constant size (a pattern: text linear in its length, from
``schema_regex``), references become named rules resolved from a work list, not by recursion.
An object's properties are written in their declared order, optional ones through a balanced
tree of rules (each range of properties has a rule for "the first one present here" and one
for "the ones present here, each after a comma"): rules and text grow linearly with the
number of properties, and the chain of leftmost references llama.cpp checks for left
recursion grows with its logarithm.

A work budget (steps, rules, grammar bytes) stops anything else: exceeding it is a
``ValueError`` naming the request field.

Supported: ``type`` (one or a list), ``properties`` / ``required`` / ``additionalProperties``,
``items`` / ``prefixItems`` / ``minItems`` / ``maxItems``, ``enum`` / ``const``, ``anyOf`` /
``oneOf`` (as alternatives), ``allOf`` (merged), local ``$ref`` (``#/...``), string
``minLength`` / ``maxLength`` / ``pattern`` / ``format`` (``date``, ``time``, ``date-time``,
``uuid``), numbers without a sign where ``minimum`` (or ``exclusiveMinimum``) is at least 0.
Other keywords (other numeric bounds, ``minProperties``, ``uniqueItems``, ``not`` ...) do not
constrain the grammar.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from llamabatch.prompts.grammar_check import GrammarLimits
from llamabatch.prompts.schema_regex import PatternError, gbnf_literal, pattern_to_gbnf

__all__ = ["CONVERSION_TIME_LIMIT_S", "JSON_OBJECT_GBNF", "conversion_budget", "schema_to_gbnf"]

_HEX4 = "[0-9a-fA-F]{4}"
_HOUR = '([01] [0-9] | "2" [0-3])'
#: the building blocks, each ``name: (body, dependencies)``
_PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "space": ('" "?', ()),
    # JSON forbids raw control characters (U+0000..U+001F) in strings
    "char": (f'[^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" {_HEX4})', ()),
    "string": ('"\\"" char* "\\"" space', ("char", "space")),
    "integer": ('"-"? ("0" | [1-9] [0-9]{0,15}) space', ("space",)),
    "number": (
        '"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})? space',
        ("space",),
    ),
    "boolean": ('("true" | "false") space', ("space",)),
    "null": ('"null" space', ("space",)),
    "value": (
        "object | array | string | number | boolean | null",
        ("object", "array", "string", "number", "boolean", "null"),
    ),
    "object": (
        '"{" space (string ":" space value ("," space string ":" space value)*)? "}" space',
        ("string", "value", "space"),
    ),
    "array": ('"[" space (value ("," space value)*)? "]" space', ("value", "space")),
    "uuid": (
        '"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
        '[0-9a-fA-F]{12} "\\"" space',
        ("space",),
    ),
    "date": ('[0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])', ()),
    "time": (
        f'{_HOUR} ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{{3}})? ("Z" | [+-] {_HOUR} ":" [0-5] [0-9])',
        (),
    ),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": ('"\\"" date "\\"" space', ("date", "space")),
    "time-string": ('"\\"" time "\\"" space', ("time", "space")),
    "date-time-string": ('"\\"" date-time "\\"" space', ("date-time", "space")),
}
_FORMATS = {"date": "date-string", "time": "time-string", "date-time": "date-time-string"}
_UUID_FORMAT = re.compile(r"uuid[1-5]?")
#: keywords that describe a schema without constraining its values (ignored when merging allOf)
_ANNOTATIONS = frozenset(
    (
        "title",
        "description",
        "examples",
        "default",
        "$comment",
        "$id",
        "$schema",
        "$defs",
        "definitions",
        "deprecated",
        "readOnly",
        "writeOnly",
    )
)
_OBJECT_KEYS = ("properties", "additionalProperties", "required")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems")
_STRING_KEYS = ("pattern", "format", "minLength", "maxLength")
_LOWER_BOUNDS = frozenset(("minLength", "minItems", "minimum", "exclusiveMinimum", "minProperties"))
_UPPER_BOUNDS = frozenset(("maxLength", "maxItems", "maximum", "exclusiveMaximum", "maxProperties"))
_NAME_CHARS = re.compile(r"[^a-zA-Z0-9]+")
_MAX_REF_HOPS = 64
#: Wall-clock bound on one conversion, a backstop behind the step budget (which alone keeps
#: every conversion far below it: ~35 us per property on a 2-core CI machine).
CONVERSION_TIME_LIMIT_S = 2.0
_CLOCK_EVERY = 4096  # steps between two looks at the clock


def _primitive_rules(name: str, into: dict[str, str]) -> None:
    todo = [name]
    while todo:
        current = todo.pop()
        if current not in into:
            body, deps = _PRIMITIVES[current]
            into[current] = body
            todo.extend(deps)


def _json_object_grammar() -> str:
    rules = {"root": "object"}
    _primitive_rules("object", rules)
    return "\n".join(f"{name} ::= {body}" for name, body in rules.items())


#: Any JSON object (OpenAI's ``{"type": "json_object"}``).
JSON_OBJECT_GBNF = _json_object_grammar()


def conversion_budget(limits: GrammarLimits) -> int:
    """The steps one conversion may take: enough to write a grammar of ``max_bytes`` from a
    schema of ``max_schema_nodes`` values a few times over, and no more."""
    return 4 * limits.max_bytes + 8 * limits.max_schema_nodes


def _json_text(value: Any) -> str:
    """``value`` as JSON, non-ASCII characters as themselves (escaped where they cannot be:
    lone surrogates, which no token produces)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, allow_nan=False)
    return text


def _non_negative(schema: Mapping[str, Any]) -> bool:
    """Whether the numeric bounds exclude every negative number (so no sign is written)."""
    bound = schema.get("minimum", schema.get("exclusiveMinimum"))
    return isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound >= 0


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _both_numbers(a: Any, b: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))


def _short(path: str) -> str:
    """A path for a message: its last 120 characters."""
    return path if len(path) <= 120 else "..." + path[-117:]


def _repeat(item: str, lo: int, hi: int | None) -> str:
    """``item`` repeated ``lo``..``hi`` times (``hi`` None: unbounded) in GBNF."""
    if hi == 0:
        return ""
    if hi is None:
        suffix = "*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}"
    elif lo == hi:
        suffix = "" if lo == 1 else f"{{{lo}}}"
    elif lo == 0 and hi == 1:
        suffix = "?"
    else:
        suffix = f"{{{lo},{hi}}}"
    return item + suffix


def _separated(item: str, lo: int, hi: int | None) -> str:
    """``lo``..``hi`` comma-separated ``item``s: ``{m,n}`` keeps it flat (llama.cpp expands it)."""
    if hi == 0:
        return ""
    tail = _repeat(f'("," space {item})', max(lo - 1, 0), None if hi is None else hi - 1)
    sequence = f"{item} {tail}" if tail else item
    return f"({sequence})?" if lo == 0 else sequence


class _Converter:
    """One conversion: the rules so far, the references still to write, and the budget."""

    def __init__(self, root: Mapping[str, Any], what: str, limits: GrammarLimits) -> None:
        self.root = root
        self.what = what
        self.limits = limits
        self.steps_left = conversion_budget(limits)
        self.deadline = time.monotonic() + CONVERSION_TIME_LIMIT_S
        self.until_clock = _CLOCK_EVERY
        self.rules: dict[str, str] = {}
        self.names_by_body: dict[str, str] = {}
        self.size = 0
        self.counter = 0
        self.depth = 0
        self.refs: dict[str, str] = {}
        self.pending: list[tuple[str, Any, str]] = []

    # -- bookkeeping --------------------------------------------------------------------------

    def step(self, n: int = 1) -> None:
        self.steps_left -= n
        if self.steps_left < 0:
            raise ValueError(
                f"{self.what}: the schema exceeds the conversion budget of "
                f"{conversion_budget(self.limits)} steps (it would make too large a grammar)"
            )
        self.until_clock -= n
        if self.until_clock <= 0:
            self.until_clock = _CLOCK_EVERY
            if time.monotonic() > self.deadline:
                raise ValueError(
                    f"{self.what}: converting the schema exceeds the conversion budget of "
                    f"{CONVERSION_TIME_LIMIT_S} s"
                )

    def differ(self, a: Any, b: Any) -> bool:
        """``a != b``, its cost (the size of the values) counted."""
        self.step(len(a) + len(b) if isinstance(a, (list, dict)) and isinstance(b, (list, dict)) else 1)
        return bool(a != b)

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.what}: {message}")

    def new_name(self, hint: str) -> str:
        self.counter += 1
        base = _NAME_CHARS.sub("-", hint).strip("-")[:24].rstrip("-") or "r"
        if not base[0].isalpha():
            base = "r" + base
        return f"{base}-{self.counter}"

    def define(self, name: str, body: str) -> None:
        self.rules[name] = body
        self.size += len(name) + len(body) + 6
        self.step(8 + len(body) // 4)
        if self.size > self.limits.max_bytes:
            raise ValueError(
                f"{self.what}: the grammar made from the schema exceeds {self.limits.max_bytes} bytes "
                "(GrammarLimits.max_bytes)"
            )
        if len(self.rules) > self.limits.max_rules:
            raise ValueError(
                f"{self.what}: the grammar made from the schema exceeds {self.limits.max_rules} rules "
                "(GrammarLimits.max_rules)"
            )

    def rule(self, hint: str, body: str) -> str:
        """A rule with ``body`` (an existing one if the same body was written before)."""
        name = self.names_by_body.get(body)
        if name is None:
            name = self.new_name(hint)
            self.define(name, body)
            self.names_by_body[body] = name
        return name

    def primitive(self, name: str) -> str:
        before = len(self.rules)
        _primitive_rules(name, self.rules)
        for added in list(self.rules)[before:]:
            self.size += len(added) + len(self.rules[added]) + 6
        return name

    # -- the schema ---------------------------------------------------------------------------

    def convert(self) -> str:
        self.rules["root"] = ""
        self.primitive("space")
        root = self.visit(self.root, "$", "root")
        while self.pending:
            name, target, ref = self.pending.pop()
            self.define(name, self.visit(target, ref, name))
        self.rules["root"] = root
        return "\n".join(f"{name} ::= {body}" for name, body in self.rules.items())

    def visit(self, schema: Any, path: str, hint: str) -> str:
        """A GBNF expression for the JSON values ``schema`` allows."""
        self.step(16)
        self.depth += 1
        try:
            if self.depth > 2 * self.limits.max_schema_depth:
                raise self.fail(
                    f"the schema nests deeper than {2 * self.limits.max_schema_depth} levels once its "
                    f"allOf and $ref are expanded, at {_short(path)} (GrammarLimits.max_schema_depth)"
                )
            return self.visit_node(schema, path, hint)
        finally:
            self.depth -= 1

    def visit_node(self, schema: Any, path: str, hint: str) -> str:
        if schema is True or (isinstance(schema, Mapping) and not schema):
            return self.primitive("value")
        if not isinstance(schema, Mapping):
            raise self.fail(f"the schema at {_short(path)} allows no value (false): nothing can be generated")
        if "$ref" in schema:
            return self.reference(schema["$ref"], path)
        if "allOf" in schema:
            return self.visit(self.merge_all_of(schema, path), path, hint)
        alternatives = schema.get("anyOf", schema.get("oneOf"))
        if alternatives is not None:
            key = "anyOf" if "anyOf" in schema else "oneOf"
            return self.union(
                [self.visit(alt, f"{path}.{key}[{i}]", hint) for i, alt in enumerate(alternatives)], hint
            )
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return self.union([self.literal(value) for value in schema["enum"]], hint)
        kind = schema.get("type")
        if isinstance(kind, list):
            if len(kind) == 1:
                kind = kind[0]
            else:
                self.step(len(schema) * len(kind))
                return self.union([self.visit({**schema, "type": k}, path, hint) for k in kind], hint)
        if kind is None:
            kind = self.infer_type(schema)
        if kind == "object":
            return self.object(schema, path, hint)
        if kind == "array":
            return self.array(schema, path, hint)
        if kind == "string":
            return self.string(schema, path, hint)
        if kind in ("integer", "number") and _non_negative(schema):
            self.primitive("space")
            return self.rule(f"{kind}-non-negative", _PRIMITIVES[kind][0].removeprefix('"-"? '))
        if kind in ("integer", "number", "boolean", "null"):
            return self.primitive(kind)
        return self.primitive("value")

    @staticmethod
    def infer_type(schema: Mapping[str, Any]) -> str | None:
        for kind, keys in (("object", _OBJECT_KEYS), ("array", _ARRAY_KEYS), ("string", _STRING_KEYS)):
            if any(key in schema for key in keys):
                return kind
        return None

    def literal(self, value: Any) -> str:
        text = _json_text(value)
        self.step(8 + len(text))
        return f"{gbnf_literal(text)} space"

    def union(self, alternatives: list[str], hint: str) -> str:
        if len(alternatives) == 1:
            return alternatives[0]
        return self.rule(hint, " | ".join(alternatives))

    def reference(self, ref: Any, path: str) -> str:
        if ref in self.refs:
            return self.refs[ref]
        target = self.resolve(ref, path)
        name = self.new_name(ref.rsplit("/", 1)[-1])
        self.refs[ref] = name
        self.pending.append((name, target, ref))
        return name

    def resolve(self, ref: Any, path: str) -> Any:
        """The schema a local ``#/...`` reference points at (remote ones are refused)."""
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise self.fail(
                f"$ref {ref!r:.80} at {_short(path)} is refused: only local references ('#/...') are allowed"
            )
        target: Any = self.root
        for part in ref[2:].split("/"):
            self.step()
            if not isinstance(target, Mapping) or part not in target:
                raise self.fail(f"$ref {ref!r:.80} at {_short(path)} does not resolve inside the schema")
            target = target[part]
        return target

    # -- allOf --------------------------------------------------------------------------------

    def merge_all_of(self, schema: Mapping[str, Any], path: str) -> dict[str, Any]:
        """One schema with the constraints of ``schema`` and of each of its ``allOf`` parts.

        ``properties`` are merged (a name in several parts gets their ``allOf``), ``required``
        joined; an ``anyOf`` / ``oneOf`` in one part is distributed over the others; other
        keywords must agree."""
        parts: list[Any] = [schema]
        index = 0
        merged: dict[str, Any] = {}
        properties: dict[str, Any] = {}
        required: dict[str, None] = {}
        alternatives: list[Any] | None = None
        seen: set[int] = set()
        closed: list[set[str]] = []  # the names each part with additionalProperties false allows
        while index < len(parts):
            part = parts[index]
            index += 1
            for _ in range(_MAX_REF_HOPS):
                if not (isinstance(part, Mapping) and "$ref" in part):
                    break
                part = self.resolve(part["$ref"], path)
            if not isinstance(part, Mapping):
                raise self.fail(f"allOf at {_short(path)} holds a schema that is not an object")
            if "$ref" in part:
                raise self.fail(f"allOf at {_short(path)}: a chain of $ref longer than {_MAX_REF_HOPS}")
            if id(part) in seen:  # A and A is A (and a part that includes itself ends here)
                continue
            seen.add(id(part))
            if part.get("additionalProperties") is False:
                closed.append(set(part.get("properties", ())))
            for key, value in part.items():
                self.step(2)
                if key in _ANNOTATIONS:
                    continue
                if key == "allOf":
                    parts.extend(value)
                elif key == "properties":
                    for name, sub in value.items():
                        self.step(2)
                        properties[name] = {"allOf": [properties[name], sub]} if name in properties else sub
                elif key == "required":
                    required.update(dict.fromkeys(value))
                elif key == "additionalProperties" and value is False:
                    continue
                elif key in ("anyOf", "oneOf"):
                    if alternatives is not None:
                        raise self.fail(
                            f"allOf at {_short(path)} with more than one anyOf / oneOf is not supported"
                        )
                    alternatives = list(value)
                elif key in merged and merged[key] is not value and self.differ(merged[key], value):
                    merged[key] = self.both(key, merged[key], value, path)
                else:
                    merged[key] = value
        if closed:
            allowed = set.intersection(*closed)
            self.step(len(properties) + len(required))
            properties = {name: sub for name, sub in properties.items() if name in allowed}
            if any(name not in allowed for name in required):
                raise self.fail(
                    f"allOf at {_short(path)}: a required property is forbidden by another part's "
                    "additionalProperties false: no value can match"
                )
            merged["additionalProperties"] = False
        if properties:
            merged["properties"] = properties
        if required:
            merged["required"] = list(required)
        if alternatives is not None:
            self.step(len(alternatives) * (len(merged) + 1))
            return {"anyOf": [{"allOf": [merged, alt]} for alt in alternatives]}
        return merged

    def both(self, key: str, first: Any, second: Any, path: str) -> Any:
        """The value of ``key`` that means both ``first`` and ``second`` (allOf), where one exists."""
        if key == "type":
            common = [t for t in _as_list(first) if t in _as_list(second)]
            if not common:
                raise self.fail(f"allOf at {_short(path)}: the types {first!r} and {second!r} share no value")
            return common if len(common) > 1 else common[0]
        if key in _LOWER_BOUNDS and _both_numbers(first, second):
            return max(first, second)
        if key in _UPPER_BOUNDS and _both_numbers(first, second):
            return min(first, second)
        raise self.fail(f"allOf at {_short(path)}: the schemas disagree on {key!r} (not supported)")

    # -- objects ------------------------------------------------------------------------------

    def object(self, schema: Mapping[str, Any], path: str, hint: str) -> str:
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        if properties is None and (additional is None or additional is True):
            return self.primitive("object")
        properties = properties or {}
        required = set(schema.get("required", ()))
        self.step(len(required))
        kvs: list[str] = []
        needed: list[bool] = []
        for name, sub in properties.items():
            self.step(8)
            value = self.visit(sub, f"{path}.properties.{name}", name)
            key = gbnf_literal(_json_text(name))
            kvs.append(f'{key} space ":" space {value}')
            needed.append(name in required)
        extra = None
        if additional is True or isinstance(additional, Mapping):
            value = self.visit(additional, f"{path}.additionalProperties", f"{hint}-extra")
            extra = self.rule(f"{hint}-extra", f'{self.primitive("string")} ":" space {value}')
        body = self.members(kvs, needed, extra, hint)
        return self.rule(hint, f'"{{" space {body} "}}" space')

    def members(self, kvs: list[str], needed: list[bool], extra: str | None, hint: str) -> str:
        """The members of an object, comma-separated: ``kvs`` in order (``needed`` ones always
        present), then any number of ``extra`` ones."""
        more = f'("," space {extra})*' if extra is not None else ""
        if not kvs:
            return f"({extra} {more})?" if extra is not None else ""
        all_optional = not any(needed)
        required_before = [0]
        for flag in needed:
            required_before.append(required_before[-1] + flag)
        first = self.first_present(kvs, needed, required_before, 0, len(kvs), hint)
        if extra is None:
            return f"({first})?" if all_optional else first
        if all_optional:
            return f"(({first} | {extra}) {more})?"
        return f"{first} {more}"

    def first_present(
        self, kvs: list[str], needed: list[bool], required_before: list[int], lo: int, hi: int, hint: str
    ) -> str:
        """The members ``lo``..``hi`` present (at least one), the first without a comma.

        first(lo, hi) = first(lo, mid) rest(mid, hi) | first(mid, hi) (the latter only when
        every member of lo..mid is optional), split in halves: depth log n, size n."""
        if hi - lo == 1:
            return kvs[lo]
        mid = (lo + hi) // 2
        left = self.first_present(kvs, needed, required_before, lo, mid, hint)
        right_rest = self.rest_present(kvs, needed, mid, hi, hint)
        body = f"{left} {right_rest}"
        if required_before[mid] == required_before[lo]:  # lo..mid all optional
            body += f" | {self.first_present(kvs, needed, required_before, mid, hi, hint)}"
        return self.rule(f"{hint}-kv", body)

    def rest_present(self, kvs: list[str], needed: list[bool], lo: int, hi: int, hint: str) -> str:
        """The members ``lo``..``hi`` present (maybe none), each after a comma."""
        if hi - lo == 1:
            return f'"," space {kvs[lo]}' if needed[lo] else f'("," space {kvs[lo]})?'
        mid = (lo + hi) // 2
        left = self.rest_present(kvs, needed, lo, mid, hint)
        right = self.rest_present(kvs, needed, mid, hi, hint)
        return self.rule(f"{hint}-rest", f"{left} {right}")

    # -- arrays and strings -------------------------------------------------------------------

    def array(self, schema: Mapping[str, Any], path: str, hint: str) -> str:
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        if isinstance(items, list):  # draft 4 tuples
            prefix, items = items, None
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems")
        self.check_range("minItems", lo, "maxItems", hi, path)
        if prefix:
            elements = [
                self.visit(sub, f"{path}.prefixItems[{i}]", f"{hint}-{i}") for i, sub in enumerate(prefix)
            ]
            if hi is not None and hi < len(elements):
                raise self.fail(f"maxItems {hi} at {_short(path)} is below the {len(elements)} prefixItems")
            body = ' "," space '.join(elements)
            if isinstance(items, Mapping) or lo > len(elements):
                item = self.visit(
                    items if isinstance(items, Mapping) else {}, f"{path}.items", f"{hint}-item"
                )
                more = _repeat(
                    f'("," space {item})',
                    max(0, lo - len(elements)),
                    None if hi is None else hi - len(elements),
                )
                body = f"{body} {more}".rstrip()
        else:
            if items is False:
                hi = 0
            item = self.visit(items if isinstance(items, Mapping) else {}, f"{path}.items", f"{hint}-item")
            body = _separated(item, lo, hi)
        return self.rule(hint, f'"[" space {body} "]" space')

    def check_range(self, low_key: str, lo: int, high_key: str, hi: int | None, path: str) -> None:
        if hi is not None and lo > hi:
            raise self.fail(f"{low_key} {lo} is above {high_key} {hi} at {_short(path)}: no value can match")

    def string(self, schema: Mapping[str, Any], path: str, hint: str) -> str:
        pattern = schema.get("pattern")
        if pattern is not None:
            try:
                inner = pattern_to_gbnf(pattern, max_nesting=self.limits.max_nesting, step=self.step)
            except PatternError as exc:
                raise self.fail(f"pattern at {_short(path)} is not supported: {exc}") from None
            return self.rule(hint, f'"\\"" {inner} "\\"" space')
        fmt = schema.get("format")
        if isinstance(fmt, str) and _UUID_FORMAT.fullmatch(fmt):
            return self.primitive("uuid")
        if fmt in _FORMATS:
            return self.primitive(_FORMATS[fmt])
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength")
        self.check_range("minLength", lo, "maxLength", hi, path)
        if lo == 0 and hi is None:
            return self.primitive("string")
        self.primitive("char")
        self.primitive("space")
        return self.rule(hint, f'"\\"" {_repeat("char", lo, hi)} "\\"" space')


def schema_to_gbnf(schema: Mapping[str, Any], *, what: str, limits: GrammarLimits) -> str:
    """The GBNF grammar (root ``root``, one rule per line) of the JSON values ``schema`` allows.

    ``schema`` must have passed ``check_schema``. Raises ``ValueError`` naming ``what`` for
    what the converter cannot express, and when the work exceeds the conversion budget."""
    return _Converter(schema, what, limits).convert()
