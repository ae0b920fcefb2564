"""Validation of GBNF grammars before llama.cpp sees them (the sibling of ``gguf/check.py``).

llama.cpp's grammar code trusts its input. Its parser recurses once per nested group, and its
left-recursion check once per rule of a chain of leftmost references (without memoizing, so a
chain of rules that each reference the next one twice takes exponential time); deep inputs
overflow the thread's stack (SIGSEGV). ``x{5,2}`` makes its repetition expansion loop until
memory runs out. A grammar that can admit no character (``root ::= [b-a]``) leaves the sampler
with no candidate, and accepting the token it draws anyway throws a C++ exception that ends the
process. ``check_grammar`` parses the grammar here first, with the same syntax and the same
expansion of groups and repetitions into rules, without recursion and under ``GrammarLimits``,
and refuses:

- grammars over the limits: size in bytes, rules and elements after expansion, nested groups,
  repetition counts (``{m,n}``), the depth and the number of calls of llama.cpp's
  left-recursion check, the number of parse stacks one step can fan out to;
- syntax errors, undefined rules, a missing ``root``, ``{m,n}`` with ``m > n``;
- character classes that match no character: empty (``[]``), inverted (``[b-a]``), a negated
  class covering every character, U+0000 (which no token produces);
- left recursion (also through rules that can only match the empty string);
- rules reachable from ``root`` that can never finish (unproductive: ``x ::= "a" x``).

Every problem is a ``ValueError`` naming the field (``what``), the problem, and the limit.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields

__all__ = [
    "DEFAULT_GRAMMAR_LIMITS",
    "LLAMA_REPETITION_THRESHOLD",
    "GrammarLimits",
    "GrammarStats",
    "check_grammar",
    "get_grammar_limits",
    "set_grammar_limits",
]

#: llama.cpp's own cap (``MAX_REPETITION_THRESHOLD``): a bound above it silently becomes
#: unbounded, and ``rules in the repeated item x count`` above it is a parse error.
LLAMA_REPETITION_THRESHOLD = 2000
#: The largest Unicode code point; code point 0 ends a C string and is never produced.
MAX_CODE_POINT = 0x10FFFF


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a GBNF grammar (and on the JSON schemas turned into one).

    The defaults leave a wide margin on a default thread stack (llama.cpp's parser ran out of a
    8 MiB stack at about 14,000 nested groups) and admit every grammar the JSON-schema
    converter makes from reasonable schemas.
    """

    #: grammar text size, UTF-8 bytes
    max_bytes: int = 256 * 1024
    #: rules after llama.cpp's expansion (each group and each repetition step is a rule)
    max_rules: int = 10_000
    #: grammar elements (characters, ranges, references) after expansion
    max_elements: int = 200_000
    #: nested parentheses (llama.cpp's parser recurses once per level)
    max_nesting: int = 200
    #: ``m`` and ``n`` of ``{m,n}`` (at most llama.cpp's own 2000)
    max_repetition: int = 1000
    #: the longest chain of leftmost rule references (llama.cpp's left-recursion check recurses along it)
    max_ref_depth: int = 500
    #: calls of llama.cpp's left-recursion check from one rule (it does not memoize)
    max_ref_calls: int = 200_000
    #: parse stacks that entering one rule can fan out to (each is checked against the vocabulary
    #: at every token: their number times the vocabulary size is the cost of a step)
    max_stacks: int = 1024
    #: parse stacks a grammar may hold while generating (checked after every token: an ambiguous
    #: grammar such as ``(a{0,100}){0,100}`` multiplies them; the request then ends with "error")
    max_live_stacks: int = 1024
    #: JSON schemas: nesting depth of objects and arrays
    max_schema_depth: int = 64
    #: JSON schemas: objects, arrays and values in total
    max_schema_nodes: int = 20_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarLimits.{f.name} must be a positive int, got {value!r}")
        if self.max_repetition > LLAMA_REPETITION_THRESHOLD:
            raise ValueError(
                f"GrammarLimits.max_repetition must be at most {LLAMA_REPETITION_THRESHOLD} "
                f"(llama.cpp treats larger bounds as unbounded), got {self.max_repetition}"
            )


