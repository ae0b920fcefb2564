"""The Cython scheduler core: batch pool, slot table, batching strategies.

The per-tick hot path of the engine, with no Python object per token. It compiles
against ``llama.h`` for the ``llama_batch`` layout only: it never links libllama and
never calls a ``llama_*`` function (the cffi layer in ``llamabatch._ffi`` does).

- :mod:`llamabatch._core.batch`: ``BatchPool`` / ``Batch`` (preallocated ``llama_batch``).
- :mod:`llamabatch._core.slots`: ``SlotTable`` (the slot state machine, fill/commit).
- :mod:`llamabatch._core.slot_record`: ``SlotRecord`` (the table's base: each slot's state
  and each sequence's lengths and tokens, prefix matching) and ``SlotState``.
- :mod:`llamabatch._core.kv_record`: ``KVRecord`` (the KV cells: pool, reference counts,
  free list, LRU clock), owned by the slot table.
- :mod:`llamabatch._core.ubatch_runs`: the cheapest ubatch runs of a per-stream batch.
- :mod:`llamabatch._core.user_plans`: the ``TableView`` a user strategy's ``plan()`` gets,
  and the checks of what it returns.
- :mod:`llamabatch._core.strategies`: ``DecodeMaximal``, ``PrefillPriority``,
  ``Balanced``, ``get_strategy`` and the user strategy protocol.
"""

from __future__ import annotations

try:
    from llamabatch._core.batch import Batch, BatchPool
    from llamabatch._core.slots import EDGES, SlotState, SlotTable
    from llamabatch._core.strategies import (
        STRATEGIES,
        Balanced,
        DecodeMaximal,
        PrefillPriority,
        Strategy,
        get_strategy,
        strategy_name,
    )
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "llamabatch._core is not built: run `pip install -e . --no-build-isolation` "
        f"in the repository (Cython >= 3 needed). Original error: {exc}"
    ) from exc

__all__ = [
    "EDGES",
    "STRATEGIES",
    "Balanced",
    "Batch",
    "BatchPool",
    "DecodeMaximal",
    "PrefillPriority",
    "SlotState",
    "SlotTable",
    "Strategy",
    "get_strategy",
    "strategy_name",
]
