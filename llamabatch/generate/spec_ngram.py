"""Bounded prompt-lookup drafts (``speculative_config`` ``{"method": "ngram",
"prompt_lookup_max": N}``): the n-grams of each request's own history, indexed
incrementally. Without ``prompt_lookup_max`` the longest match over the whole history is
``spec_suffix.SuffixDrafter``'s; both implement ``speculative.Drafter``."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from llamabatch.generate.draft_model import Draft, DraftJob

if TYPE_CHECKING:
    import numpy as np

    from llamabatch.params import SamplingParams

__all__ = ["NgramDrafter"]


class _NgramIndex:
    """The n-grams of one request's history, by length: n-gram -> the position after its
    latest occurrence. Extended incrementally with the tokens added since the last lookup."""

    __slots__ = ("indexed", "maps")

    def __init__(self, lo: int, hi: int) -> None:
        self.indexed = 0  # n-grams ending before this position are in the maps
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}

    def lookup(self, hist: Sequence[int], k: int) -> tuple[list[int], int]:
        """The draft (up to ``k`` tokens) and the length of the suffix it matched (0: none)."""
        end = len(hist)
        maps = self.maps
        # index every n-gram that ends before the last position (its continuation is known)
        for e in range(max(self.indexed, 1), end):
            for n, m in maps.items():
                if e >= n:
                    m[tuple(hist[e - n : e])] = e
        self.indexed = max(self.indexed, end)
        for n in sorted(maps, reverse=True):  # longest suffix first
            if end < n:
                continue
            found = maps[n].get(tuple(hist[end - n : end]))
            if found is not None:
                tokens = list(hist[found : min(found + k, end)])
                while len(tokens) < k:  # the continuation reaches the end: it repeats itself
                    tokens.append(tokens[found + len(tokens) - end])
                return tokens, n
        return [], 0


class NgramDrafter:
    """Bounded prompt-lookup drafts (``prompt_lookup_max`` given): the longest suffix n-gram
    (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) of the request's prompt +
    output is looked up in that history, and the k tokens that followed its latest earlier
    occurrence are the draft (rule ``"match"``); where they reach the end of the history they
    go on as the history would if it repeated (a loop of period p < k drafts k tokens, not p). The index per
    request grows with the history, never rescanned."""

    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._index: dict[Hashable, _NgramIndex] = {}
        #: the length of the suffix each request's last draft matched (its draft class for the
        #: speculator's acceptance estimates: a long match is right more often)
        self.last_match: dict[Hashable, int] = {}

    def draft(self, jobs: Sequence[DraftJob]) -> dict[Hashable, Draft]:
        out: dict[Hashable, Draft] = {}
        for job in jobs:
            index = self._index.get(job.key)
            if index is None:
                index = self._index[job.key] = _NgramIndex(self.lo, self.hi)
            hist = _History(job.prompt, job.output)
            tokens, n = index.lookup(hist, job.k)
            if tokens:
                out[job.key] = Draft(tokens, "match")
                self.last_match[job.key] = n
        return out

    def verify(
        self, key: Hashable, draft: Draft, logits_rows: np.ndarray, params: SamplingParams
    ) -> tuple[int, int]:
        raise NotImplementedError("n-gram drafts use the match rule")

    def release(self, key: Hashable, *, done: bool = True) -> None:
        if done:
            self._index.pop(key, None)
            self.last_match.pop(key, None)

    def close(self) -> None:
        self._index.clear()
        self.last_match.clear()


class _History(Sequence[int]):
    """prompt + output as one read-only sequence (no copy of a long prompt per tick)."""

    __slots__ = ("a", "b", "na")

    def __init__(self, a: Sequence[int], b: Sequence[int]) -> None:
        self.a, self.b, self.na = a, b, len(a)

    def __len__(self) -> int:
        return self.na + len(self.b)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, _ = i.indices(len(self))
            na = self.na
            if stop <= na:
                return list(self.a[start:stop])
            if start >= na:
                return list(self.b[start - na : stop - na])
            return list(self.a[start:]) + list(self.b[: stop - na])
        return self.a[i] if i < self.na else self.b[i - self.na]