#: The limits ``SamplingParams`` applies unless ``set_grammar_limits`` changed them.
DEFAULT_GRAMMAR_LIMITS = GrammarLimits()
_limits = DEFAULT_GRAMMAR_LIMITS


def get_grammar_limits() -> GrammarLimits:
    """The process-wide limits that ``SamplingParams`` checks grammars and schemas against."""
    return _limits


def set_grammar_limits(limits: GrammarLimits | None) -> GrammarLimits:
    """Replace the process-wide limits (None: the defaults); returns the previous ones.

    They apply to ``SamplingParams`` made afterwards (in-process and on the server)."""
    global _limits
    if limits is not None and not isinstance(limits, GrammarLimits):
        raise TypeError(f"set_grammar_limits needs a GrammarLimits or None, got {type(limits).__name__}")
    previous, _limits = _limits, limits if limits is not None else DEFAULT_GRAMMAR_LIMITS
    return previous


@dataclass(frozen=True)
class GrammarStats:
    """What ``check_grammar`` measured on a valid grammar."""

    n_rules: int
    n_elements: int
    max_nesting: int
    ref_depth: int
    ref_calls: int
    max_stacks: int


_TERM = -1  # a terminal element (characters, a token); rule references are ids >= 0
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class _Frame:
    """A rule (or group) being parsed: its alternatives so far."""

    __slots__ = ("alts", "last_sym_start", "n_prev_rules", "n_symbols_before", "nested", "rule_id")

    def __init__(self, rule_id: int, nested: bool, n_symbols_before: int = 0) -> None:
        self.rule_id = rule_id
        self.nested = nested
        self.alts: list[list[int]] = [[]]
        self.last_sym_start = 0
        self.n_prev_rules = 1
        self.n_symbols_before = n_symbols_before


