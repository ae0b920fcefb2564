"""Whole outputs constrained as vLLM's structured outputs do besides JSON: a regular
expression (``SamplingParams.regex``, vLLM's ``guided_regex``) or one of a list of strings
(``choice``, ``guided_choice``), each turned into a GBNF grammar.

A pattern is translated by ``prompts/schema_regex.py`` (the same translator as a JSON schema's
``pattern``, here over the text itself rather than its JSON encoding), under the schema
converter's step budget, so its work is linear in the pattern and no pattern can make it loop;
what the grammar cannot express (backreferences, lookaround, inner anchors) is a ``ValueError``.
The pattern matches the whole output: one not anchored at both ends is anchored around.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llamabatch.prompts.grammar_check import check_grammar, get_grammar_limits
from llamabatch.prompts.schema_grammar import conversion_budget
from llamabatch.prompts.schema_regex import PatternError, check_pattern, gbnf_literal, pattern_to_gbnf

__all__ = ["MAX_CHOICES", "choice_grammar", "regex_grammar"]

#: the strings a ``choice`` may hold
MAX_CHOICES = 1024


def regex_grammar(pattern: str, *, what: str = "regex") -> str:
    """The GBNF grammar of the texts ``pattern`` matches whole (``ValueError`` naming ``what``)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{what} must be a non-empty string (a regular expression), got {pattern!r:.60}")
    limits = get_grammar_limits()
    if len(pattern.encode("utf-8", "surrogatepass")) > limits.max_bytes:
        raise ValueError(
            f"{what}: the pattern is above the limit of {limits.max_bytes} bytes (GrammarLimits.max_bytes)"
        )
    anchored = pattern if pattern.startswith("^") and pattern.endswith("$") else f"^(?:{pattern})$"
    check_pattern(anchored, "the output", what, limits)
    left = conversion_budget(limits)

    def step(n: int) -> None:
        nonlocal left
        left -= n
        if left < 0:
            raise ValueError(
                f"{what}: the pattern's grammar is above the conversion budget (GrammarLimits.max_bytes)"
            )

    try:
        inner = pattern_to_gbnf(anchored, max_nesting=limits.max_nesting, step=step, raw=True)
    except PatternError as exc:
        raise ValueError(f"{what} is not supported: {exc}") from None
    grammar = f"root ::= {inner}\n"
    check_grammar(grammar, what=f"{what} (the grammar made from it)", limits=limits)
    return grammar


def choice_grammar(choices: Iterable[str], *, what: str = "choice") -> str:
    """The GBNF grammar of exactly one of ``choices`` (``ValueError`` naming ``what``)."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise ValueError(f"{what} must be a list of strings, got {type(choices).__name__}")
    if not 0 < len(choices) <= MAX_CHOICES:
        raise ValueError(f"{what} must hold 1 to {MAX_CHOICES} strings, got {len(choices)}")
    for i, text in enumerate(choices):
        if not isinstance(text, str) or not text:
            raise ValueError(f"{what}[{i}] must be a non-empty string, got {text!r:.60}")
    grammar = "root ::= " + " | ".join(gbnf_literal(text) for text in dict.fromkeys(choices)) + "\n"
    check_grammar(grammar, what=f"{what} (the grammar made from it)")
    return grammar
