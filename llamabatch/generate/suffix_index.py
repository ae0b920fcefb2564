"""Longest matches over token histories, for drafting: an incremental suffix automaton.

``SuffixAutomaton`` holds every substring of a token sequence that grows one token at a time
(amortised O(1) per token, at most ``2n`` states). Two questions are answered in O(1):

* :meth:`SuffixAutomaton.repeat`: the longest suffix of the sequence that also ended
  earlier, and where its first occurrence ends (a request's own history: prompt + output,
  with no limit on the suffix length);
* :meth:`SuffixAutomaton.step`: a *matcher* ``(state, length)`` follows another sequence
  token by token; ``length`` is then the longest suffix of that sequence that occurs in this
  one, and :meth:`SuffixAutomaton.end_of` where its first occurrence ends. A matcher stays
  valid while the automaton grows (a state split by a later token is re-normalised on the
  next step), but text added later can hold a longer suffix than it sees: ``SharedHistory``
  walks a matcher again over the last ``RESYNC`` tokens after documents were added.

``SharedHistory`` keeps the prompts and outputs of recent requests in two such automata
(documents apart, joined by separator tokens that match nothing), bounded by a token count:
when the young one holds half the budget, the old one is dropped and the young one becomes
old. A document drafted from in the old one is copied into the young one, so what is used
stays (an LRU by generations). Memory is counted in :meth:`SharedHistory.nbytes`.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["SharedHistory", "SharedMatch", "SuffixAutomaton"]

#: no transition (a token id never is: separators are negative but above this)
_NONE = -(1 << 62)


class SuffixAutomaton:
    """The suffix automaton of a token sequence, built online (see the module docstring).

    States are numbered; state 0 is the root (the empty string). For each state, in flat
    arrays (8 bytes each, no Python object per state): the length of its longest string, its
    suffix link, the end index of its strings' first occurrence and its first transition
    (token, state); a state with more transitions keeps them in a dict (``_more``). Most
    states have one: a dict each would cost 200 bytes."""

    __slots__ = ("_last", "_len", "_link", "_more", "_pos", "_to1", "_tok1", "text")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        #: the sequence (read-only for callers)
        self.text: list[int] = []
        self._len = array("q", [0])
        self._link = array("q", [-1])
        self._pos = array("q", [-1])
        self._tok1 = array("q", [_NONE])
        self._to1 = array("q", [0])
        self._more: dict[int, dict[int, int]] = {}
        self._last = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.text)

    @property
    def n_states(self) -> int:
        return len(self._len)

    def nbytes(self) -> int:
        """Approximate bytes held: the arrays, the text (its int objects) and the branching
        states' dicts (within about a quarter of tracemalloc's count on CPython 3.11+)."""
        n_more = sum(len(d) for d in self._more.values())
        return 40 * len(self._len) + 36 * len(self.text) + 80 * n_more + 180 * len(self._more)

    def _get(self, state: int, token: int) -> int:
        """The transition of ``state`` by ``token`` (-1: none)."""
        if self._tok1[state] == token:
            return self._to1[state]
        more = self._more.get(state)
        if more is None:
            return -1
        return more.get(token, -1)

    def _set(self, state: int, token: int, target: int) -> None:
        tok1 = self._tok1
        if tok1[state] == token or tok1[state] == _NONE:
            tok1[state] = token
            self._to1[state] = target
            return
        more = self._more.get(state)
        if more is None:
            more = self._more[state] = {}
        more[token] = target

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        """Add one token at the end (amortised O(1))."""
        lens, link, pos = self._len, self._link, self._pos
        get, put = self._get, self._set
        i = len(self.text)
        self.text.append(token)
        last = self._last
        cur = len(lens)
        lens.append(lens[last] + 1)
        link.append(0)
        pos.append(i)
        self._tok1.append(_NONE)
        self._to1.append(0)
        p = last
        q = -1
        while p != -1:
            q = get(p, token)
            if q != -1:
                break
            put(p, token, cur)
            p = link[p]
        if p != -1:
            if lens[p] + 1 == lens[q]:
                link[cur] = q
            else:  # q's strings split: the shorter ones move to a clone
                clone = len(lens)
                lens.append(lens[p] + 1)
                link.append(link[q])
                pos.append(pos[q])
                self._tok1.append(self._tok1[q])
                self._to1.append(self._to1[q])
                more = self._more.get(q)
                if more is not None:
                    self._more[clone] = dict(more)
                while p != -1 and get(p, token) == q:
                    put(p, token, clone)
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur

    def repeat(self) -> tuple[int, int]:
        """``(length, end)``: the longest suffix of the sequence that also ends earlier, and
        the index of the last token of its first occurrence; ``(0, -1)`` when none."""
        s = self._link[self._last]
        if s <= 0:
            return 0, -1
        return self._len[s], self._pos[s]

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        """A matcher after one more token of the sequence it follows (start: ``(0, 0)``)."""
        lens, link, get = self._len, self._link, self._get
        # states split since the matcher's last step: its string may now be in a clone
        while state and length <= lens[link[state]]:
            state = link[state]
        while True:
            t = get(state, token)
            if t != -1:
                return t, length + 1
            if not state:
                return 0, 0
            state = link[state]
            length = lens[state]

    def end_of(self, state: int, length: int) -> int:
        """The end index of the first occurrence of a matcher's string (``length`` > 0)."""
        lens, link = self._len, self._link
        while state and length <= lens[link[state]]:
            state = link[state]
        return self._pos[state]