class _Parser:
    """llama.cpp's GBNF parser, iterative, with the same expansion of groups and repetitions."""

    def __init__(self, text: str, what: str, limits: GrammarLimits) -> None:
        self.s = text
        self.n = len(text)
        self.what = what
        self.limits = limits
        self.symbol_ids: dict[str, int] = {}
        self.rules: dict[int, list[list[int]]] = {}
        self.referenced: dict[int, int] = {}  # rule id -> position of a first reference
        self.generated: set[int] = set()
        self.n_elements = 0
        self.max_depth_seen = 0

    # -- errors and positions -------------------------------------------------------------

    def fail(self, message: str, pos: int | None = None) -> ValueError:
        where = ""
        if pos is not None:
            line = self.s.count("\n", 0, pos) + 1
            column = pos - (self.s.rfind("\n", 0, pos) + 1) + 1
            where = f" at line {line}, column {column}"
        return ValueError(f"{self.what}: {message}{where}")

    def over(self, what: str, value: int, limit_name: str) -> ValueError:
        limit = getattr(self.limits, limit_name)
        return ValueError(
            f"{self.what}: {what} ({value}) exceeds the limit of {limit} (GrammarLimits.{limit_name})"
        )

    # -- symbols and rules ----------------------------------------------------------------

    def symbol(self, name: str) -> int:
        rule_id = self.symbol_ids.setdefault(name, len(self.symbol_ids))
        if rule_id >= self.limits.max_rules:
            raise self.over("the number of rules", rule_id + 1, "max_rules")
        return rule_id

    def generate_symbol(self, base: str) -> int:
        next_id = len(self.symbol_ids)
        self.symbol_ids[f"{base}_{next_id}"] = next_id
        self.generated.add(next_id)
        if next_id >= self.limits.max_rules:
            raise self.over(
                "the number of rules after expanding groups and repetitions", next_id + 1, "max_rules"
            )
        return next_id

    def add_elements(self, count: int) -> None:
        self.n_elements += count
        if self.n_elements > self.limits.max_elements:
            raise self.over("the number of grammar elements after expansion", self.n_elements, "max_elements")

    # -- lexing ---------------------------------------------------------------------------

    def space(self, i: int, newline_ok: bool) -> int:
        s, n = self.s, self.n
        while i < n:
            c = s[i]
            if c == " " or c == "\t" or (newline_ok and (c == "\r" or c == "\n")):
                i += 1
            elif c == "#":
                while i < n and s[i] != "\r" and s[i] != "\n":
                    i += 1
            else:
                break
        return i

    def name_end(self, i: int) -> int:
        j = i
        while j < self.n and self.s[j] in _WORD:
            j += 1
        if j == i:
            raise self.fail("expecting a rule name", i)
        return j

    def int_end(self, i: int) -> int:
        j = i
        while j < self.n and self.s[j] in _DIGITS:
            j += 1
        if j == i:
            raise self.fail("expecting an integer", i)
        return j

    def char(self, i: int) -> tuple[int, int]:
        """One character (or escape) of a literal or class: ``(code point, next index)``."""
        s = self.s
        if i >= self.n:
            raise self.fail("unexpected end of the grammar", i)
        if s[i] != "\\":
            return ord(s[i]), i + 1
        kind = s[i + 1] if i + 1 < self.n else ""
        if kind in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[kind], i + 2
        if kind in _HEX_ESCAPES:
            size = _HEX_ESCAPES[kind]
            digits = s[i + 2 : i + 2 + size]
            if len(digits) != size or any(d not in _HEX for d in digits):
                raise self.fail(f"expecting {size} hex digits after \\{kind}", i)
            return int(digits, 16), i + 2 + size
        raise self.fail(f"unknown escape \\{kind}", i)

    # -- the grammar ----------------------------------------------------------------------

    def parse(self) -> None:
        i = self.space(0, True)
        while i < self.n:
            i = self.rule(i)

    def rule(self, i: int) -> int:
        s = self.s
        end = self.name_end(i)
        name = s[i:end]
        rule_id = self.symbol(name)
        i = self.space(end, False)
        if s[i : i + 3] != "::=":
            raise self.fail("expecting ::=", i)
        i = self.space(i + 3, True)
        frames = [_Frame(rule_id, nested=False)]
        while True:
            frame = frames[-1]
            c = s[i] if i < self.n else ""
            alt = frame.alts[-1]
            if c == '"':
                i += 1
                frame.last_sym_start = len(alt)
                frame.n_prev_rules = 1
                count = 0
                while True:
                    if i >= self.n:
                        raise self.fail("unterminated string literal", i)
                    if s[i] == '"':
                        break
                    start = i
                    code, i = self.char(i)
                    if code == 0 or code > MAX_CODE_POINT:
                        raise self.fail(f"the character U+{code:04X} can never be generated", start)
                    count += 1
                alt.extend([_TERM] * count)
                self.add_elements(count)
                i = self.space(i + 1, frame.nested)
            elif c == "[":
                i = self.char_class(i)
                frame.last_sym_start = len(alt)
                frame.n_prev_rules = 1
                alt.append(_TERM)
                self.add_elements(1)
                i = self.space(i, frame.nested)
            elif c == "<" or c == "!":
                i = self.token(i + 1 if c == "!" else i)
                frame.last_sym_start = len(alt)
                frame.n_prev_rules = 1
                alt.append(_TERM)
                self.add_elements(1)
                i = self.space(i, frame.nested)
            elif c in _WORD:
                end = self.name_end(i)
                ref = self.symbol(s[i:end])
                self.referenced.setdefault(ref, i)
                frame.last_sym_start = len(alt)
                frame.n_prev_rules = 1
                alt.append(ref)
                self.add_elements(1)
                i = self.space(end, frame.nested)
            elif c == "(":
                if len(frames) > self.limits.max_nesting:
                    raise self.over("nested groups", len(frames), "max_nesting")
                self.max_depth_seen = max(self.max_depth_seen, len(frames))
                before = len(self.symbol_ids)
                sub = self.generate_symbol(name)
                frames.append(_Frame(sub, nested=True, n_symbols_before=before))
                i = self.space(i + 1, True)
            elif c == ".":
                frame.last_sym_start = len(alt)
                frame.n_prev_rules = 1
                alt.append(_TERM)
                self.add_elements(1)
                i = self.space(i + 1, frame.nested)
            elif c == "*" or c == "+" or c == "?":
                self.repeat(frame, name, i, 1 if c == "+" else 0, 1 if c == "?" else None)
                i = self.space(i + 1, frame.nested)
            elif c == "{":
                i = self.braces(frame, name, i)
            elif c == "|":
                frame.alts.append([])
                frame.last_sym_start = 0
                frame.n_prev_rules = 1
                i = self.space(i + 1, True)
            else:  # the end of this rule's (or group's) alternatives
                frames.pop()
                self.rules[frame.rule_id] = frame.alts
                self.add_elements(len(frame.alts))
                if not frames:
                    break
                if c != ")":
                    raise self.fail("expecting ')'", i)
                parent = frames[-1]
                parent_alt = parent.alts[-1]
                parent.n_prev_rules = max(1, len(self.symbol_ids) - frame.n_symbols_before)
                parent.last_sym_start = len(parent_alt)
                parent_alt.append(frame.rule_id)
                self.referenced.setdefault(frame.rule_id, i)
                self.add_elements(1)
                i = self.space(i + 1, parent.nested)
        if i < self.n:
            if s[i] == "\r":
                i += 2 if s[i + 1 : i + 2] == "\n" else 1
            elif s[i] == "\n":
                i += 1
            else:
                raise self.fail(f"unexpected {s[i]!r} (expecting a newline or the end)", i)
        return self.space(i, True)

    def char_class(self, i: int) -> int:
        """Parse ``[...]`` at ``i``; refuses classes that match no character."""
        s = self.s
        start = i
        i += 1
        negated = i < self.n and s[i] == "^"
        if negated:
            i += 1
        ranges: list[tuple[int, int]] = []
        while True:
            if i >= self.n:
                raise self.fail("unterminated character class", start)
            if s[i] == "]":
                break
            item = i
            lo, i = self.char(i)
            hi = lo
            if i < self.n and s[i] == "-" and s[i + 1 : i + 2] not in ("]", ""):
                hi, i = self.char(i + 1)
                if hi < lo:
                    raise self.fail(f"inverted character range {s[item:i]!r} (U+{lo:04X} > U+{hi:04X})", item)
            elif i < self.n and s[i] == "-" and i + 1 >= self.n:
                raise self.fail("unexpected end of the grammar", i)
            ranges.append((lo, hi))
        if not ranges:
            raise self.fail(f"empty character class {s[start : i + 1]!r}", start)
        if not _matches_some(ranges, negated):
            raise self.fail(f"the character class {s[start : i + 1][:80]!r} matches no character", start)
        return i + 1

    def token(self, i: int) -> int:
        s = self.s
        if i >= self.n or s[i] != "<":
            raise self.fail("expecting '<'", i)
        i += 1
        if i < self.n and s[i] == "[":
            end = self.int_end(i + 1)
            if end - (i + 1) > 10 or int(s[i + 1 : end]) >= 2**31:
                raise self.fail("token id out of range", i)
            if s[end : end + 2] != "]>":
                raise self.fail("expecting ']>'", end)
            return end + 2
        end = s.find(">", i)
        if end < 0:
            raise self.fail("expecting '>'", i)
        return end + 1

    def braces(self, frame: _Frame, name: str, i: int) -> int:
        s = self.s
        start = i
        i = self.space(i + 1, frame.nested)
        end = self.int_end(i)
        lo = self._bound(s[i:end], start)
        i = self.space(end, frame.nested)
        hi: int | None
        if i < self.n and s[i] == "}":
            hi = lo
        elif i < self.n and s[i] == ",":
            i = self.space(i + 1, frame.nested)
            hi = None
            if i < self.n and s[i] in _DIGITS:
                end = self.int_end(i)
                hi = self._bound(s[i:end], start)
                i = self.space(end, frame.nested)
            if i >= self.n or s[i] != "}":
                raise self.fail("expecting '}'", i)
        else:
            raise self.fail("expecting ',' or '}'", i)
        if hi is not None and hi < lo:
            raise self.fail(f"repetition {s[start : i + 1]!r} has its maximum below its minimum", start)
        self.repeat(frame, name, start, lo, hi)
        return self.space(i + 1, frame.nested)

    def _bound(self, digits: str, pos: int) -> int:
        limit = self.limits.max_repetition
        if len(digits) > len(str(limit)) or int(digits) > limit:
            raise ValueError(
                f"{self.what}: repetition count {digits[:30]} exceeds the limit of {limit} "
                f"(GrammarLimits.max_repetition) at line {self.s.count(chr(10), 0, pos) + 1}"
            )
        return int(digits)

    def repeat(self, frame: _Frame, name: str, pos: int, lo: int, hi: int | None) -> None:
        """llama.cpp's rewrite of ``S{lo,hi}`` into ``S`` x lo and a chain of optional rules."""
        alt = frame.alts[-1]
        if frame.last_sym_start == len(alt):
            raise self.fail("a repetition operator needs a preceding item", pos)
        prev = alt[frame.last_sym_start :]
        total = hi if hi is not None and hi > 0 else lo if lo > 0 else 1
        if frame.n_prev_rules * total > LLAMA_REPETITION_THRESHOLD:
            raise self.fail(
                f"nested repetitions expand to {frame.n_prev_rules * total} rules, above llama.cpp's "
                f"limit of {LLAMA_REPETITION_THRESHOLD}",
                pos,
            )
        if lo == 0:
            del alt[frame.last_sym_start :]
        else:
            self.add_elements(len(prev) * (lo - 1))
            for _ in range(lo - 1):
                alt.extend(prev)
        n_opt = 1 if hi is None else hi - lo
        last = -1
        for k in range(n_opt):
            rule_id = self.generate_symbol(name)
            body = list(prev)
            if k > 0 or hi is None:
                body.append(rule_id if hi is None else last)
            self.rules[rule_id] = [body, []]
            self.add_elements(len(body) + 2)
            last = rule_id
        if n_opt > 0:
            alt.append(last)
            self.referenced.setdefault(last, pos)
        frame.n_prev_rules *= total


