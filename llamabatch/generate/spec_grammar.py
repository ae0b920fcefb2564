"""Drafts a grammar forces: where a request's grammar allows one way on, its text is drafted.

A JSON schema's keys, a fixed tool call's name, the literal parts of a GBNF grammar: after a
key's opening quote, ``"occupation"`` allows nothing but ``occupation"``. Each parse stack of
the request's grammar must then match the same single character; ``SamplerChain.forced_text``
walks them character by character (the C helper in ``_ffi/_build.py``) and puts them back.
The text is tokenized, and its tokens are drafted beside the n-gram and suffix methods'
lookups (``speculative_config``, ``grammar_drafts``, on by default), in a draft class of their
own (``GRAMMAR_CLASS``) whose acceptance the speculator estimates apart.

Not accepted by construction: the model picks its own tokenization of the forced text, which
may differ from the tokenizer's (``name"`` drafts ``name``, ``"``, where the model writes
``name``, ``":``, its next token running past the forced text). So the last token of a forced
text is left out unless the grammar ends there, and in its place the draft takes the token
the model wrote the last time that token was left out (its habit: ``":`` after ``age``, once
it wrote ``":`` after ``name``). Every draft is verified as any other: outputs are those of a
run without speculation. On a tokenizer that puts a space before a text's first word
(SentencePiece with a dummy prefix), the first token is wrong, and the class's acceptance
falls until it no longer drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from llamabatch.generate.draft_model import Draft

if TYPE_CHECKING:
    from llamabatch.generate.request import Request

__all__ = ["FORCED_BYTES", "GRAMMAR_CLASS", "GRAMMAR_PRIOR", "GrammarDrafts"]

#: the draft class of forced text (``AcceptanceModel``; apart from the lookups' classes)
GRAMMAR_CLASS = 128
#: its acceptance rate before any of its drafts was verified: forced text is what the model
#: writes unless it tokenizes it otherwise
GRAMMAR_PRIOR = 0.9
#: the most habits kept per request (distinct tokens left out of forced texts)
MAX_HABITS = 64
#: the most bytes of forced text looked at per draft (a walk over the grammar's parse stacks
#: per byte; more than the longest draft needs)
FORCED_BYTES = 256


class GrammarDrafts:
    """The forced-text drafts of grammar requests (module docstring). ``tokenize``: bytes to
    token ids, without special tokens (the model's); ``forced``: a request's forced text and
    whether its grammar can only end after it (default: its sampler chain's
    ``forced_text``); ``applies``: whether a request can have forced text (default: it has a
    grammar and its sampler chain)."""

    def __init__(
        self,
        tokenize: Callable[[bytes], list[int]],
        forced: Callable[[Request], tuple[bytes, bool]] | None = None,
        applies: Callable[[Request], bool] | None = None,
    ) -> None:
        self.tokenize = tokenize
        self._forced = forced or _chain_forced_text
        self.applies = applies or _has_grammar
        #: drafts taken from forced text, their tokens, and those accepted
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        #: per request: the token the model wrote where a forced text's last token was left
        #: out, by that token (its habit: ``name"`` left ``"`` out, and the model wrote ``":``)
        self._habits: dict[Hashable, dict[int, int]] = {}
        #: per request, its current draft: the forced tokens drafted and the one left out
        self._open: dict[Hashable, tuple[list[int], int]] = {}

    def draft(self, request: Request, k: int) -> list[int]:
        """At most ``k`` tokens the request's grammar forces after its pending token, then
        the token the model wrote last time in place of the one left out (if known)."""
        self._open.pop(request.arrival, None)
        text, ends = self._forced(request)
        if not text or k <= 0:
            return []
        tokens = self.tokenize(text)
        if ends or not tokens:
            return tokens[:k]
        left_out = tokens.pop()  # the model's next token may run past the forced text
        self._open[request.arrival] = (tokens, left_out)
        habit = self._habits.get(request.arrival, {}).get(left_out)
        return ([*tokens, habit] if habit is not None else tokens)[:k]

    def merge(self, requests: list[Request], caps: list[int], drafts: dict[Hashable, Draft]) -> set[Hashable]:
        """Put forced-text drafts in ``drafts`` (keyed by ``request.arrival``) where they are
        better than the lookup's: where it has none, or one that does not go on past them
        with the same tokens. Returns the keys whose draft is now forced text."""
        forced: set[Hashable] = set()
        for request, cap in zip(requests, caps, strict=True):
            tokens = self.draft(request, cap) if self.applies(request) else []
            if not tokens:
                continue
            key = request.arrival
            lookup = drafts.get(key)
            n = len(tokens)
            if lookup is not None and len(lookup.tokens) > n and list(lookup.tokens[:n]) == tokens:
                self._open.pop(key, None)
                continue  # the lookup goes on past the forced text, the same tokens first
            drafts[key] = Draft(tokens, "match")
            forced.add(key)
        return forced

    def verified(self, key: Hashable, drafted: int, accepted: int, emitted: list[int]) -> None:
        """The forced-text draft of request ``key`` (``drafted`` tokens) was verified,
        ``accepted`` of them kept; ``emitted``: the tokens the tick emitted for it. Where
        every forced token held, the one after them is the model's habit there."""
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        forced, left_out = self._open.pop(key, ([], -1))
        n = len(forced)
        if n and len(emitted) > n and emitted[:n] == forced:
            habits = self._habits.setdefault(key, {})
            if left_out in habits or len(habits) < MAX_HABITS:
                habits[left_out] = emitted[n]

    def release(self, key: Hashable) -> None:
        """Request ``key`` ended: forget its habits."""
        self._habits.pop(key, None)
        self._open.pop(key, None)


def _has_grammar(request: Request) -> bool:
    return request.sampler is not None and request.params.effective_grammar is not None


def _chain_forced_text(request: Request) -> tuple[bytes, bool]:
    sampler = request.sampler  # (a chain without a grammar forces nothing: ``forced_text``)
    return sampler.forced_text(FORCED_BYTES) if sampler is not None else (b"", False)