@dataclass
class _Generation:
    sam: SuffixAutomaton = field(default_factory=SuffixAutomaton)
    #: each document's first index in ``sam.text`` (its separator follows its last token)
    starts: list[int] = field(default_factory=list)
    #: documents already copied to the young generation (old generation only)
    copied: set[int] = field(default_factory=set)


@dataclass
class _Matcher:
    #: per generation (by id): (state, length, the generation's length when it was synced)
    states: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: tokens of the followed history consumed so far
    synced: int = 0


@dataclass(frozen=True)
class SharedMatch:
    """A match in the shared history: its length and the tokens that followed it."""

    length: int
    tokens: list[int]


class SharedHistory:
    """Recent prompts and outputs of all requests of an engine, bounded by ``max_tokens``
    (see the module docstring). Requests follow it with matchers (``match``), by key."""

    #: how many of a history's last tokens a matcher walks when a generation is new to it or
    #: got documents since its last step (a longer match than this is rarely more telling)
    RESYNC = 64

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 2:
            raise ValueError(f"SharedHistory needs max_tokens >= 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self._gens: list[_Generation] = [_Generation()]  # [young] or [young, old]
        self._ids: list[int] = [0]
        self._next_id = 1
        self._sep = -1  # the next separator token (negative: never a real token)
        self._matchers: dict[Hashable, _Matcher] = {}
        self.documents = 0
        self.rotations = 0

    @property
    def n_tokens(self) -> int:
        """Tokens held, separators included."""
        return sum(len(g.sam) for g in self._gens)

    def nbytes(self) -> int:
        """Approximate bytes held (both generations and the matchers)."""
        return sum(g.sam.nbytes() + 8 * len(g.starts) for g in self._gens) + 200 * len(self._matchers)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one document (a request's prompt and output); only its last
        ``max_tokens // 2`` tokens are kept."""
        tokens = list(tokens[-(self.max_tokens // 2) :])
        if not tokens:
            return
        young = self._gens[0]
        if len(young.sam) + len(tokens) + 1 > self.max_tokens // 2 and len(young.sam):
            self._rotate()
            young = self._gens[0]
        young.starts.append(len(young.sam))
        young.sam.extend(tokens)
        young.sam.append(self._sep)
        self._sep -= 1
        self.documents += 1

    def _rotate(self) -> None:
        self._gens = [_Generation(), self._gens[0]]
        self._ids = [self._next_id, self._ids[0]]
        self._next_id += 1
        self.rotations += 1
        alive = set(self._ids)
        for m in self._matchers.values():
            m.states = {g: s for g, s in m.states.items() if g in alive}

    def match(self, key: Hashable, history: Sequence[int], k: int) -> SharedMatch | None:
        """The longest suffix of ``history`` (a request's prompt + output, which only grows)
        found in the shared history, and the (up to ``k``) tokens that followed it there,
        within its document; None when nothing matches."""
        m = self._matchers.get(key)
        n = len(history)
        if m is None or n < m.synced:
            m = self._matchers[key] = _Matcher()
        best: tuple[int, int, int] | None = None  # (length, generation index, end)
        for gi, (gen, gid) in enumerate(zip(self._gens, self._ids, strict=True)):
            sam = gen.sam
            st = m.states.get(gid)
            if st is None or st[2] != len(sam):  # new to it, or documents came since
                state, length, start = 0, 0, max(0, n - self.RESYNC)
            else:
                state, length, start = st[0], st[1], m.synced
            for i in range(start, n):
                state, length = sam.step(state, length, history[i])
            m.states[gid] = (state, length, len(sam))
            if length and (best is None or length > best[0]):
                best = (length, gi, sam.end_of(state, length))
        m.synced = n
        if best is None:
            return None
        length, gi, end = best
        gen = self._gens[gi]
        text = gen.sam.text
        tokens = text[end + 1 : end + 1 + k]
        for i, t in enumerate(tokens):
            if t < 0:  # the document's end
                del tokens[i:]
                break
        if gi == 1 and tokens:  # used from the old generation: it stays
            doc = bisect.bisect_right(gen.starts, end) - 1
            if doc not in gen.copied:
                gen.copied.add(doc)
                stop = gen.starts[doc + 1] - 1 if doc + 1 < len(gen.starts) else len(text) - 1
                self.add(text[gen.starts[doc] : stop])
        return SharedMatch(length, tokens)

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s matcher."""
        self._matchers.pop(key, None)