def _matches_some(ranges: list[tuple[int, int]], negated: bool) -> bool:
    """Whether a class of ``ranges`` matches some code point in [1, MAX_CODE_POINT]."""
    clipped = sorted((max(lo, 1), min(hi, MAX_CODE_POINT)) for lo, hi in ranges)
    clipped = [(lo, hi) for lo, hi in clipped if lo <= hi]
    if not negated:
        return bool(clipped)
    covered = 0  # every code point in [1, covered] is in the class
    for lo, hi in clipped:
        if lo > covered + 1:
            return True
        covered = max(covered, hi)
    return covered < MAX_CODE_POINT


def _analyse(parser: _Parser) -> GrammarStats:
    """Undefined rules, productivity, left recursion and the costs of llama.cpp's checks."""
    what, limits, rules = parser.what, parser.limits, parser.rules
    names = {rule_id: name for name, rule_id in parser.symbol_ids.items()}
    # Generated names hold '_', which rule names cannot, so ids are 0..n-1; checked anyway.
    n_symbols = 1 + max([*rules, *parser.referenced, len(parser.symbol_ids) - 1])

    def describe(rule_id: int) -> str:
        name = names.get(rule_id, str(rule_id))
        if rule_id in parser.generated:
            return f"a group or repetition in rule {name.rpartition('_')[0]!r}"
        return f"rule {name!r}"

    for name, rule_id in parser.symbol_ids.items():
        if rule_id not in rules:
            raise parser.fail(f"undefined rule {name!r}", parser.referenced.get(rule_id))
    for rule_id in range(n_symbols):
        if rule_id not in rules:
            raise ValueError(f"{what}: undefined rule (id {rule_id})")
    root = parser.symbol_ids.get("root")
    if root is None:
        raise ValueError(f"{what}: the grammar has no 'root' rule")

    # Nullable and productive rules (fixpoints over counters, linear time).
    nullable = [False] * n_symbols
    productive = [False] * n_symbols
    users: list[list[tuple[int, int]]] = [[] for _ in range(n_symbols)]  # rule -> (rule, alt index)
    alt_list: list[tuple[int, list[int]]] = []
    for rule_id in range(n_symbols):
        for alt in rules[rule_id]:
            alt_list.append((rule_id, alt))
    missing_p = [0] * len(alt_list)
    missing_n = [0] * len(alt_list)
    queue_p: list[int] = []
    queue_n: list[int] = []
    for index, (rule_id, alt) in enumerate(alt_list):
        has_term = False
        for element in alt:
            if element == _TERM:
                has_term = True
            else:
                users[element].append((index, 1))
                missing_p[index] += 1
                missing_n[index] += 1
        if has_term:
            missing_n[index] = -1  # never nullable
        if missing_p[index] == 0 and not productive[rule_id]:
            productive[rule_id] = True
            queue_p.append(rule_id)
        if missing_n[index] == 0 and not nullable[rule_id]:
            nullable[rule_id] = True
            queue_n.append(rule_id)
    for flags, missing, queue in ((productive, missing_p, queue_p), (nullable, missing_n, queue_n)):
        while queue:
            done = queue.pop()
            for index, _ in users[done]:
                if missing[index] <= 0:
                    continue
                missing[index] -= 1
                if missing[index] == 0:
                    owner = alt_list[index][0]
                    if not flags[owner]:
                        flags[owner] = True
                        queue.append(owner)

    # Rules reachable from root must be productive.
    seen = [False] * n_symbols
    seen[root] = True
    stack = [root]
    while stack:
        rule_id = stack.pop()
        if not productive[rule_id]:
            raise ValueError(
                f"{what}: {describe(rule_id)} can never finish (every alternative needs itself or "
                "another rule that can never finish), so generation would get stuck"
            )
        for alt in rules[rule_id]:
            for element in alt:
                if element != _TERM and not seen[element]:
                    seen[element] = True
                    stack.append(element)

    # Left edges: references that can come first (after nullable ones). llama.cpp's check
    # follows a subset of them (it only skips rules with a literally empty alternative).
    left: list[list[int]] = [[] for _ in range(n_symbols)]
    weight = [0] * n_symbols  # terminals that can come first
    for rule_id in range(n_symbols):
        edges = left[rule_id]
        terms = 0
        for alt in rules[rule_id]:
            for element in alt:
                if element == _TERM:
                    terms += 1
                    break
                edges.append(element)
                if not nullable[element]:
                    break
        weight[rule_id] = terms
    depth = [0] * n_symbols
    calls = [0] * n_symbols
    stacks = [0] * n_symbols
    state = [0] * n_symbols  # 0 new, 1 on the path, 2 done
    cap = max(limits.max_ref_calls, limits.max_stacks) + 1
    for start in range(n_symbols):
        if state[start]:
            continue
        path = [(start, 0)]
        state[start] = 1
        while path:
            rule_id, k = path[-1]
            edges = left[rule_id]
            if k < len(edges):
                path[-1] = (rule_id, k + 1)
                child = edges[k]
                if state[child] == 1:
                    raise ValueError(
                        f"{what}: left recursion: {describe(child)} can begin with itself "
                        f"(through {describe(rule_id)}), which llama.cpp cannot handle"
                    )
                if state[child] == 0:
                    state[child] = 1
                    path.append((child, 0))
                    if len(path) > limits.max_ref_depth:
                        raise parser.over("the chain of leftmost rule references", len(path), "max_ref_depth")
                continue
            path.pop()
            state[rule_id] = 2
            depth[rule_id] = 1 + max((depth[c] for c in edges), default=0)
            calls[rule_id] = min(cap, 1 + sum(calls[c] for c in edges))
            stacks[rule_id] = min(cap, weight[rule_id] + sum(stacks[c] for c in edges))
            if depth[rule_id] > limits.max_ref_depth:
                raise parser.over("the chain of leftmost rule references", depth[rule_id], "max_ref_depth")
            if calls[rule_id] > limits.max_ref_calls:
                raise parser.over(
                    f"llama.cpp's left-recursion check from {describe(rule_id)} (calls)",
                    calls[rule_id],
                    "max_ref_calls",
                )
            if stacks[rule_id] > limits.max_stacks:
                raise parser.over(
                    f"the parse stacks entering {describe(rule_id)} fans out to",
                    stacks[rule_id],
                    "max_stacks",
                )
    return GrammarStats(
        n_rules=n_symbols,
        n_elements=parser.n_elements,
        max_nesting=parser.max_depth_seen,
        ref_depth=max(depth, default=0),
        ref_calls=max(calls, default=0),
        max_stacks=max(stacks, default=0),
    )


