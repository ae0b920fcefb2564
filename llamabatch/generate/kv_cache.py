"""The KV cache: prefix reuse, eviction, pinned prefixes — and the only code that changes
what llama.cpp's sequences hold outside a decode (``seq_rm``/``seq_cp``).

Every change is made twice, in one method each: in llama.cpp (``Context.seq_rm`` /
``seq_cp``) and in the slot table's KV record (``SlotTable.trim`` / ``copy``), which is
the one place the engine reads what each sequence holds and how many cells are free.

With a unified KV cache a copy shares the prefix's cells, and partial copies ([0, n) of a
sequence) are possible. With one KV stream per sequence (``kv_unified=False``) llama.cpp
only copies whole streams (a partial cross-stream copy aborts the process), so a prefix is
copied as the source's whole stream, then the copy's tail is removed. Sources of a prefix:

- any slot's sequence, busy or idle: idle slots keep their last tokens in the KV cache
  until their slot is reused or evicted (least recently used first) under KV pressure;
- pinned prefixes (``LLM.register_prefix``) held in sequences of their own, past the
  slots' seq_ids, until released.

At admission (``place``) the new request takes an idle slot: the one whose own cached
tokens match the prompt longest, else the least recently used one; the longest match from
any source is copied in, and only the rest of the prompt is computed (always at least the
last prompt token, so its logits exist). A request whose prompt shares at least
``MIN_WAIT_TOKENS`` not-yet-computed tokens with a prompt being prefilled right now waits
in the queue until they are computed (``should_wait``), so requests arriving together
with a common system prompt compute it once. A request whose best match is a state in the
RAM tier that running requests keep out of the KV cache waits for them too, while waiting
still beats computing the prompt (``restore_worth_waiting``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llamabatch._core.slots import SlotState, SlotTable
from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch.config import EngineConfig
from llamabatch.generate.kv_state_format import drop_leading_cells
from llamabatch.generate.prefix_store import PrefixStore, file_size, state_bytes_per_token, store_for
from llamabatch.generate.ram_cache import (
    SKIP_ROOM_HELD_BY_RUNNING,
    SKIP_STATE_DROPPED,
    RamCache,
    ram_cache_for,
)
from llamabatch.generate.swa import SKIP_SLIDING_WINDOW, SlidingWindow, sliding_window_for

logger = logging.getLogger("llamabatch")

#: shared prompt tokens still to be computed elsewhere that make a new request wait
MIN_WAIT_TOKENS = 16
#: prompt tokens whose computing costs about one tick of the decodes a waiting request waits
#: through: a decode tick reads every weight once whatever it holds, as a prompt chunk of
#: about this many tokens does on a CPU, so a request may wait this many times fewer ticks
#: for a restore's room than the tokens the restore saves computing
WAIT_TICK_PROMPT_TOKENS = 16
#: prompts remembered as waiting for a restore's room (older ones are forgotten first)
_MAX_RESTORE_WAITS = 256


@dataclass
class PinnedPrefix:
    """A prefix kept in the KV cache for every request that starts with it."""

    seq_id: int
    tokens: list[int]
    text: str | None = None
    released: bool = False


@dataclass(frozen=True)
class Placement:
    """Where an admitted request goes: its slot, and the prefix copied or kept there."""

    slot: int
    source_seq: int  # -1: nothing copied (the slot's own cache is reused in place, or none)
    reused_tokens: int
    #: of those, the longest prefix another sequence holds too (cells a unified buffer keeps
    #: once for both; the layout follower's "shared prefix" signal)
    shared_tokens: int = 0


@dataclass
class KVCache:
    """Prefix reuse and KV bookkeeping over one context and its slot table."""

    context: Context
    table: SlotTable
    #: reuse cached prompt prefixes (``LLM(prefix_cache=...)``, and the model supports it)
    reuse: bool
    #: copies of sequences work on this model (no recurrent or hybrid state)
    copy_supported: bool = True
    pinned: dict[int, PinnedPrefix] = field(default_factory=dict)
    #: the host-RAM tier below (``cache_ram``; None: off): see ``ram_cache.py``
    ram: RamCache | None = None
    #: a sliding-window model's window (None: none): reuse only what its cache still holds
    window: SlidingWindow | None = None
    #: pinned prefixes' files (``prefix_cache_dir``; None: none): see ``prefix_store.py``
    store: PrefixStore | None = None
    #: the model's layers, to rewrite a state for ``load_state`` (0: states load whole)
    n_layer: int = 0
    #: the most bytes a prefix file's state may have per token (bigger files are refused unread)
    state_bytes_per_token: int = 1 << 20
    #: the KV cells a state holding these tokens takes beyond their positions, with those
    #: the sequences hold beyond theirs (M-RoPE images: ``Vision.state_cells``; None: none)
    extra_cells: Callable[[np.ndarray], int] | None = None
    _free_pin_seqs: list[int] = field(init=False)
    #: prompts (their tokens' bytes) waiting for a restore's room -> the checks they waited
    _restore_waits: dict[tuple[Hashable, bytes], int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.reuse = self.reuse and self.copy_supported
        if not self.reuse:
            self.ram = None
        self._whole_streams = not self.table.kv_unified
        table = self.table
        self._free_pin_seqs = list(range(table.n_seq - 1, table.n_parallel - 1, -1))
        #: the adapter set (``SamplingParams.lora``; ``()``: the base model) each sequence's
        #: KV was computed under: prefix reuse and the host-RAM tier key on (tag, tokens), and
        #: only the base model's KV goes to the prefix files
        self.tags: list[Hashable] = [()] * table.n_seq
        #: the client whose request last computed in each sequence (``Request.client``): its
        #: state goes to the RAM tier as that client's (``RamCache``'s per-client share)
        self.owners: list[Hashable] = [None] * table.n_seq
        self._tagged = False  # whether any sequence was ever computed under an adapter

    # -- the two primitives: every KV change goes through them --------------------------

    def trim(self, seq: int, n: int) -> None:
        """Keep positions [0, n) of an idle slot or pinned sequence; drop the rest."""
        self.context.seq_rm(seq, n if n else -1, -1)
        self.table.trim(seq, n)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make the idle slot or pinned sequence ``dst`` hold positions [0, n) of ``src``."""
        self.trim(dst, 0)
        if self._whole_streams:
            self.context.seq_cp(src, dst, -1, -1)  # the whole stream (deferred buffer copy)
            self.context.seq_rm(dst, n, -1)
        else:
            self.context.seq_cp(src, dst, 0, n)  # shared cells, no data copied
        self.table.copy(src, dst, n)

    def release(self, slot: int, keep: bool) -> None:
        """A request leaves ``slot``: keep what its KV validly holds for reuse, or drop it.

        Also drops whatever a failed (partly processed) decode left past ``n_past``."""
        keep = keep and self.reuse
        n_past = self.table.n_past(slot)
        self.context.seq_rm(slot, n_past if keep and n_past else -1, -1)
        self.table.finish(slot, keep=keep)

    def move(self, src: int, dst: int) -> bool:
        """Move the decoding sequence of slot ``src`` into the idle slot ``dst`` (its KV, its
        record and its adapter tag); ``src`` is left empty. With one KV stream per sequence
        the whole stream is copied, at the start of the next decode. What ``dst`` cached is
        evicted first (to the RAM tier, when on): whether there was any."""
        evicted = bool(self.table.seq_len(dst))
        if evicted:
            self.save(dst)
            self.trim(dst, 0)
        self.context.seq_cp(src, dst, -1, -1)
        self.context.seq_rm(src, -1, -1)
        self.table.move(src, dst)
        self.tags[dst], self.tags[src] = self.tags[src], ()
        self.owners[dst], self.owners[src] = self.owners[src], None
        return evicted

    def drop_uncommitted(self, slot: int) -> None:
        """Remove what a failed decode may have written past the slot's ``n_past``."""
        self.context.seq_rm(slot, self.table.n_past(slot), -1)

    # -- admission ----------------------------------------------------------------------

    def place(
        self, tokens: list[int], leader_slot: int = -1, tag: Hashable = (), owner: Hashable = None
    ) -> Placement:
        """Choose an idle slot for ``tokens`` (computed under the adapter set ``tag`` for the
        client ``owner``) and make it hold the longest reusable prefix computed under the same
        set.

        With reuse off, only a parallel-sampling leader's prompt is shared."""
        placement = self._place(tokens, leader_slot, tag)
        if tag != ():
            self._tagged = True
        self.tags[placement.slot] = tag
        self.owners[placement.slot] = owner
        if placement.source_seq >= 0:  # copied: its source holds it all
            shared = placement.reused_tokens
        else:
            shared = self._held_elsewhere(placement.slot, tokens[: placement.reused_tokens], tag)
        return dataclasses.replace(placement, shared_tokens=shared) if shared else placement

    def _held_elsewhere(self, slot: int, prefix: list[int], tag: Hashable) -> int:
        """The longest part of ``prefix`` a sequence other than ``slot`` holds, computed under
        the same adapter set."""
        table, longest = self.table, 0
        if prefix:
            for seq in range(table.n_seq):
                if seq != slot and self.tags[seq] == tag:
                    longest = max(longest, table.common_prefix(seq, prefix))
        return longest

    def _place(self, tokens: list[int], leader_slot: int, tag: Hashable) -> Placement:
        table = self.table
        limit = len(tokens) - 1  # the last prompt token is always computed
        best_seq, best_n, cut = self._best_source(tokens, leader_slot, limit, tag)
        if self._restore_waits:
            self._restore_waits.pop((tag, np.asarray(tokens, dtype=np.int32).tobytes()), None)
        if self.ram is not None and len(tokens) > self.ram.block:
            restored = self._restore(tokens, best_n, limit, tag)
            if restored is not None:
                return restored
            # not restored: the attempt may have emptied an idle slot, look again
            best_seq, best_n, cut = self._best_source(tokens, leader_slot, limit, tag)
        if cut and self.window is not None:
            self.window.refused += 1
        if 0 <= best_seq < table.n_parallel and table.state(best_seq) == SlotState.IDLE:
            slot, best_seq = best_seq, -1  # reuse an idle slot's own cache in place
            if self.ram is not None and table.seq_len(slot) - best_n >= self.ram.block:
                self.save(slot)  # the tokens past the match leave the KV cache
            self.trim(slot, best_n)
        else:
            slot = table.admission_slot()
            self.save(slot)  # its cached tokens leave the KV cache: keep them in RAM
            if best_seq >= 0:
                self.copy(best_seq, slot, best_n)
            else:
                self.trim(slot, 0)
        table.touch(slot)
        return Placement(slot, best_seq, best_n)

    def best_prefix(self, tokens: list[int] | np.ndarray, tag: Hashable = ()) -> tuple[int, int]:
        """``SlotTable.best_prefix`` among the sequences computed under the adapter set ``tag``:
        ``(seq, n)``, or ``(-1, 0)``; on a tie an idle slot wins, then the lowest seq."""
        table = self.table
        if not self._tagged:
            return table.best_prefix(tokens) if tag == () else (-1, 0)
        best, best_n, best_idle = -1, 0, False
        for seq, seq_tag in enumerate(self.tags):
            if seq_tag != tag:
                continue
            n = table.common_prefix(seq, tokens)
            idle = seq < table.n_parallel and table.state(seq) == SlotState.IDLE
            if n > best_n or (n == best_n and n > 0 and idle and not best_idle):
                best, best_n, best_idle = seq, n, idle
        return best, best_n

    def _best_source(
        self, tokens: list[int], leader_slot: int, limit: int, tag: Hashable
    ) -> tuple[int, int, bool]:
        """``(seq, n, cut)``: the sequence holding the longest reusable prefix of ``tokens``
        (at most ``limit``) computed under ``tag``, or ``(-1, 0)``; ``cut``: a longer prefix
        was cached that a sliding-window model's cache no longer holds the window of."""
        table, window = self.table, self.window
        best_seq, best_n = -1, 0
        longest = 0
        if self.reuse and window is not None:
            best_seq, best_n, longest = window.best_source(table, self.tags, tag, tokens, limit)
        elif self.reuse:
            best_seq, best_n = self.best_prefix(tokens, tag)
        elif self.copy_supported and leader_slot >= 0 and table.state(leader_slot) != SlotState.IDLE:
            best_seq, best_n = leader_slot, table.common_prefix(leader_slot, tokens)
        best_n = min(best_n, limit)
        if window is not None and best_n > 0 and not window.holds(best_seq, best_n):
            return -1, 0, True
        return (best_seq, best_n, longest > best_n) if best_n > 0 else (-1, 0, longest > 0)

    def should_wait(self, tokens: list[int], admitting: list[list[int]], tag: Hashable = ()) -> bool:
        """True when a prompt being prefilled (or ``admitting`` in this same step) shares
        enough not-yet-computed tokens with ``tokens`` that waiting for them beats
        computing them twice; or when ``restore_worth_waiting``."""
        if not self.reuse:
            return False
        if self.ram is not None and self.restore_worth_waiting(tokens, tag):
            return True
        table = self.table
        prefilling = [
            s for s in range(table.n_parallel) if table.state(s) == SlotState.PREFILL and self.tags[s] == tag
        ]
        if not (prefilling or admitting):
            return False
        limit = len(tokens) - 1
        now = self.best_prefix(tokens, tag)[1]
        for slot in prefilling:
            shared = min(table.common_history(slot, tokens), limit)
            if shared - max(now, table.n_past(slot)) >= MIN_WAIT_TOKENS:
                return True
        array = np.asarray(tokens, dtype=np.int32)
        for other in admitting:
            shared = min(_common_prefix(np.asarray(other, dtype=np.int32), array), limit)
            if shared - now >= MIN_WAIT_TOKENS:
                return True
        return False

    def restore_worth_waiting(self, tokens: list[int], tag: Hashable = ()) -> bool:
        """True when the best match of ``tokens`` (under the adapter set ``tag``) is a state in
        the RAM tier whose room (unified KV cache) running requests hold, even with every idle
        slot's cached tokens evicted, and the prompt has waited fewer checks (one an admission
        step) than the ticks computing the restorable tokens would cost (their count over
        :data:`WAIT_TICK_PROMPT_TOKENS`).

        A ski-rental bound: the running requests end when they end, so the prompt waits at
        most about what computing it would take, and is computed after that (the skip is then
        counted by ``_restore``). A prompt that waits is counted once (``restore_waits``)."""
        ram, table = self.ram, self.table
        if ram is None or not table.kv_unified or not table.busy_slots or len(tokens) <= ram.block:
            return False
        limit = len(tokens) - 1
        array = np.asarray(tokens, dtype=np.int32)
        entry, n = ram.match(array, tag)
        n = min(n, limit)
        best_n = min(self.best_prefix(tokens, tag)[1], limit) if entry is not None else 0
        if (
            entry is None
            or n < ram.block
            or n <= best_n
            or (self.window is not None and not self.window.restorable(len(entry.tokens), n))
            or self._room_if_idle_evicted(len(entry.tokens))
        ):
            if self._restore_waits:
                self._restore_waits.pop((tag, array.tobytes()), None)
            return False
        key = (tag, array.tobytes())
        waited = self._restore_waits.get(key, 0)
        if waited >= math.ceil((n - best_n) / WAIT_TICK_PROMPT_TOKENS):
            return False
        if not waited:
            ram.restore_waits += 1
            while len(self._restore_waits) >= _MAX_RESTORE_WAITS:
                del self._restore_waits[next(iter(self._restore_waits))]
        self._restore_waits[key] = waited + 1
        return True

    def _room_if_idle_evicted(self, n_cells: int) -> bool:
        """Whether ``n_cells`` would be free (unified KV cache) with every idle slot's cached
        tokens evicted, less what prompts admitted but not computed yet will take (a lower
        bound: cells idle slots share only among themselves are not counted)."""
        table = self.table
        free = table.cells_free
        for slot in range(table.n_parallel):
            if table.state(slot) == SlotState.IDLE:
                free += table.cells_owned(slot)
            else:
                free -= table.n_pending(slot)
        return free >= n_cells

    # -- eviction -----------------------------------------------------------------------

    def evict_one(self, keep: int = -1) -> bool:
        """Drop the least recently used idle slot's cached tokens (not ``keep``'s: a prefix
        about to be reused); False when no other idle slot holds any."""
        slot = self.table.lru_slot(cached_only=True, exclude=keep)
        if slot < 0:
            return False
        self.save(slot)
        self.trim(slot, 0)
        return True

    def clear(self) -> None:
        """Drop every idle slot's cached tokens, and the host-RAM tier's (pinned prefixes stay)."""
        ram, self.ram = self.ram, None
        try:
            while self.evict_one():
                pass
        finally:
            self.ram = ram
        if ram is not None:
            ram.clear()

    # -- the host-RAM tier (``ram_cache.py``) ---------------------------------------------

    def save(self, seq: int) -> bool:
        """Copy the state of the idle ``seq`` (about to lose its cached tokens) to the RAM
        tier, under its adapter set and as its client's; False when off, too short, already
        there or not copyable."""
        ram = self.ram
        if ram is None or self.table.seq_len(seq) < ram.block:
            return False
        tokens, tag = self.table.seq_tokens(seq), self.tags[seq]
        covering = ram.covers(tokens, tag)
        if covering is not None:
            ram.touch(covering)
            return False
        data = self.context.state_seq_get(seq, ram.budget_bytes)
        return ram.save(tokens, data, tag=tag, owner=self.owners[seq])

    def _restore(self, tokens: list[int], best_n: int, limit: int, tag: Hashable) -> Placement | None:
        """Load the saved state of the adapter set ``tag`` sharing the longest prefix with
        ``tokens`` into the idle slot a fresh placement takes (``admission_slot``) when it
        beats the KV cache's ``best_n`` tokens; None when none does (or it cannot be loaded:
        then the prompt is computed as usual, and a hit not loaded is counted in
        ``restore_skipped`` with its reason).

        Idle slots' cached prefixes never keep a state out: they are saved (when worth it)
        and evicted for its room. Only cells running requests hold can; then the prompt is
        computed now rather than waiting, because the wait has no bound known at admission
        (the running requests end when they end) while the prompt's own cells fit now
        (``EngineCore._make_room`` checked it); the state stays in RAM for the next match."""
        ram = self.ram
        assert ram is not None
        table = self.table
        array = np.asarray(tokens, dtype=np.int32)
        if self.store is not None and self.store.disk and tag == ():  # files: the base model's KV
            self._from_disk(array, best_n, limit)
        entry, n = ram.match(array, tag)
        n = min(n, limit)
        if entry is None or n < ram.block or n <= best_n:
            ram.misses += 1
            return None
        ram.hits += 1
        if self._window_refuses(len(entry.tokens), n):
            return None
        slot = table.admission_slot()  # as a fresh placement (per-stream: keeps busy streams together)
        self.save(slot)
        entry, n = ram.match(array, tag)  # saving may have replaced or dropped that entry
        n = min(n, limit)
        if entry is None or n < ram.block or n <= best_n:
            ram.skip(SKIP_STATE_DROPPED)
            return None
        if self._window_refuses(len(entry.tokens), n):
            return None
        self.trim(slot, 0)
        ram.touch(entry)  # the evictions' saves below drop older states first
        if table.kv_unified and not self._room_to_load(entry.tokens, tag):
            ram.skip(SKIP_ROOM_HELD_BY_RUNNING)
            return None
        if not ram.holds(entry):  # an eviction's save pushed it out of the budget
            ram.skip(SKIP_STATE_DROPPED)
            return None
        loaded, shared = self.load_state(slot, entry.tokens[:n], entry.data, tag)
        if not loaded:
            ram.restore_failures += 1
            entry.failures += 1
            if entry.source is not None and self.store is not None:  # a file's bytes: refused at once
                ram.discard(entry)
                self.store.refuse(entry.source, "llama.cpp could not load its state")
            elif entry.failures > 1:  # refused twice: bad bytes, not a passing lack of room
                ram.discard(entry)
            return None
        if entry.source is not None and self.store is not None:  # a file's state, taken by llama.cpp
            entry.source = None
            self.store.loaded += 1
        if len(entry.tokens) > n:
            self.context.seq_rm(slot, n, -1)
        if self.window is not None and not self.window.holds(slot, n):
            self.context.seq_rm(slot, -1, -1)  # the slot table still records it empty
            ram.skip(SKIP_SLIDING_WINDOW)
            return None
        ram.shared_tokens += shared
        table.record_cached(slot, entry.tokens[:n])
        ram.touch(entry)
        ram.restores += 1
        ram.restored_tokens += n
        table.touch(slot)
        return Placement(slot, -1, n)

    def _window_refuses(self, n_saved: int, n: int) -> bool:
        """True (the skip counted) when a sliding-window model cannot continue from the
        first ``n`` tokens of a state saved with ``n_saved`` (see ``swa.py``)."""
        if self.window is None or self.window.restorable(n_saved, n):
            return False
        assert self.ram is not None
        self.ram.skip(SKIP_SLIDING_WINDOW)
        return True

    def _room_to_load(self, tokens: np.ndarray, tag: Hashable = ()) -> bool:
        """Free cells (unified KV cache) to load a state holding ``tokens``: all of them are
        loaded before the prefix other sequences hold is shared again, so idle slots' cached
        tokens are evicted for room (saved to RAM first, least recently used first), the
        sequence holding that prefix last, and only when it shares at least a block (a
        shorter match, a BOS token say, is not worth keeping a state out). False only when
        running requests and prompts admitted but not computed yet hold the room. Computing
        the prompt instead would take about as many cells, and compute them."""
        table = self.table
        pending = sum(table.n_pending(s) for s in range(table.n_parallel))
        source, shared = self.best_prefix(tokens, tag)
        keep = source if self.ram is not None and shared >= self.ram.block else -1
        extra = self.extra_cells or (lambda _: 0)
        while table.cells_free - pending < len(tokens) + extra(tokens):
            if self.evict_one(keep=keep):
                continue
            if keep < 0 or keep >= table.n_parallel or table.state(keep) != SlotState.IDLE:
                return False
            keep = -1  # the shared prefix's holder goes too: the state brings that prefix back
        return True

    def load_state(
        self, slot: int, tokens: np.ndarray, data: bytes | bytearray, tag: Hashable = ()
    ) -> tuple[bool, int]:
        """Load ``data`` (a state in this context's layout whose first cells hold ``tokens``,
        computed under the adapter set ``tag``) into the empty ``slot`` (from RAM, or a layout
        switch's carried state; the caller records it); returns whether it loaded and the
        tokens shared.

        The prefix of ``tokens`` another sequence holds (the shared system prompt, say) is
        taken from its cells, as a prefix copied at admission is, so each restored
        conversation does not keep (and every tick attend to) its own copy, and only the
        state's cells after it are written (``drop_leading_cells``: loading them all and
        freeing the prefix would leave holes that spread the buffer's used cells). Unified
        KV cache only (a copy across streams moves the data), and not on a sliding-window
        model (the copy's sliding cells would not join the restored window's)."""
        context, table = self.context, self.table
        source, shared = -1, 0
        if table.kv_unified and self.window is None:
            source, shared = self.best_prefix(tokens, tag)
            shared = min(shared, len(tokens) - 1)  # a state keeps one cell at least
        if source < 0 or shared <= 0:
            return context.state_seq_set(slot, data), 0
        suffix = drop_leading_cells(data, shared, self.n_layer) if self.n_layer else None
        if not context.state_seq_set(slot, data if suffix is None else suffix):
            return False, 0
        if suffix is None:
            context.seq_rm(slot, 0, shared)
        context.seq_cp(source, slot, 0, shared)
        table.copy(source, slot, shared)
        return True, shared

    @property
    def cached_tokens(self) -> int:
        """Tokens idle slots hold for reuse."""
        table = self.table
        return sum(table.seq_len(s) for s in range(table.n_parallel) if table.state(s) == SlotState.IDLE)

    # -- pinned prefixes -----------------------------------------------------------------

    def new_pin_seq(self) -> int:
        if not self.reuse:
            raise ValueError("prefixes cannot be pinned: prefix reuse is off (or unsupported by this model)")
        if not self._free_pin_seqs:
            if self.table.n_seq == self.table.n_parallel:  # max_prefixes resolved to 0
                raise ValueError(
                    "no sequence for pinned prefixes: max_prefixes is 0 (the default with one KV stream "
                    "per sequence, where each pinned prefix takes a stream of its own); pass "
                    "LLM(max_prefixes=k), or kv_unified=True"
                )
            raise ValueError("no room for another pinned prefix (raise LLM(max_prefixes=...))")
        return self._free_pin_seqs.pop()

    def pin(self, prefix: PinnedPrefix, source_slot: int) -> bool:
        """Copy the prefix, just computed in ``source_slot``, into its own sequence; False
        (nothing copied) when its sequence was given back meanwhile (``register_prefix``
        gave up waiting)."""
        seq = prefix.seq_id
        if prefix.released or seq in self._free_pin_seqs or seq in self.pinned:
            return False
        self.copy(source_slot, seq, len(prefix.tokens))
        self.pinned[seq] = prefix
        self.tags[seq] = self.tags[source_slot]
        if self.store is not None and self.tags[seq] == ():
            self.store.save(prefix.tokens, self.context.state_seq_get(seq))
        return True

    def use_store(self, store: PrefixStore | None, state_bytes_per_token: int) -> None:
        """Persist pinned prefixes (and, with the RAM tier on, its states at close) to
        ``store``; with the RAM tier, its files from earlier runs are indexed for matching."""
        self.store = store
        self.state_bytes_per_token = state_bytes_per_token
        if store is not None and self.ram is not None:
            store.scan(self.ram.block, max_tokens=self.table.n_ctx_seq)

    def persist(self) -> int:
        """At close: write the RAM tier's base-model states (idle slots' cached tokens first
        saved to it) to the prefix store, most recently used first (a file names no adapter
        set); returns the files written."""
        store, ram, table = self.store, self.ram, self.table
        if store is None or ram is None:
            return 0
        try:
            for slot in range(table.n_parallel):
                if table.state(slot) == SlotState.IDLE:
                    self.save(slot)
            kept, room = [], store.max_bytes
            for entry in reversed([e for e in ram.entries() if e.tag == ()]):  # newest first, to the cap
                size = file_size(store.layout, len(entry.tokens), len(entry.data))
                if size <= room:
                    kept.append(entry)
                    room -= size
            written = 0
            for entry in reversed(kept):  # oldest first: the newest files are the last pruned
                path = store.path_for(entry.tokens)
                if path.exists():
                    store.touch(path)
                elif store.save(entry.tokens, entry.data):
                    written += 1
            return written
        except Exception:  # closing must not fail for a cache
            logger.exception("llamabatch: could not persist the host-RAM prompt cache")
            return 0

    def _from_disk(self, tokens: np.ndarray, best_n: int, limit: int) -> None:
        """Load into the RAM tier the file of an earlier run that beats both the KV cache's
        ``best_n`` and the RAM tier's match for ``tokens`` (checked first: a bad file is
        refused and forgotten)."""
        store, ram = self.store, self.ram
        assert store is not None and ram is not None
        file_tokens, n = store.best(tokens)
        if file_tokens is None or min(n, limit) < ram.block:
            return
        if min(n, limit) <= max(best_n, min(ram.match(tokens)[1], limit)):
            return
        store.forget(file_tokens)
        payload = store.load(file_tokens, len(file_tokens) * self.state_bytes_per_token + (1 << 20))
        if payload is not None:  # counted as loaded once llama.cpp takes it (``_restore``)
            ram.save(file_tokens, payload, source=store.path_for(file_tokens))

    def load_pin(self, prefix: PinnedPrefix) -> bool:
        """Pin ``prefix`` from its file in ``prefix_cache_dir`` (checked first: see
        ``prefix_store.py``); False when there is none or it is refused (then it is computed)."""
        store, seq, n = self.store, prefix.seq_id, len(prefix.tokens)
        if store is None or prefix.released or seq in self._free_pin_seqs or seq in self.pinned:
            return False
        if n > self.table.n_ctx_seq or (self.table.kv_unified and self.table.cells_free < n):
            return False
        payload = store.load(prefix.tokens, n * self.state_bytes_per_token + (1 << 20))
        if payload is None:
            return False
        self.trim(seq, 0)
        if not self.context.state_seq_set(seq, payload) or self.context.seq_pos_max(seq) != n - 1:
            self.context.seq_rm(seq, -1, -1)
            store.refuse(store.path_for(prefix.tokens), "llama.cpp could not load its state")
            return False
        self.table.record_cached(seq, prefix.tokens)
        self.tags[seq] = ()  # prefix files hold the base model's KV only
        self.pinned[seq] = prefix
        store.loaded += 1
        return True

    def tier_stats(self) -> dict[str, Any]:
        """The RAM tier's and the prefix files' counters (``GenerationStats`` fields: counts,
        and ``ram_cache_restore_skipped``, a count by reason)."""
        out: dict[str, Any] = {}
        if self.ram is not None:
            for name, value in vars(self.ram.stats()).items():
                out[f"ram_cache_{name}"] = value
        if self.store is not None:
            out["prefix_files_loaded"] = self.store.loaded
            out["prefix_files_saved"] = self.store.saved
            out["prefix_files_refused"] = self.store.refused
        if self.window is not None:
            out["swa_prefix_recomputed"] = self.window.refused
        return out

    def unpin(self, prefix: PinnedPrefix) -> None:
        if self.pinned.pop(prefix.seq_id, None) is not None:
            self.trim(prefix.seq_id, 0)
            self._free_pin_seqs.append(prefix.seq_id)
        prefix.released = True

    def drop_pin_seq(self, seq_id: int) -> None:
        """Return a sequence reserved for a pin that never completed."""
        if seq_id not in self.pinned and seq_id not in self._free_pin_seqs:
            self.trim(seq_id, 0)
            self._free_pin_seqs.append(seq_id)


def kv_cache_for(model: Model, context: Context, table: SlotTable, config: EngineConfig) -> KVCache:
    """The ``KVCache`` of an engine: prefix reuse as ``config`` asks where the model's memory
    can be copied in part (not recurrent or hybrid: then off, with a warning), its RAM tier
    (``cache_ram``) and its files (``prefix_cache_dir``)."""
    copy_supported = not (model.is_recurrent or model.is_hybrid)
    if config.prefix_cache and not copy_supported:
        logger.warning(
            "llamabatch: prefix reuse switched off: %s has %s memory, its KV cannot be copied in part",
            model.path.name,
            "recurrent" if model.is_recurrent else "hybrid",
        )
    kv = KVCache(
        context,
        table,
        reuse=config.prefix_cache,
        copy_supported=copy_supported,
        ram=ram_cache_for(config.cache_ram),
        window=sliding_window_for(context, model.n_swa),
        n_layer=model.n_layer,
    )
    if kv.reuse and config.prefix_cache_dir is not None:
        store = store_for(
            config.prefix_cache_dir, model, context, config.flash_attn, config.prefix_cache_dir_max_mb
        )
        kv.use_store(store, state_bytes_per_token(model))
    return kv


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
