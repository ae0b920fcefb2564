"""Prefix reuse across slots: copy a shared prompt prefix's KV with ``llama_memory_seq_cp``.

With a unified KV cache a copy shares cells instead of duplicating them, and partial copies
([0, n) of a sequence) are possible. With one KV stream per sequence (``kv_unified=False``)
llama.cpp only copies whole streams (a partial cross-stream copy aborts the process), so
a prefix is copied as the source's whole stream, then the copy's tail is removed
(``_copy_prefix``). Sources of a prefix:

- any slot's sequence, busy or idle: idle slots keep their last tokens in the KV cache
  until their slot is reused or evicted under KV pressure;
- pinned prefixes (``LLM.register_prefix``) held in sequences of their own, past the
  slots' seq_ids, until released.

At admission (``plan``) the new request takes an idle slot: the one whose own cached
tokens match the prompt longest, else the least recently used one; the longest match
from any source is copied in, and only the rest of the prompt is computed (always at
least the last prompt token, so its logits exist). A request whose prompt shares at least
``MIN_WAIT_TOKENS`` not-yet-computed tokens with a prompt being prefilled right now waits
in the queue until they are computed (``should_wait``), so requests arriving together
with a common system prompt compute it once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from llamabatch._core.slots import SlotState, SlotTable
from llamabatch._ffi.context import Context

logger = logging.getLogger("llamabatch")

#: shared prompt tokens still to be computed elsewhere that make a new request wait
MIN_WAIT_TOKENS = 16


@dataclass
class PinnedPrefix:
    """A prefix kept in the KV cache for every request that starts with it."""

    seq_id: int
    tokens: list[int]
    text: str | None = None
    released: bool = False
    array: np.ndarray = field(init=False, repr=False)  # the tokens, for prefix matching

    def __post_init__(self) -> None:
        self.array = np.asarray(self.tokens, dtype=np.int32)


@dataclass(frozen=True)
class Admission:
    """Where a request goes: its slot, and the prefix copied into it."""

    slot: int
    source_seq: int  # -1: nothing copied (or reused in place)
    n_reused: int


class PrefixCache:
    """Bookkeeping of what each sequence holds in the KV cache, and the copies."""

    def __init__(
        self,
        context: Context,
        table: SlotTable,
        n_parallel: int,
        n_pinned_max: int,
        enabled: bool,
        supported: bool,
    ):
        self.context = context
        self.table = table
        self.n_parallel = n_parallel
        #: prefix copies work on this context (no recurrent or hybrid state)
        self.supported = supported
        self.enabled = enabled and supported
        self._whole_streams = not context.kv_unified
        #: the tokens an idle slot's sequence still holds in the KV cache (the table
        #: forgets a slot's history when it goes idle)
        self.cached: list[np.ndarray | None] = [None] * n_parallel
        self._last_used = [0] * n_parallel
        self._clock = 0
        self._free_pin_seqs = list(range(n_parallel + n_pinned_max - 1, n_parallel - 1, -1))
        self.pinned: dict[int, PinnedPrefix] = {}

    # -- admission ----------------------------------------------------------------------

    def _match(self, slot: int, tokens: np.ndarray) -> int:
        if self.table.state(slot) != SlotState.IDLE:
            return self.table.common_prefix(slot, tokens)
        cached = self.cached[slot]
        return 0 if cached is None else _common_prefix(cached, tokens)

    def _best(self, array: np.ndarray) -> tuple[int, int]:
        """The sequence holding the longest prefix of ``array`` in the KV cache now."""
        best_seq, best_n = -1, 0
        for slot in range(self.n_parallel):
            n = self._match(slot, array)
            if n > best_n:
                best_seq, best_n = slot, n
        for prefix in self.pinned.values():
            n = _common_prefix(prefix.array, array)
            if n > best_n:
                best_seq, best_n = prefix.seq_id, n
        return best_seq, best_n

    def plan(self, tokens: list[int], free_slots: list[int], leader_slot: int = -1) -> Admission:
        """Choose the slot for ``tokens`` among ``free_slots`` and the prefix to reuse.

        With reuse off, only a parallel-sampling leader's prompt is shared."""
        limit = len(tokens) - 1  # the last prompt token is always computed
        best_seq, best_n = -1, 0
        if self.enabled:
            best_seq, best_n = self._best(np.asarray(tokens, dtype=np.int32))
        elif self.supported and leader_slot >= 0 and self.table.state(leader_slot) != SlotState.IDLE:
            best_seq, best_n = leader_slot, self.table.common_prefix(leader_slot, tokens)
        best_n = min(best_n, limit)
        if best_n <= 0:
            best_seq, best_n = -1, 0
        if best_seq in free_slots:  # reuse an idle slot's own cache in place
            slot, best_seq = best_seq, -1
        else:
            slot = min(free_slots, key=lambda s: self._last_used[s])
        self._clock += 1
        self._last_used[slot] = self._clock
        return Admission(slot, best_seq, best_n)

    def should_wait(self, tokens: list[int], admitting: list[list[int]]) -> bool:
        """True when a prompt being prefilled (or ``admitting`` in this same tick) shares
        enough not-yet-computed tokens with ``tokens`` that waiting for them beats
        computing them twice."""
        prefilling = [s for s in range(self.n_parallel) if self.table.state(s) == SlotState.PREFILL]
        if not self.enabled or not (prefilling or admitting):
            return False
        array = np.asarray(tokens, dtype=np.int32)
        limit = len(tokens) - 1
        now = self._best(array)[1]
        for slot in prefilling:
            shared = min(_common_prefix(self.table.history(slot), array), limit)
            if shared - max(now, self.table.n_past(slot)) >= MIN_WAIT_TOKENS:
                return True
        for other in admitting:
            shared = min(_common_prefix(np.asarray(other, dtype=np.int32), array), limit)
            if shared - now >= MIN_WAIT_TOKENS:
                return True
        return False

    def apply(self, admission: Admission) -> None:
        """Make the slot's sequence hold exactly the reused prefix (engine thread)."""
        slot, n = admission.slot, admission.n_reused
        if admission.source_seq < 0:
            self.context.seq_rm(slot, n if n else -1, -1)
        else:
            self._copy_prefix(admission.source_seq, slot, n)
        self.cached[slot] = None

    def _copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold positions [0, n) of ``src``."""
        self.context.seq_rm(dst, -1, -1)
        if self._whole_streams:
            self.context.seq_cp(src, dst, -1, -1)  # the whole stream (deferred buffer copy)
            self.context.seq_rm(dst, n, -1)
        else:
            self.context.seq_cp(src, dst, 0, n)  # shared cells, no data copied

    # -- release and eviction ------------------------------------------------------------

    def release_slot(self, slot: int, kept: np.ndarray | None) -> None:
        """A request left ``slot``; ``kept`` are the tokens its KV validly holds (positions
        0..len-1) to keep for reuse, or None to drop them all."""
        if kept is not None and self.enabled and len(kept):
            self.context.seq_rm(slot, len(kept), -1)
            self.cached[slot] = kept
        else:
            self.context.seq_rm(slot, -1, -1)
            self.cached[slot] = None

    def evict_one(self) -> bool:
        """Drop the least recently used idle slot's cached tokens (under KV pressure)."""
        idle = [s for s in range(self.n_parallel) if self.cached[s] is not None]
        if not idle:
            return False
        slot = min(idle, key=lambda s: self._last_used[s])
        self.context.seq_rm(slot, -1, -1)
        self.cached[slot] = None
        return True

    def clear(self) -> None:
        """Drop every idle slot's cached tokens (pinned prefixes stay)."""
        while self.evict_one():
            pass

    @property
    def cached_tokens(self) -> int:
        return sum(len(c) for c in self.cached if c is not None)

    # -- pinned prefixes -----------------------------------------------------------------

    def new_pin_seq(self) -> int:
        if not self.enabled:
            raise ValueError("prefixes cannot be pinned: prefix reuse is off (or unsupported by this model)")
        if not self._free_pin_seqs:
            raise ValueError("no room for another pinned prefix (raise LLM(max_prefixes=...))")
        return self._free_pin_seqs.pop()

    def pin(self, prefix: PinnedPrefix, source_slot: int) -> None:
        """Copy the prefix, just computed in ``source_slot``, into its own sequence."""
        self._copy_prefix(source_slot, prefix.seq_id, len(prefix.tokens))
        self.pinned[prefix.seq_id] = prefix

    def unpin(self, prefix: PinnedPrefix) -> None:
        if self.pinned.pop(prefix.seq_id, None) is not None:
            self.context.seq_rm(prefix.seq_id, -1, -1)
            self._free_pin_seqs.append(prefix.seq_id)
        prefix.released = True

    def drop_pin_seq(self, seq_id: int) -> None:
        """Return a sequence reserved for a pin that never completed."""
        if seq_id not in self.pinned and seq_id not in self._free_pin_seqs:
            self.context.seq_rm(seq_id, -1, -1)
            self._free_pin_seqs.append(seq_id)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
