"""The host-RAM prompt cache: a tier below the KV cache (``LLM(cache_ram=MiB)``).

When an idle slot's cached tokens are about to leave the KV cache (evicted under KV
pressure, or its slot taken by another request), ``KVCache`` saves that sequence's state
(``llama_state_seq_get_data``: its cells with their positions) here, with its tokens. When a
new prompt shares a longer prefix with a saved state than with anything in the KV cache,
``KVCache.place`` loads the state into the request's slot (``llama_state_seq_set_data``),
trims it to the shared prefix, and records those cells in the slot table as the request's
prefix, exactly as after a prefill. The slot table stays the one record of what the KV
cache holds; this module only holds bytes and tokens in host memory, up to ``budget_bytes``,
least recently used first out.

Lookup: entries are indexed by the LoRA adapter set their KV was computed under (``tag``,
``()`` for the base model; ``KVCache.tags``) and their first ``BLOCK`` tokens (a dict), and
among those the longest common prefix is found with numpy; only prefixes of at least
``BLOCK`` tokens are saved or restored (a shorter one is cheaper to compute than to copy).
A state is restored only for a request of its own adapter set, as prefix reuse is.

Sharing: each entry has an ``owner``, the client whose request computed it (``client=`` of
``LLM.submit`` and the like; the server's peer address; None for the caller and for prefix
files). While over budget, the owner holding the most bytes gives up its least recently used
entry first, so one client saving a flood of distinct sequences recycles its own share and
cannot push other clients' conversations out. With one owner (an app that names no clients)
this is plain LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: tokens indexing an entry, and the shortest prefix saved or restored
BLOCK = 32

#: why a saved state that matched best was not loaded (``RamCacheStats.restore_skipped``):
#: running requests (and prompts admitted but not computed yet) hold the cells it needs
SKIP_ROOM_HELD_BY_RUNNING = "room_held_by_running"
#: the state left the RAM tier while room was made for it (its budget too small for both)
SKIP_STATE_DROPPED = "state_dropped"


@dataclass(frozen=True)
class RamCacheStats:
    """Totals of the host-RAM prompt cache (``GenerationStats.ram_cache``)."""

    #: the budget in bytes (0: the cache is off)
    budget_bytes: int = 0
    #: bytes and entries held now
    bytes: int = 0
    entries: int = 0
    #: lookups that found a saved prefix longer than the KV cache's (``hits``) or not
    hits: int = 0
    misses: int = 0
    #: states saved, states loaded back into the KV cache, entries dropped for room
    saves: int = 0
    restores: int = 0
    evictions: int = 0
    #: states llama.cpp refused to load
    restore_failures: int = 0
    #: prompt tokens restored instead of computed
    restored_tokens: int = 0
    #: of those, tokens then taken from cells another sequence holds (a shared system
    #: prompt) instead of the restored copy (unified KV cache)
    shared_tokens: int = 0
    #: hits not loaded, by reason (``SKIP_*``): their prompts were computed instead
    restore_skipped: dict[str, int] = field(default_factory=dict)
    #: prompts that waited for running requests to free a restore's room
    #: (``KVCache.restore_worth_waiting``)
    restore_waits: int = 0
    #: clients holding states now (``RamEntry.owner``; the caller counts as one), and the
    #: bytes the biggest holds: the first to give up its oldest state when over budget
    clients: int = 0
    largest_client_bytes: int = 0


class RamEntry:
    """One saved sequence: its tokens (positions ``0..n-1``), llama.cpp's state bytes, the
    adapter set (``tag``) its KV was computed under and the client it is kept for (``owner``)."""

    __slots__ = ("data", "failures", "key", "owner", "source", "tag", "tokens")

    def __init__(
        self,
        tokens: np.ndarray,
        data: bytes | bytearray,
        block: int = BLOCK,
        source: Path | None = None,
        tag: Hashable = (),
        owner: Hashable = None,
    ) -> None:
        self.tokens = tokens
        self.data = data
        self.tag = tag
        #: the client whose request computed it (see the module doc: sharing)
        self.owner = owner
        self.key: tuple[Hashable, bytes] = (tag, tokens[:block].tobytes())
        #: loads llama.cpp refused (no contiguous room, or bad bytes: dropped at the second)
        self.failures = 0
        #: where the bytes came from when not from this engine's KV cache (a prefix file),
        #: until llama.cpp has taken them once
        self.source = source


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class RamCache:
    """Saved sequence states in host memory, LRU, up to ``budget_bytes`` (see the module doc)."""

    def __init__(self, budget_bytes: int, block: int = BLOCK) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.budget_bytes = budget_bytes
        #: tokens indexing an entry, and the shortest prefix saved or restored
        self.block = block
        self._lru: OrderedDict[int, RamEntry] = OrderedDict()  # id(entry) -> entry, oldest first
        self._by_key: dict[tuple[Hashable, bytes], list[RamEntry]] = {}
        #: each owner's entries (LRU, as ``_lru``) and bytes
        self._by_owner: dict[Hashable, OrderedDict[int, RamEntry]] = {}
        self._owner_bytes: dict[Hashable, int] = {}
        self.bytes = 0
        self.hits = self.misses = self.saves = self.restores = self.evictions = 0
        self.restore_failures = self.restored_tokens = self.shared_tokens = 0
        self.restore_skipped: dict[str, int] = {}
        self.restore_waits = 0

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self) -> list[RamEntry]:
        """The entries, least recently used first."""
        return list(self._lru.values())

    def covers(self, tokens: np.ndarray, tag: Hashable = ()) -> RamEntry | None:
        """An entry of ``tag`` whose tokens start with all of ``tokens`` (saving them again is
        useless)."""
        for entry in self._by_key.get((tag, tokens[: self.block].tobytes()), ()):
            if len(entry.tokens) >= len(tokens) and common_prefix(entry.tokens, tokens) == len(tokens):
                return entry
        return None

    def save(
        self,
        tokens: np.ndarray,
        data: bytes | bytearray,
        source: Path | None = None,
        tag: Hashable = (),
        owner: Hashable = None,
    ) -> bool:
        """Keep ``data``, the state of a sequence holding ``tokens`` computed under the adapter
        set ``tag`` for the client ``owner`` (read from ``source``, when not from the KV cache:
        ``RamEntry.source``); entries of ``tag`` that are prefixes of it are dropped, and
        while over budget the biggest owner's oldest entries leave (``_victim``). False when
        it is too short, empty, or bigger than the whole budget."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if len(tokens) < self.block or not data or len(data) > self.budget_bytes:
            return False
        covering = self.covers(tokens, tag)
        if covering is not None:
            self.touch(covering)
            return False
        entry = RamEntry(tokens.copy(), data, self.block, source, tag, owner)
        counted = owner in self._by_owner  # a client holding entries counts with what it brings
        for old in list(self._by_key.get(entry.key, ())):
            if len(old.tokens) <= len(tokens) and common_prefix(old.tokens, tokens) == len(old.tokens):
                self._remove(old)
        while self.bytes + len(data) > self.budget_bytes and self._lru:
            victim = self._victim(owner, len(data), counted)
            if victim is None:  # the saver would hold the most, and has nothing left to give up
                return False
            self._remove(victim)
            self.evictions += 1
        self._lru[id(entry)] = entry
        self._by_key.setdefault(entry.key, []).append(entry)
        self._by_owner.setdefault(owner, OrderedDict())[id(entry)] = entry
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + len(data)
        self.bytes += len(data)
        self.saves += 1
        return True

    def _victim(self, owner: Hashable, incoming: int, counted: bool) -> RamEntry | None:
        """The entry to drop for ``incoming`` bytes of ``owner``: the least recently used of the
        owner holding the most bytes (``owner``'s counted with ``incoming`` when ``counted``: it
        held entries when its save began, even if it has given them all up since). None when
        that is ``owner`` with nothing left: its save does not push out a smaller holder. A
        scan of the owners: 0.7 ms a save at 10,000 of them, once per request that leaves a slot."""
        held = self._owner_bytes
        owners = [*self._by_owner, owner] if counted and owner not in self._by_owner else self._by_owner
        biggest = max(owners, key=lambda o: held.get(o, 0) + (incoming if o == owner and counted else 0))
        entries = self._by_owner.get(biggest)
        return next(iter(entries.values())) if entries else None

    def match(self, tokens: np.ndarray, tag: Hashable = ()) -> tuple[RamEntry | None, int]:
        """The entry of ``tag`` sharing the longest prefix with ``tokens``, and its length
        (>= ``block``), or ``(None, 0)``."""
        tokens = np.asarray(tokens, dtype=np.int32)
        best, best_n = None, 0
        if len(tokens) >= self.block:
            for entry in self._by_key.get((tag, tokens[: self.block].tobytes()), ()):
                n = common_prefix(entry.tokens, tokens)
                if n > best_n:
                    best, best_n = entry, n
        return best, best_n

    def holds(self, entry: RamEntry) -> bool:
        """Whether ``entry`` is still held (not dropped or replaced)."""
        return id(entry) in self._lru and self._lru[id(entry)] is entry

    def touch(self, entry: RamEntry) -> None:
        self._lru.move_to_end(id(entry))
        self._by_owner[entry.owner].move_to_end(id(entry))

    def discard(self, entry: RamEntry) -> None:
        """Drop ``entry`` (its state could not be loaded)."""
        if id(entry) in self._lru:
            self._remove(entry)

    def skip(self, reason: str) -> None:
        """Count a hit that was not loaded, and why (``SKIP_*``)."""
        self.restore_skipped[reason] = self.restore_skipped.get(reason, 0) + 1

    def clear(self) -> None:
        for entry in list(self._lru.values()):
            self._remove(entry)

    def _remove(self, entry: RamEntry) -> None:
        del self._lru[id(entry)]
        group = self._by_key[entry.key]
        group.remove(entry)
        if not group:
            del self._by_key[entry.key]
        owned = self._by_owner[entry.owner]
        del owned[id(entry)]
        self._owner_bytes[entry.owner] -= len(entry.data)
        if not owned:
            del self._by_owner[entry.owner], self._owner_bytes[entry.owner]
        self.bytes -= len(entry.data)

    def stats(self) -> RamCacheStats:
        return RamCacheStats(
            budget_bytes=self.budget_bytes,
            bytes=self.bytes,
            entries=len(self._lru),
            hits=self.hits,
            misses=self.misses,
            saves=self.saves,
            restores=self.restores,
            evictions=self.evictions,
            restore_failures=self.restore_failures,
            restored_tokens=self.restored_tokens,
            shared_tokens=self.shared_tokens,
            restore_skipped=dict(self.restore_skipped),
            restore_waits=self.restore_waits,
            clients=len(self._by_owner),
            largest_client_bytes=max(self._owner_bytes.values(), default=0),
        )

    def check(self) -> None:
        """``AssertionError`` unless the byte count, the index and the budget agree."""
        assert self.bytes == sum(len(e.data) for e in self._lru.values()), "byte count"
        assert self.bytes <= self.budget_bytes, "over budget"
        indexed = sorted(id(e) for group in self._by_key.values() for e in group)
        assert indexed == sorted(self._lru), "index and LRU differ"
        owned = sorted(i for group in self._by_owner.values() for i in group)
        assert owned == sorted(self._lru), "owners and LRU differ"
        for owner, group in self._by_owner.items():
            assert group and all(e.owner == owner for e in group.values()), "owner index"
            assert self._owner_bytes[owner] == sum(len(e.data) for e in group.values()), "owner bytes"
            order = [i for i in self._lru if i in group]
            assert order == list(group), "owner LRU order"


def physical_memory_bytes() -> int | None:
    """The machine's physical memory, or None when unknown."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def ram_cache_for(cache_ram_mib: int | None) -> RamCache | None:
    """The RAM tier of ``EngineConfig.cache_ram`` (MiB), capped at a quarter of the physical
    memory; None when off."""
    if not cache_ram_mib:
        return None
    budget = cache_ram_mib * 1024 * 1024
    physical = physical_memory_bytes()
    if physical:
        budget = min(budget, physical // 4)
    return RamCache(budget)
