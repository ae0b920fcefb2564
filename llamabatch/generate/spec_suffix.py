"""Drafts from the longest match: a request's own history, then recent requests' (``suffix``).

``SuffixDrafter`` is the ``Drafter`` of ``speculative_config={"method": "ngram"}`` (own
history only) and ``{"method": "suffix"}`` (with a ``SharedHistory``). For each request it
keeps a :class:`~llamabatch.generate.suffix_index.SuffixAutomaton` of its prompt + output,
extended by the tokens added since its last draft (amortised O(1) per token). The draft is
what followed the first earlier occurrence of the history's longest repeated suffix, with no
limit on that suffix's length; where it reaches the end of the history it goes on as the
history would if it repeated (a loop of period p drafts k tokens, not p).

With a shared history, the request's longest suffix found in the prompts and outputs of
recent requests is looked up too (its matcher advances with each token), and the longer of
the two matches drafts (the request's own on a tie): a request asked a second time drafts the
first answer from its first token. A request's prompt and output join the shared history
when it ends (:meth:`SuffixDrafter.remember`). Drafts never change outputs: every token is
still sampled from the target's logits and the drafts are only checked against it.

``last_match`` holds each request's draft class for the speculator's acceptance estimates:
the matched length in buckets (a long match is right more often), shared drafts apart.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from llamabatch.generate.draft_model import Draft, DraftJob
from llamabatch.generate.suffix_index import SharedHistory, SuffixAutomaton

if TYPE_CHECKING:
    import numpy as np

    from llamabatch.params import SamplingParams

__all__ = ["CLASS_PRIORS", "SHARED_CLASS", "SuffixDrafter", "match_class"]

#: added to a shared draft's class (its acceptance is estimated apart from own drafts)
SHARED_CLASS = 64

#: each class's acceptance rate before any of its drafts was verified: a longer match goes on
#: more often. A prior that makes long drafts look worth trying on a CPU (where one stream's
#: second token costs as much as its first) is what lets them be tried at all; where they
#: fail, a few rejections pull the class's rate down
CLASS_PRIORS = {1: 0.3, 2: 0.5, 3: 0.6, 4: 0.7, 5: 0.8, 8: 0.9}


def match_class(length: int) -> int:
    """A matched length's draft class: 1..4 as they are, 5 (5-7) and 8 (8 or longer). Few
    classes: each gathers its own evidence, and a copy whose match grows past 8 tokens keeps
    its class (and what its drafts taught) as it goes on."""
    if length <= 4:
        return length
    return 5 if length < 8 else 8


class SuffixDrafter:
    """Longest-match drafts (see the module docstring). ``min_match``: the shortest matched
    suffix that drafts; ``shared``: the history shared across requests (None: own only)."""

    #: the most tokens of a request's history added to its automaton per draft call (about
    #: 3 ms of Python): a long prompt is caught up over a few ticks, not in one long tick
    CATCH_UP = 1024

    def __init__(self, min_match: int = 2, shared: SharedHistory | None = None) -> None:
        self.min_match = min_match
        self.shared = shared
        self._own: dict[Hashable, SuffixAutomaton] = {}
        #: each request's last draft class (see ``match_class``; shared drafts + SHARED_CLASS)
        self.last_match: dict[Hashable, int] = {}
        #: the acceptance priors by draft class (``AcceptanceModel``)
        self.class_priors = {**CLASS_PRIORS, **{SHARED_CLASS + c: p for c, p in CLASS_PRIORS.items()}}
        #: drafts made from the request's own history and from the shared one
        self.own_drafts = 0
        self.shared_drafts = 0

    def _sync(self, job: DraftJob) -> SuffixAutomaton | None:
        """The request's automaton, extended by the tokens added since its last call; None
        while a long history is still being caught up (``CATCH_UP`` tokens per call)."""
        sam = self._own.get(job.key)
        prompt, output = job.prompt, job.output
        n_prompt = len(prompt)
        n = n_prompt + len(output)
        if sam is None or len(sam) > n:
            sam = self._own[job.key] = SuffixAutomaton()
        have = len(sam)
        stop = min(n, have + self.CATCH_UP)
        if have < n_prompt:
            sam.extend(prompt[have : min(stop, n_prompt)])
            have = len(sam)
        if have < stop:
            sam.extend(output[have - n_prompt : stop - n_prompt])
        return sam if len(sam) == n else None

    def draft(self, jobs: Sequence[DraftJob]) -> dict[Hashable, Draft]:
        out: dict[Hashable, Draft] = {}
        lo = self.min_match
        for job in jobs:
            sam = self._sync(job)
            if sam is None:
                continue
            k = job.k
            length, end = sam.repeat()
            tokens: list[int] = []
            if length >= lo:
                text = sam.text
                n = len(text)
                tokens = text[end + 1 : min(end + 1 + k, n)]
                period = n - 1 - end
                while len(tokens) < k:  # past the history's end: it repeats itself
                    tokens.append(tokens[len(tokens) - period])
            cls = match_class(length)
            if self.shared is not None:
                m = self.shared.match(job.key, sam.text, k)
                if m is not None and m.length >= lo and m.tokens and (not tokens or m.length > length):
                    tokens, cls = m.tokens, SHARED_CLASS + match_class(m.length)
            if tokens:
                out[job.key] = Draft(tokens, "match")
                self.last_match[job.key] = cls
                if cls >= SHARED_CLASS:
                    self.shared_drafts += 1
                else:
                    self.own_drafts += 1
        return out

    def remember(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A request ended: its prompt and output join the shared history (if any)."""
        if self.shared is not None and output:
            self.shared.add([*prompt, *output])

    def verify(
        self, key: Hashable, draft: Draft, logits_rows: np.ndarray, params: SamplingParams
    ) -> tuple[int, int]:
        raise NotImplementedError("suffix drafts use the match rule")

    def release(self, key: Hashable, *, done: bool = True) -> None:
        if done:  # (preempted: its history comes back as it was, and only grows)
            self._own.pop(key, None)
            self.last_match.pop(key, None)
            if self.shared is not None:
                self.shared.forget(key)

    def close(self) -> None:
        self._own.clear()
        self.last_match.clear()

    def memory(self) -> tuple[int, int]:
        """``(tokens, bytes)`` held: the shared history's and the running requests' own."""
        tokens = sum(len(s) for s in self._own.values())
        nbytes = sum(s.nbytes() for s in self._own.values())
        if self.shared is not None:
            tokens += self.shared.n_tokens
            nbytes += self.shared.nbytes()
        return tokens, nbytes
