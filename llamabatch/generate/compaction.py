"""Closing gaps among busy KV streams: a decoding sequence moves into an idle slot between
busy ones, so that each tick decodes fewer runs.

With one KV stream per sequence (``kv_unified=False``), llama.cpp splits a batch into ubatches
of *consecutive* seq_ids, and every ubatch is a forward pass that reads all the weights.
Admission already takes the idle slot that joins a run of busy ones
(``SlotRecord.admission_slot``), but a request that ends between two others leaves a gap, and
until an admission fills it every tick pays for one more pass. Measured on SmolLM2-135M
(2 cores, 4,096-cell streams; README, "KV cache layout, admission and preemption"): a decode
tick of streams 0, 2, 4, 6 took 43 ms, of streams 0-3 31 ms.

So between ticks, after admission (a waiting request that can start takes the gap itself),
the engine moves one decoding sequence into a gap when that leaves fewer runs
(:func:`plan_move`): llama.cpp copies the whole stream at the start of the next decode and
the engine moves the slot's records (``KVCache.move``, ``SlotMap.move``). Outputs do not
change: the cells are copied as they are. What the gap cached is evicted as admission would
(to the RAM tier, when on), and an empty gap goes first.

The copy is of the whole stream, used or not: 9 ms for 4,096 cells and 34 ms for 16,384 on
SmolLM2 there, about two and eight of the passes a gap costs. So a sequence moves only with
:data:`MIN_TOKENS_LEFT` tokens left to generate per 4,096 cells of its stream
(:func:`tokens_left_to_move`): the ticks left pay the copy back about four times over.

The copy runs inside the next ``llama_decode``, where no tick prediction expects it. So while
the engine plans ticks under a time limit (``target_itl_ms``, an ITL SLO), a sequence moves
only into a tick that computes no prompt, and only if the copy, estimated at
:data:`COPY_BYTES_PER_S` (a fifth of what this CPU measured), takes at most half the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llamabatch._core.slots import SlotState
from llamabatch._ffi.kv_types import kv_bytes_per_cell

__all__ = [
    "COPY_BYTES_PER_S",
    "MIN_TOKENS_LEFT",
    "compact",
    "copy_fits_the_tick",
    "plan_move",
    "tokens_left_to_move",
]

#: a sequence moves only with this many tokens left to generate (``max_tokens``, context),
#: per 4,096 cells of its stream (what the copy costs)
MIN_TOKENS_LEFT = 8
_CELLS_PER_STEP = 4096
#: a stream copy's speed assumed under a tick time limit (measured: about 10 GB/s, SmolLM2's
#: 4,096-cell stream of 94 MB in 9 ms on a 2-core AMD EPYC)
COPY_BYTES_PER_S = 2e9
#: candidates looked at on each side, best first (runs' ends; gaps next to a run)
_CANDIDATES = 8


def tokens_left_to_move(n_ctx_seq: int) -> int:
    """The fewest tokens a sequence must have left to generate to move, with streams of
    ``n_ctx_seq`` cells (see the module)."""
    return MIN_TOKENS_LEFT * max(1, -(-n_ctx_seq // _CELLS_PER_STEP))


def _busy(busy: Sequence[bool], i: int) -> bool:
    return 0 <= i < len(busy) and busy[i]


def _runs(busy: Sequence[bool]) -> int:
    """Runs of consecutive busy slots: the forward passes of a tick decoding them all."""
    return sum(1 for i, b in enumerate(busy) if b and not _busy(busy, i - 1))


def _delta(busy: Sequence[bool], i: int, adding: bool) -> int:
    """How many runs of consecutive busy slots adding (or removing) slot ``i`` makes (or
    ends): a slot between two busy ones joins (or splits) two runs; one with no busy
    neighbour makes (or ends) a run of its own."""
    left, right = _busy(busy, i - 1), _busy(busy, i + 1)
    if left and right:
        return -1 if adding else 1
    if not left and not right:
        return 1 if adding else -1
    return 0


def plan_move(busy: Sequence[bool], movable: Sequence[bool], cached: Sequence[int]) -> tuple[int, int] | None:
    """The move ``(src, dst)`` of a ``movable`` busy slot into an idle one that leaves the
    fewest runs of consecutive busy slots, or None when no move leaves fewer. ``cached``: the
    tokens each idle slot caches (an empty gap goes first, then the lowest slot; the highest
    sequence moves)."""
    n = len(busy)
    removals = [(_delta(busy, s, False), -s) for s in range(n) if busy[s] and movable[s]]
    sources = sorted(r for r in removals if r[0] <= 0)[:_CANDIDATES]  # never split a run
    targets = sorted(
        (_delta(busy, d, True), cached[d] > 0, d)
        for d in range(n)
        if not busy[d] and (_busy(busy, d - 1) or _busy(busy, d + 1))
    )[:_CANDIDATES]
    best: tuple[tuple[int, bool, int, int], int, int] | None = None
    after = list(busy)
    for removed, neg_src in sources:
        src = -neg_src
        after[src] = False
        for _, full, dst in targets:
            change = removed + _delta(after, dst, True)
            key = (change, full, dst, neg_src)
            if change < 0 and (best is None or key < best[0]):
                best = (key, src, dst)
        after[src] = True
    return None if best is None else (best[1], best[2])


def copy_fits_the_tick(core: Any) -> bool:
    """Whether a move's copy may join the next tick of ``core``: always without a tick time
    limit; under one, only in a tick that computes no prompt and within half the limit
    (see the module)."""
    limit = core.admission.tick_limit()
    if limit is None:
        return True
    if core.table.count(SlotState.PREFILL):
        return False
    config = core.config
    seconds = kv_bytes_per_cell(core.model, config.type_k, config.type_v) * core.n_ctx_seq / COPY_BYTES_PER_S
    return seconds <= limit.seconds / 2


def compact(core: Any) -> bool:
    """Between ticks: move one decoding sequence of the ``EngineCore`` into a gap among busy
    KV streams when that leaves fewer runs (see the module); whether one moved."""
    table = core.table
    n_busy = table.busy_slots
    if table.kv_unified or not core.kv.copy_supported or not 2 <= n_busy < core.n_parallel:
        return False
    states = table.states()
    busy = [state is not SlotState.IDLE for state in states]
    if _runs(busy) < 2 or not copy_fits_the_tick(core):
        return False
    running = core.slots.requests
    least = tokens_left_to_move(core.n_ctx_seq)
    movable = [
        state is SlotState.DECODE
        and min(
            running[slot].params.max_tokens - len(running[slot].output_tokens),
            core.n_ctx_seq - table.n_past(slot),
        )
        >= least
        for slot, state in enumerate(states)
    ]
    cached = [0 if b else table.seq_len(slot) for slot, b in enumerate(busy)]
    move = plan_move(busy, movable, cached)
    if move is None:
        return False
    src, dst = move
    if core.kv.move(src, dst):
        core.counters.evictions += 1
    core.slots.move(src, dst)
    core.counters.slot_moves += 1
    return True
