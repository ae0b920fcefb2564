"""Benchmarks of the Cython scheduler core (llamabatch._core).

One class per operation, all preparation in ``setup``:

- ``TimeFill``: one batch fill under each strategy, 8 to 256 slots (7/8 decoding, 1/8
  prefilling a long prompt), ``n_batch`` 512; ``fill`` + ``rollback`` so the table is the
  same at every repeat.
- ``TimeTick``: a whole tick as the engine runs it (fill, commit, accept every output).
- ``TimePool``: ``BatchPool.acquire`` + ``release``.
- ``PeakmemTable``: memory of a slot table (token histories are preallocated).
- ``TrackSpeedup``: how many times faster than the pure-Python reference
  (``tests/reference_scheduler.py``) the core builds the same batch, measured side by side.

Run ``python asv_bench/benchmarks/bench_core.py`` for the issue's target figures.
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import numpy as np

from llamabatch._core import BatchPool, SlotTable

_TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import reference_scheduler as ref  # noqa: E402

STRATEGIES = ("decode_maximal", "prefill_priority", "balanced")
N_CTX_SEQ = 4096
PROMPT = 2000  # tokens of each prefilling slot's prompt


def _fill(table, batch, strategy, n_batch):
    if isinstance(table, SlotTable):
        return table.fill(batch, strategy, n_batch)
    return table.fill(strategy, n_batch)


def busy_table(kind, n_slots, n_decode, chunk_size=512):
    """A table with ``n_decode`` slots decoding and the others prefilling a long prompt."""
    table = kind(n_slots, N_CTX_SEQ, chunk_size)
    pool = BatchPool(n_slots * 8)
    batch = pool.acquire()
    for slot in range(n_decode):
        table.start(slot, np.arange(8, dtype=np.int32) + slot)
    while any(table.n_pending(s) for s in range(n_decode)):
        _fill(table, batch, "prefill_priority", n_slots * 8)
        table.commit()
    for slot in range(n_decode):
        table.accept(slot, 1000 + slot)
    for slot in range(n_decode, n_slots):
        table.start(slot, np.arange(PROMPT, dtype=np.int32) + slot)
    pool.release(batch)
    return table


class TimeFill:
    params = (STRATEGIES, (8, 64, 256))
    param_names = ("strategy", "n_slots")

    def setup(self, strategy, n_slots):
        self.table = busy_table(SlotTable, n_slots, n_slots - max(1, n_slots // 8))
        self.pool = BatchPool(512)
        self.batch = self.pool.acquire()

    def time_fill(self, strategy, n_slots):
        self.table.fill(self.batch, strategy, 512)
        self.table.rollback()


class TimeTick:
    params = (STRATEGIES, (8, 64, 256))
    param_names = ("strategy", "n_slots")

    def setup(self, strategy, n_slots):
        self.table = busy_table(SlotTable, n_slots, n_slots - max(1, n_slots // 8))
        self.pool = BatchPool(512)
        self.batch = self.pool.acquire()
        self.prompt = np.arange(PROMPT, dtype=np.int32)

    def time_tick(self, strategy, n_slots):
        t = self.table
        t.fill(self.batch, strategy, 512)
        t.commit()
        for slot, _idx in t.outputs():
            if t.room(slot) > 0:
                t.accept(slot, 7)
            else:
                t.finish(slot)
                t.start(slot, self.prompt)


class TimePool:
    params = (512, 4096)
    param_names = ("n_batch",)

    def setup(self, n_batch):
        self.pool = BatchPool(n_batch, prealloc=2)

    def time_acquire_release(self, n_batch):
        self.pool.release(self.pool.acquire())


class PeakmemTable:
    params = (8, 64, 256)
    param_names = ("n_slots",)

    def setup(self, n_slots):
        pass

    def peakmem_table(self, n_slots):
        SlotTable(n_slots, N_CTX_SEQ)


def measure(n_slots=64, n_decode=56, strategy="decode_maximal", n_batch=512, repeat=5):
    """Seconds per fill for the core and the reference on the same table, side by side."""
    core = busy_table(SlotTable, n_slots, n_decode)
    reference = busy_table(ref.ReferenceTable, n_slots, n_decode)
    pool = BatchPool(n_batch)
    batch = pool.acquire()
    core.fill(batch, strategy, n_batch)
    assert batch.entries() == reference.fill(strategy, n_batch)  # the same batch
    core.rollback()
    reference.rollback()

    def core_tick():
        core.fill(batch, strategy, n_batch)
        core.rollback()

    def ref_tick():
        reference.fill(strategy, n_batch)
        reference.rollback()

    t_core = min(timeit.repeat(core_tick, number=20_000, repeat=repeat)) / 20_000
    t_ref = min(timeit.repeat(ref_tick, number=50, repeat=repeat)) / 50
    pool.release(batch)
    return t_core, t_ref


class TrackSpeedup:
    params = STRATEGIES
    param_names = ("strategy",)
    unit = "times faster than the reference"

    def setup(self, strategy):
        pass

    def track_speedup(self, strategy):
        t_core, t_ref = measure(strategy=strategy, repeat=3)
        return t_ref / t_core


def main():
    print("one full tick: 64 slots (56 decoding + 8 prefilling), n_batch 512, chunk_size 512")
    for strategy in STRATEGIES:
        t_core, t_ref = measure(strategy=strategy)
        print(
            f"  {strategy:17s} core {t_core * 1e6:7.2f} us   reference {t_ref * 1e6:9.1f} us"
            f"   speedup {t_ref / t_core:7.1f}x"
        )


if __name__ == "__main__":
    main()
