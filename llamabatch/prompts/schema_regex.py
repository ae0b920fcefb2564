"""A JSON-schema ``pattern`` (a regular expression) as GBNF for the inside of a JSON string.

A parser reads the pattern left to right, without recursion (open groups on an explicit stack
of at most ``max_nesting``), and writes GBNF as it goes: literal characters, character sets,
groups, alternatives and repetitions. Every step consumes a character of the pattern or fails
and reports its work to the caller's budget, so the work is linear in the pattern and the
grammar it writes, and no input can make it loop.

The pattern constrains the *decoded* string, the grammar the JSON text: every character is
written as its JSON encoding (``"`` as ``\\"``, a control character as ``\\u00XX``).

What the grammar cannot express is refused with a ``ValueError``: backreferences, lookahead
and lookbehind, atomic groups and possessive quantifiers, inline flags, conditionals, word
boundaries, anchors other than a leading ``^`` and a trailing ``$``, and an unbounded
repetition of something that can match the empty string. The syntax is Python's (the pattern
was compiled by :mod:`re` first); ``\\d``, ``\\w``, ``\\s`` and ``.`` take their ECMAScript
(JSON Schema) meaning, each a subset of Python's, so every string the grammar allows also
matches the pattern under either engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamabatch.prompts.grammar_check import GrammarLimits

__all__ = ["PatternError", "check_pattern", "gbnf_literal", "pattern_to_gbnf"]

MAX_CODE_POINT = 0x10FFFF
UNBOUNDED = -1

Ranges = list[tuple[int, int]]

# ECMAScript character classes (JSON Schema patterns are ECMA-262 regular expressions)
_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [
    (0x09, 0x0D),
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
]
_LINE_BREAKS: Ranges = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_SIMPLE_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07}
_HEX = frozenset("0123456789abcdefABCDEF")
_OCT = frozenset("01234567")
_SHORT_JSON_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}


class PatternError(ValueError):
    """A pattern the grammar cannot express (the message says why; the caller names the field)."""


def _normalize(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    start = 0
    for lo, hi in _normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


def _escaped_char(code: int) -> str:
    """A GBNF escape for a character that is not written raw (controls, line and paragraph
    separators, which would split the one-rule-per-line grammar, and surrogates)."""
    return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}"


def _needs_escape(code: int) -> bool:
    return code < 0x20 or 0x7F <= code <= 0x9F or code in (0x2028, 0x2029) or 0xD800 <= code <= 0xDFFF


def _gbnf_class_char(code: int) -> str:
    if code in (0x5C, 0x5D, 0x5B, 0x2D, 0x5E) or _needs_escape(code):
        return _escaped_char(code)
    return chr(code)


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif _needs_escape(ord(ch)):
            out.append(_escaped_char(ord(ch)))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _json_text(code: int) -> str:
    """The JSON encoding of one character inside a string."""
    if code == 0x22:
        return '\\"'
    if code == 0x5C:
        return "\\\\"
    if code in _SHORT_JSON_ESCAPES:
        return _SHORT_JSON_ESCAPES[code]
    if code < 0x20:
        return f"\\u{code:04X}"
    return chr(code)


def _set_to_gbnf(ranges: Ranges) -> str:
    """A set of characters as one GBNF item over their JSON encodings: the characters JSON
    writes raw as a class, the others (``"``, ``\\``, controls) as their escapes."""
    raw: Ranges = []
    escaped: list[int] = []
    controls: list[int] = []
    for lo, hi in ranges:
        for code in range(lo, min(hi, 0x1F) + 1):  # at most 32
            (escaped if code in _SHORT_JSON_ESCAPES else controls).append(code)
        start = max(lo, 0x20)
        for special in (0x22, 0x5C):
            if start <= special <= hi:
                if start < special:
                    raw.append((start, special - 1))
                escaped.append(special)
                start = special + 1
        if start <= hi:
            raw.append((start, hi))
    alternatives = []
    if raw:
        body = "".join(
            _gbnf_class_char(lo) if lo == hi else f"{_gbnf_class_char(lo)}-{_gbnf_class_char(hi)}"
            for lo, hi in raw
        )
        alternatives.append(f"[{body}]")
    alternatives.extend(gbnf_literal(_json_text(code)) for code in escaped)
    for high in (0, 1):
        nibbles = "".join(f"{code & 0xF:X}" for code in controls if code >> 4 == high)
        if len(nibbles) == 1:
            alternatives.append(gbnf_literal(f"\\u00{high}{nibbles}"))
        elif nibbles:
            alternatives.append(gbnf_literal(f"\\u00{high}") + f" [{nibbles}]")
    if not alternatives:
        raise PatternError("a character set that matches no character")
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"


def _raw_set(ranges: Ranges) -> str:
    """A set of characters as one GBNF class of the characters themselves."""
    if not ranges:
        raise PatternError("a character set that matches no character")
    body = "".join(
        _gbnf_class_char(lo) if lo == hi else f"{_gbnf_class_char(lo)}-{_gbnf_class_char(hi)}"
        for lo, hi in ranges
    )
    return f"[{body}]"


@dataclass
class _Item:
    """A translated piece of the pattern: its GBNF ``text``; ``single`` when that is one GBNF
    item without a suffix (so a quantifier applies to it as a whole); ``nullable`` when it can
    match the empty string; ``literal`` the JSON text of one character, merged with the
    literals beside it into one GBNF string."""

    text: str
    single: bool
    nullable: bool
    literal: str | None = None


_EMPTY = _Item("", single=False, nullable=True)


class _Frame:
    """The group being read: its finished branches and the items of the current one."""

    __slots__ = ("bol", "branches", "eol", "items")

    def __init__(self) -> None:
        self.branches: list[_Item] = []
        self.items: list[_Item] = []
        self.bol = False
        self.eol = False


class _Translator:
    """Reads Python :mod:`re` syntax left to right, without recursion, writing GBNF as it goes.

    Every loop iteration consumes at least one character of the pattern and reports it (and
    the text it writes) to ``step``, so the work is linear in the pattern and the output."""

    def __init__(
        self, pattern: str, max_nesting: int, step: Callable[[int], None], raw: bool = False
    ) -> None:
        self.src = pattern
        self.pos = 0
        self.max_nesting = max_nesting
        self.step = step
        self.raw = raw  # the characters themselves, not their JSON encodings

    def fail(self, message: str) -> PatternError:
        return PatternError(f"{message} (at position {self.pos})")

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.src[i] if i < len(self.src) else ""

    def translate(self) -> str:
        stack: list[_Frame] = []
        frame = _Frame()
        while self.pos < len(self.src):
            self.step(1)
            ch = self.src[self.pos]
            self.pos += 1
            if ch == "(":
                self.group_prefix()
                stack.append(frame)
                if len(stack) > self.max_nesting:
                    raise self.fail(f"groups nest deeper than {self.max_nesting} (GrammarLimits.max_nesting)")
                frame = _Frame()
            elif ch == ")":
                if not stack:
                    raise self.fail("unbalanced ')'")
                group = self.close(frame, top=False)
                frame = stack.pop()
                self.push(frame, group)
            elif ch == "|":
                self.end_branch(frame, top=not stack)
            elif ch in "^$":
                self.anchor(frame, ch, top=not stack)
            else:
                self.push(frame, self.atom(ch))
        if stack:
            raise self.fail("missing ')'")
        return self.close(frame, top=True).text

    def anchor(self, frame: _Frame, ch: str, top: bool) -> None:
        misplaced = not top or frame.eol or (ch == "^" and (frame.items or frame.bol))
        if misplaced:
            raise self.fail("the anchors ^ and $ are supported only at the start and the end of the pattern")
        if self.quantifier_ahead():
            raise self.fail("nothing to repeat")
        if ch == "^":
            frame.bol = True
        else:
            frame.eol = True

    def push(self, frame: _Frame, item: _Item) -> None:
        if frame.eol:
            raise self.fail("the anchors ^ and $ are supported only at the start and the end of the pattern")
        bounds = self.quantifier()
        if bounds is not None:
            if self.peek() == "+":
                raise self.fail("possessive quantifiers are not supported")
            if self.peek() == "?":  # lazy: the same strings
                self.pos += 1
            if self.quantifier_ahead():
                raise self.fail("multiple repeat")
            item = self.repeat(item, *bounds)
        self.step(len(item.text))
        frame.items.append(item)

    def end_branch(self, frame: _Frame, top: bool) -> None:
        if top and not (frame.bol and frame.eol):
            raise PatternError("the pattern must start with ^ and end with $ (the whole string)")
        frame.branches.append(self.sequence(frame.items))
        frame.items = []
        frame.bol = frame.eol = False

    def close(self, frame: _Frame, top: bool) -> _Item:
        self.end_branch(frame, top)
        branches = frame.branches
        if len(branches) == 1:
            return branches[0]
        text = "(" + " | ".join(branch.text for branch in branches) + ")"
        self.step(len(text))
        return _Item(text, single=True, nullable=any(branch.nullable for branch in branches))

    def sequence(self, items: list[_Item]) -> _Item:
        parts: list[str] = []
        last_single = False
        literal: list[str] = []
        for item in items:
            if item.literal is not None:
                literal.append(item.literal)
                continue
            if literal:
                parts.append(gbnf_literal("".join(literal)))
                literal = []
            if item.text:
                parts.append(item.text)
                last_single = item.single
        if literal:
            parts.append(gbnf_literal("".join(literal)))
            last_single = True
        if not parts:
            return _EMPTY
        nullable = all(item.nullable for item in items)
        if len(parts) == 1:
            return _Item(parts[0], single=last_single, nullable=nullable)
        text = " ".join(parts)
        self.step(len(text))
        return _Item(text, single=False, nullable=nullable)

    def repeat(self, item: _Item, lo: int, hi: int) -> _Item:
        if hi == 0 or not item.text:
            return _EMPTY
        if hi == UNBOUNDED and item.nullable:
            raise self.fail("an unbounded repetition of something that can match the empty string")
        if lo == hi == 1:
            return item
        base = item.text if item.single else f"({item.text})"
        if hi == UNBOUNDED:
            suffix = "*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}"
        elif lo == 0 and hi == 1:
            suffix = "?"
        elif lo == hi:
            suffix = f"{{{lo}}}"
        else:
            suffix = f"{{{lo},{hi}}}"
        return _Item(base + suffix, single=False, nullable=lo == 0 or item.nullable)

    def quantifier_ahead(self) -> bool:
        start = self.pos
        try:
            return self.quantifier() is not None
        except PatternError:
            return True
        finally:
            self.pos = start

    def quantifier(self) -> tuple[int, int] | None:
        """``*``, ``+``, ``?``, or Python's ``{m}``, ``{m,}``, ``{,n}``, ``{m,n}``, ``{,}`` (ASCII
        digits only; any other ``{`` is a literal character)."""
        ch = self.peek()
        if ch and ch in "*+?":
            self.pos += 1
            return {"*": (0, UNBOUNDED), "+": (1, UNBOUNDED), "?": (0, 1)}[ch]
        if ch != "{":
            return None
        low_end = self.digits_end(self.pos + 1)
        low_digits = self.src[self.pos + 1 : low_end]
        end = low_end
        high_digits: str | None = None
        if self.src.startswith(",", low_end):
            end = self.digits_end(low_end + 1)
            high_digits = self.src[low_end + 1 : end]
        if not self.src.startswith("}", end) or (not low_digits and high_digits is None):
            return None
        if len(low_digits) > 9 or len(high_digits or "") > 9:
            raise self.fail("a repetition count is too large")
        self.pos = end + 1
        lo = int(low_digits) if low_digits else 0
        if high_digits is None:
            hi = lo
        else:
            hi = int(high_digits) if high_digits else UNBOUNDED
        if hi != UNBOUNDED and hi < lo:
            raise self.fail("min repeat greater than max repeat")
        return lo, hi

    def digits_end(self, i: int) -> int:
        while i < len(self.src) and self.src[i] in "0123456789":
            i += 1
        return i

    def group_prefix(self) -> None:
        if self.peek() != "?":
            return
        kind = self.peek(1)
        if kind == ":":
            self.pos += 2
        elif kind == "P" and self.peek(2) == "<":
            end = self.src.find(">", self.pos + 3)
            if end < 0:
                raise self.fail("unterminated group name")
            self.pos = end + 1
        elif kind == "P" and self.peek(2) == "=":
            raise self.fail("backreferences are not supported")
        elif kind in ("=", "!") or (kind == "<" and self.peek(2) in ("=", "!")):
            raise self.fail("lookahead and lookbehind are not supported")
        elif kind == ">":
            raise self.fail("atomic groups are not supported")
        elif kind == "(":
            raise self.fail("conditional groups are not supported")
        elif kind == "#":
            raise self.fail("comments are not supported")
        else:
            raise self.fail("inline flags and other (?...) groups are not supported")

    def atom(self, ch: str) -> _Item:
        if ch == "[":
            return self.set_item(self.char_class())
        if ch == ".":
            return self.set_item(_complement(_LINE_BREAKS))
        if ch == "\\":
            return self.escape()
        if ch in "*+?":
            raise self.fail("nothing to repeat")
        if ch == "{":
            self.pos -= 1
            if self.quantifier_ahead():
                raise self.fail("nothing to repeat")
            self.pos += 1
        return self.set_item([(ord(ch), ord(ch))])  # ']', '}' and a '{' that quantifies nothing

    def set_item(self, ranges: Ranges) -> _Item:
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            text = chr(ranges[0][0]) if self.raw else _json_text(ranges[0][0])
            return _Item(gbnf_literal(text), single=True, nullable=False, literal=text)
        self.step(len(ranges))
        return _Item(_raw_set(ranges) if self.raw else _set_to_gbnf(ranges), single=True, nullable=False)

    def escape(self) -> _Item:
        ch = self.peek()
        if not ch:
            raise self.fail("a pattern cannot end with '\\'")
        if ch in "dDwWsS":
            self.pos += 1
            return self.set_item(_category(ch))
        if ch in "bBAZ":
            raise self.fail(f"the assertion \\{ch} is not supported")
        if ch in "123456789":
            raise self.fail("backreferences are not supported")
        code = self.char_escape(in_class=False)
        return self.set_item([(code, code)])

    def char_escape(self, in_class: bool) -> int:
        """The code point of the escape after a backslash (one character)."""
        ch = self.src[self.pos]
        self.pos += 1
        if ch in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[ch]
        if ch == "b" and in_class:
            return 0x08
        if ch in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits = self.src[self.pos : self.pos + width]
            if len(digits) != width or not all(d in _HEX for d in digits):
                raise self.fail(f"\\{ch} needs {width} hex digits")
            self.pos += width
            code = int(digits, 16)
            if code > MAX_CODE_POINT:
                raise self.fail("a code point above U+10FFFF")
            return code
        if ch in _OCT and (ch == "0" or in_class):
            digits = ch
            while len(digits) < 3 and self.peek() and self.peek() in _OCT:
                digits += self.src[self.pos]
                self.pos += 1
            return int(digits, 8)
        if ch == "N":
            raise self.fail("named characters (\\N{...}) are not supported")
        if ch.isascii() and ch.isalnum():
            raise self.fail(f"bad escape \\{ch}")
        return ord(ch)

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: Ranges = []
        first = True
        while True:
            self.step(1)
            ch = self.peek()
            if not ch:
                raise self.fail("unterminated character set")
            if ch == "]" and not first:
                self.pos += 1
                break
            first = False
            if ch == "\\" and self.peek(1) and self.peek(1) in "dDwWsS":
                self.pos += 2
                ranges.extend(_category(self.src[self.pos - 1]))
                continue
            low = self.class_char()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                if self.peek() == "\\" and self.peek(1) and self.peek(1) in "dDwWsS":
                    raise self.fail("bad character range")
                high = self.class_char()
                if high < low:
                    raise self.fail("bad character range")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        ranges = _normalize(ranges)
        return _complement(ranges) if negated else ranges

    def class_char(self) -> int:
        ch = self.src[self.pos]
        self.pos += 1
        if ch != "\\":
            return ord(ch)
        if self.pos >= len(self.src):
            raise self.fail("unterminated character set")
        return self.char_escape(in_class=True)


def _category(ch: str) -> Ranges:
    base = {"d": _DIGIT, "w": _WORD, "s": _SPACE}[ch.lower()]
    return _complement(base) if ch.isupper() else list(base)


def pattern_to_gbnf(pattern: str, *, max_nesting: int, step: Callable[[int], None], raw: bool = False) -> str:
    """GBNF for the JSON text of a string's contents (without the quotes) matching ``pattern``;
    with ``raw``, for the text itself (a whole output constrained by a regular expression).

    ``step(n)`` is called as work is done (the caller's budget: it raises to stop the work).
    Raises :class:`PatternError` for what the grammar cannot express."""
    return _Translator(pattern, max_nesting, step, raw).translate()


# {m}, {m,}, {m,n} quantifiers of a regular expression
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_pattern(pattern: Any, path: str, what: str, limits: GrammarLimits) -> None:
    """A pattern Python's ``re`` compiles, anchored at both ends, within the nesting and
    repetition limits (``ValueError`` naming ``what`` and ``path``); what the grammar cannot
    express the translator refuses later."""
    if not isinstance(pattern, str):
        raise ValueError(f"{what}: pattern at {path} must be a string, got {pattern!r:.60}")
    if not (pattern.startswith("^") and pattern.endswith("$")) or len(pattern) < 2:
        raise ValueError(f"{what}: pattern at {path} must start with ^ and end with $ (the whole string)")
    depth = deepest = 0
    escaped = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    if deepest > limits.max_nesting:
        raise ValueError(
            f"{what}: pattern at {path} nests {deepest} groups, above the limit of {limits.max_nesting} "
            "(GrammarLimits.max_nesting)"
        )
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise ValueError(f"{what}: pattern at {path} is not a valid regular expression: {exc}") from None
    for match in _QUANTIFIER.finditer(pattern):
        for digits in match.groups():
            if digits and (len(digits) > 9 or int(digits) > limits.max_repetition):
                raise ValueError(
                    f"{what}: the quantifier {match.group(0)} in pattern at {path} exceeds the limit of "
                    f"{limits.max_repetition} (GrammarLimits.max_repetition)"
                )
