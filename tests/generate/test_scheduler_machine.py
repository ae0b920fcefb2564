"""A hypothesis state machine over the engine core and the fake llama.cpp (``fake_llama.py``):
random arrivals (shared prefixes, n > 1, sampled requests), cancellations, steps, scripted
KV-full codes and pinned prefixes, on both KV layouts, with prefix reuse on and off; the
invariants are checked after every step (``check_core``) and every completion against what it
would have produced alone. ``test_speculative_fake.py`` and ``test_spec_suffix.py`` extend it."""

from __future__ import annotations

import random

from fake_llama import FakeModel, make_core
from fake_scheduling import Recorder, check_core, greedy, prompt
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llamabatch import SamplingParams
from llamabatch.generate.kv_cache import PinnedPrefix
from llamabatch.generate.ram_cache import RamCache
from llamabatch.generate.request import Request
from llamabatch.runtime.telemetry import Telemetry, TickEvent

# -- the state machine ----------------------------------------------------------------------

BUILTINS = ["decode_maximal", "prefill_priority", "balanced"]
MAX_REQUESTS = 30


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (shared prefixes, n > 1, sampled requests), cancellations, steps,
    scripted decode codes and pinned prefixes, on either KV layout, reuse on or off."""

    @initialize(
        kv_unified=st.booleans(),
        reuse=st.booleans(),
        n_parallel=st.integers(1, 4),
        unified_cells=st.integers(24, 160),
        stream_cells=st.integers(16, 48),
        chunk_size=st.sampled_from([3, 16, 64]),
        n_batch=st.integers(4, 64),
        n_ubatch=st.sampled_from([None, 2, 8]),
        strategy=st.sampled_from(BUILTINS),
        partial_kv_full=st.booleans(),
        natural_eog=st.booleans(),
        pins=st.booleans(),
        seed=st.integers(0, 2**16),
        target_itl_ms=st.sampled_from([None, None, 25.0]),
        ram_budget=st.sampled_from([0, 300, 1200, 1 << 20]),
        ram_block=st.sampled_from([2, 8, 32]),
    )
    def setup(
        self,
        kv_unified,
        reuse,
        n_parallel,
        unified_cells,
        stream_cells,
        chunk_size,
        n_batch,
        n_ubatch,
        strategy,
        partial_kv_full,
        natural_eog,
        pins,
        seed,
        target_itl_ms,
        ram_budget,
        ram_block,
    ):
        n_pinned = 1 if pins and reuse else 0
        n_seq = n_parallel + n_pinned
        n_ctx = unified_cells if kv_unified else stream_cells * n_seq
        self.ticks: list[TickEvent] = []
        telemetry = Telemetry()
        telemetry.add_listener(lambda e: self.ticks.append(e) if isinstance(e, TickEvent) else None)
        self.core, self.ctx, self.model = make_core(
            n_parallel=n_parallel,
            n_ctx=n_ctx,
            kv_unified=kv_unified,
            prefix_cache=reuse,
            max_prefixes=n_pinned,
            n_batch=max(n_batch, n_seq),
            n_ubatch=n_ubatch,
            chunk_size=chunk_size,
            strategy=strategy,
            partial_kv_full=partial_kv_full,
            model=FakeModel(natural_eog=natural_eog),
            telemetry=telemetry,
            target_itl_ms=target_itl_ms,
        )
        if target_itl_ms is not None:  # a scripted decode time: the budgets follow it
            self.ctx.cost = (0.004, 0.0005, 0.001, 1e-6)
            self.core.clock = self.ctx.clock
        if self.core.kv.ram is not None:  # the host-RAM tier (cache_ram): off, tiny budgets, room
            self.core.kv.ram = RamCache(ram_budget, block=ram_block) if ram_budget else None
        self.rec = Recorder(self.core, self.ctx, self.model)
        rng = random.Random(seed)
        self.bases = [[rng.randrange(1, 64) for _ in range(40)] for _ in range(3)]
        self.pins: list[PinnedPrefix] = []
        self.pinners: dict[Request, PinnedPrefix] = {}
        self.checked: set[Request] = set()

    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx_seq

    @rule(
        data=st.data(),
        base=st.integers(-1, 2),
        n_base=st.integers(1, 40),
        n_own=st.integers(0, 12),
        max_tokens=st.integers(1, 24),
        n=st.sampled_from([1, 1, 1, 1, 2, 3]),
        sampled=st.booleans(),
    )
    @precondition(lambda self: len(self.rec.requests) < MAX_REQUESTS)
    def arrive(self, data, base, n_base, n_own, max_tokens, n, sampled):
        own = prompt(n_own, data.draw(st.integers(0, 2**16)))
        tokens = (self.bases[base][:n_base] if base >= 0 else []) + own
        tokens = tokens[: self.n_ctx_seq - 1] or [5]
        if sampled and data.draw(st.booleans()):
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=len(self.rec.requests))
        else:
            params = greedy(max_tokens)
        # mostly the default priority; some higher (lower numbers) and lower ones
        priority = data.draw(st.sampled_from([0, 0, 0, -1, 1, 2]))
        self.rec.new(tokens, params, n=n, priority=priority)

    @rule(data=st.data(), now=st.integers(0, 3))
    @precondition(lambda self: any(not r.done for r in self.rec.requests))
    def cancel(self, data, now):
        if now:  # (a quarter of the draws: cancellations stay the exception)
            return
        live = [r for r in self.rec.requests if not r.done]
        self.core.abort(data.draw(st.sampled_from(live)))

    @rule(n=st.integers(1, 8))
    def step(self, n):
        for _ in range(n):
            self.rec.step()
            self._settle_pins()

    @rule(code=st.sampled_from([1, 1, 1, 1, 1, (1, 1), (1, 2), (1, 3), -3, (-3, 1), 2]))
    def script(self, code):
        self.ctx.script.append(code)

    @rule(data=st.data(), base=st.integers(0, 2), n=st.integers(2, 30))
    @precondition(lambda self: self.core.kv.reuse and self.core.kv._free_pin_seqs and not self.pinners)
    def pin(self, data, base, n):
        pinned = PinnedPrefix(self.core.kv.new_pin_seq(), self.bases[base][: min(n, self.n_ctx_seq - 1)])
        request = Request(pinned.tokens, greedy(1), pin=pinned)
        self.rec.add(request)
        self.pinners[request] = pinned

    @rule(data=st.data())
    @precondition(lambda self: bool(self.pins))
    def unpin(self, data):
        pinned = data.draw(st.sampled_from(self.pins))
        self.pins.remove(pinned)
        self.core.kv.unpin(pinned)

    @rule()
    def clear_prefix_cache(self):
        self.core.kv.clear()

    @rule(now=st.integers(0, 4))
    def fail_all(self, now):
        """A driver closing (or crashing) ends everything; the core stays usable."""
        if now:
            return
        events = self.core.fail_all("cancelled")
        assert all(e.finish_reason == "cancelled" and not e.token_ids for e in events)
        self.rec.record(events)
        self._settle_pins()

    def _settle_pins(self):
        # as LLM.register_prefix does: a pin that did not complete gives its sequence back
        for request, pinned in list(self.pinners.items()):
            if request.done:
                del self.pinners[request]
                if request.finish_reason == "stop":
                    self.pins.append(pinned)
                else:
                    self.core.kv.drop_pin_seq(pinned.seq_id)

    @invariant()
    def consistent(self):
        self.rec.check()
        ram = self.core.kv.ram
        if ram is not None:  # bytes within the budget, index and LRU agree
            ram.check()
            assert ram.restores + ram.restore_failures <= ram.hits
        assert self.core.counters.preemptions == sum(r.n_preemptions for r in self.rec.requests)
        for r in self.rec.requests:
            if r.done and r not in self.checked:
                self.rec.check_done(r)
                self.checked.add(r)

    def teardown(self):
        if not hasattr(self, "rec"):
            return
        self.ctx.script.clear()
        self.rec.run(max_steps=3000)
        self._settle_pins()
        for r in self.rec.requests:
            self.rec.check_done(r)
        assert sum(e.preemptions for e in self.ticks) == self.core.counters.preemptions
        if not self.core.kv.reuse:
            assert self.ctx.cells_used() == 0
        for pinned in self.pins:
            self.core.kv.unpin(pinned)
        self.core.kv.clear()
        check_core(self.core, self.ctx)
        assert self.ctx.cells_used() == 0 and self.core.table.cells_used == 0


TestSchedulerMachine = SchedulerMachine.TestCase
# the project's profile (tests/conftest.py: examples, deadline), with longer runs
TestSchedulerMachine.settings = settings(settings.default, stateful_step_count=100)
