"""Prefix reuse on sliding-window-attention models (Gemma 3 style).

Such a model's sliding layers attend only to the last ``n_swa`` positions, and llama.cpp's
cache for them keeps no more than each sequence needs next: a cell of a sequence whose
position has left the window may be given to another token, and the positions below it are
then dropped too (every position from ``seq_pos_min`` to ``seq_pos_max`` stays held). A
sequence's state (``state_seq_get``) likewise holds only the window at its end.

So a prefix of ``n`` tokens is reusable from a sequence only when its sliding cache still
holds the positions a token at position ``n`` attends to, ``[n - n_swa + 1, n)`` (for a
chunked window, the chunk's start, which is never below that); a prefix that fails this is
computed again (``refused`` counts the admissions that did), as llama-server forces a full
prompt re-processing then. A saved state is reusable only as a whole (or when its tokens
are shorter than the window): cut at ``n`` below its end, its window is gone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np

from llamabatch._core.slots import SlotState, SlotTable

#: why a RAM-tier hit was not loaded (``RamCacheStats.restore_skipped``): the state holds the
#: sliding window at its own end, not where the prompt leaves it
SKIP_SLIDING_WINDOW = "sliding_window"


class _PositionRange(Protocol):
    def seq_pos_min(self, seq_id: int) -> int: ...


class SlidingWindow:
    """What a sliding-window model's KV cache can still give a prefix reuse."""

    def __init__(self, context: _PositionRange, n_swa: int) -> None:
        if n_swa < 1:
            raise ValueError(f"n_swa must be >= 1, got {n_swa}")
        self.context = context
        self.n_swa = n_swa
        #: admissions whose longest cached prefix was computed again: the sliding cache no
        #: longer held its window (``GenerationStats.swa_prefix_recomputed``)
        self.refused = 0

    def lowest_needed(self, n: int) -> int:
        """The lowest position a token at position ``n`` attends to in the sliding layers."""
        return max(0, n - self.n_swa + 1)

    def holds(self, seq: int, n: int) -> bool:
        """Whether ``seq``, holding at least positions up to ``n - 1``, still holds what a
        continuation from position ``n`` attends to (trivially so for ``n <= 0``)."""
        if n <= 0:
            return True
        pos_min = self.context.seq_pos_min(seq)
        return 0 <= pos_min <= self.lowest_needed(n)

    def restorable(self, n_saved: int, n: int) -> bool:
        """Whether a state saved from a sequence of ``n_saved`` tokens, cut to its first
        ``n``, still holds the window at ``n``. The state holds its last ``n_swa`` positions,
        one fewer when the cache had already dropped the lowest (the worst case counted)."""
        return self.lowest_needed(n_saved) <= self.lowest_needed(n)

    def best_source(
        self, table: SlotTable, tags: Sequence[Hashable], tag: Hashable, tokens: Sequence[int], limit: int
    ) -> tuple[int, int, int]:
        """``(seq, n, longest)``: among the sequences computed under ``tag``, the one sharing the longest
        prefix of ``tokens`` (at most ``limit``) that it still ``holds``; an idle slot wins a
        tie, then the lowest seq (``(-1, 0)`` when none); and the longest prefix cached,
        held or not."""
        array = np.asarray(tokens, dtype=np.int32)
        best, best_n, best_idle, longest = -1, 0, False, 0
        for seq, seq_tag in enumerate(tags):
            if seq_tag != tag:
                continue
            n = min(table.common_prefix(seq, array), limit)
            if n <= 0:
                continue
            longest = max(longest, n)
            if not self.holds(seq, n):
                continue
            idle = seq < table.n_parallel and table.state(seq) == SlotState.IDLE
            if n > best_n or (n == best_n and idle and not best_idle):
                best, best_n, best_idle = seq, n, idle
        return best, best_n, longest


def sliding_window_for(context: _PositionRange, n_swa: int) -> SlidingWindow | None:
    """The model's :class:`SlidingWindow` (``Model.n_swa``), None for a model without one."""
    return SlidingWindow(context, n_swa) if n_swa > 0 else None