def check_grammar(
    grammar: str, *, what: str = "grammar", limits: GrammarLimits | None = None
) -> GrammarStats:
    """Validate a GBNF ``grammar`` (root rule ``root``) as llama.cpp would parse it.

    Raises ``ValueError`` naming ``what``, the problem and, for a limit, the ``GrammarLimits``
    field. ``limits`` defaults to the process-wide ones (``get_grammar_limits``). The grammars
    that passed are remembered (by digest, whatever ``what`` named them), so checking the same
    grammar again is cheap."""
    if not isinstance(grammar, str):
        raise ValueError(f"{what} must be a str, got {type(grammar).__name__}")
    limits = limits if limits is not None else _limits
    data = grammar.encode("utf-8", "surrogatepass")
    if len(data) > limits.max_bytes:  # refused before it is hashed
        return _check(grammar, len(data), what, limits)
    key = (hashlib.blake2b(data, digest_size=16).digest(), limits)
    with _passed_lock:
        stats = _passed.get(key)
        if stats is not None:
            _passed.move_to_end(key)
            return stats
    stats = _check(grammar, len(data), what, limits)
    with _passed_lock:
        _passed[key] = stats
        while len(_passed) > _PASSED_MAX:
            _passed.popitem(last=False)
    return stats


#: the last grammars that passed, by digest: keyed by their text, 256 grammars of 256 KiB
#: would keep 64 MiB alive
_PASSED_MAX = 256
_passed: OrderedDict[tuple[bytes, GrammarLimits], GrammarStats] = OrderedDict()
_passed_lock = threading.Lock()


def _check(grammar: str, size: int, what: str, limits: GrammarLimits) -> GrammarStats:
    if size > limits.max_bytes:
        raise ValueError(
            f"{what}: the grammar is {size} bytes, above the limit of {limits.max_bytes} "
            "(GrammarLimits.max_bytes)"
        )
    if "\x00" in grammar:
        raise ValueError(f"{what}: the grammar contains a NUL character")
    parser = _Parser(grammar, what, limits)
    parser.parse()
    return _analyse(parser)
