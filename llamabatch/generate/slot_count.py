"""How many sequences decode together when ``n_parallel`` is not given (``EngineConfig``'s
default ``None``): as many as the KV memory holds and a tick's cost allows, not a fixed count.

llama.cpp fixes a context's sequences (``n_seq_max``) when it is created, so the slots are
made at load; on the CPU a slot costs only its KV cells, so the count follows the memory:

- **one unified buffer**: every slot gets at least :data:`MIN_CELLS_PER_SLOT` cells of
  ``n_ctx`` on average (``n_ctx // MIN_CELLS_PER_SLOT``), and there are never fewer than
  :data:`MIN_UNIFIED_SLOTS`; a slot holds no cells of its own, and
  admission already starts a request only while its prompt fits the free cells, so more slots
  than fit at once just wait there (``README``, "KV cache layout, admission and preemption");
- **one stream per sequence**: every stream is allocated whole, so the count is what the KV
  byte budget holds, ``budget // stream_bytes`` (a stream of the trained context or of the
  given ``n_ctx``; with ``kv_unified=False`` and ``n_ctx`` given, which divide it: ``n_ctx //
  MIN_CELLS_PER_SLOT`` streams, each at least that many cells);

less the pinned-prefix streams; at most ``n_batch`` sequences with the pinned prefixes
(llama.cpp sizes its outputs by ``n_batch``), and at most :data:`MAX_SLOTS`, the tick's cost:
every decoding row multiplies all the weights once more, so once the weights' reading is
shared out a CPU tick's time grows in proportion to its rows: throughput stops growing, while
every row's inter-token latency keeps growing. A user's ``n_parallel`` always wins (a cap on
the requests running at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llamabatch.config import EngineConfig

__all__ = [
    "MAX_SLOTS",
    "MIN_CELLS_PER_SLOT",
    "MIN_PER_STREAM_SLOTS",
    "MIN_UNIFIED_SLOTS",
    "SlotCount",
    "resolved_slots",
    "slots_for_kv",
]

#: the most slots chosen by default: the tick's cost (a decode tick of ``S`` rows costs about
#: ``S`` times a row's multiplications once the weights' reading is shared out; decoding with
#: SmolLM2-135M on 2 cores gave 89 tokens/s at 1 row, 187 at 8, 258 at 16, 252 at 32)
MAX_SLOTS = 32
#: the fewest KV cells a default slot may get (on average, in one unified buffer)
MIN_CELLS_PER_SLOT = 256
#: the fewest slots of one unified buffer: its slots hold no cells of their own and admission
#: starts a request only while its prompt fits the free cells, so a small ``n_ctx`` still
#: decodes several short requests together
MIN_UNIFIED_SLOTS = 8
#: the fewest slots for which the default layout takes one stream per sequence: below it one
#: unified buffer serves more requests at once from the same memory
MIN_PER_STREAM_SLOTS = 8


@dataclass(frozen=True)
class SlotCount:
    """The slots chosen, and why (``stats().n_parallel``, ``stats().n_parallel_reason``)."""

    n_parallel: int
    reason: str


def slots_for_kv(
    *,
    unified: bool,
    n_ctx: int | None,
    stream_bytes: int,
    budget: int | None,
    n_prefixes: int,
    n_batch: int,
    cap: int = MAX_SLOTS,
) -> SlotCount:
    """The default slot count for a KV cache of ``n_ctx`` cells (``None``: per stream, each
    stream ``stream_bytes``, under ``budget`` bytes, ``None`` for unknown), beside
    ``n_prefixes`` pinned-prefix sequences, with ``n_batch`` tokens a pass, at most ``cap``.

    Never fewer than one slot, never more sequences than ``n_batch``, and never more than the
    memory holds: ``n_ctx // MIN_CELLS_PER_SLOT`` sequences (pinned prefixes included for
    streams; a unified buffer's slots hold no cells, so it gets at least ``MIN_UNIFIED_SLOTS``),
    or ``budget // stream_bytes`` streams."""
    if unified:
        if n_ctx is None:
            raise ValueError("a unified KV cache's slots need its n_ctx")
        by_kv, kv_text = n_ctx // MIN_CELLS_PER_SLOT, f"{MIN_CELLS_PER_SLOT} cells each of n_ctx {n_ctx}"
        if by_kv < MIN_UNIFIED_SLOTS:  # a small buffer still serves short requests together
            by_kv, kv_text = MIN_UNIFIED_SLOTS, f"at least {MIN_UNIFIED_SLOTS} slots share n_ctx {n_ctx}"
    elif n_ctx is not None:
        by_kv = n_ctx // MIN_CELLS_PER_SLOT - n_prefixes
        kv_text = f"streams of {MIN_CELLS_PER_SLOT}+ cells in n_ctx {n_ctx}"
    elif budget is None or stream_bytes <= 0:
        by_kv, kv_text = cap, "memory unknown"
    else:
        by_kv = budget // stream_bytes - n_prefixes
        kv_text = f"streams of {stream_bytes / 2**20:.0f} MiB in {budget / 2**20:.0f} MiB"
    bounds = [(by_kv, f"the KV memory ({kv_text})"), (n_batch - n_prefixes, f"n_batch {n_batch}")]
    bounds.append((cap, f"the tick's cost (at most {cap})"))
    count, why = min(bounds, key=lambda bound: bound[0])
    if count < 1:
        return SlotCount(1, f"1 slot: {why} holds no more")
    return SlotCount(count, f"{count} slots, bounded by {why}")


def resolved_slots(config: EngineConfig) -> int:
    """``config.n_parallel`` once the load chose it (``kv_memory.plan_config``)."""
    if config.n_parallel is None:
        raise ValueError("n_parallel=None is chosen at load: resolve the config with kv_memory.plan_config")
    return config.n_parallel
