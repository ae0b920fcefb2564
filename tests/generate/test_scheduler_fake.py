"""The engine core's scheduling, tick by tick, over a fake llama.cpp (``fake_llama.py``).

In addition to the tests on real llama.cpp (``test_engine.py``), never instead: these run
in milliseconds, without sleeps, and script what ``llama_decode`` returns, so admission,
eviction, preemption, resume, cancellation and decode failures are checked step by step.
The fake's greedy "network" gives every completion a known expected token sequence, so a
request that was preempted and recomputed must produce exactly the tokens it would have
produced alone. A hypothesis state machine drives random arrivals, cancellations, steps
and scripted KV-full codes on both KV layouts, with prefix reuse on and off, and checks
the invariants after every step.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
from fake_llama import FakeContext, FakeLlamaError, FakeModel, FakeSampler, make_core, patch_llamabatch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llamabatch import LLM, LLMEngine, PromptTooLong, QueueFull, SamplingParams
from llamabatch._core.slots import SlotState
from llamabatch.generate.core import EngineCore
from llamabatch.generate.kv_cache import PinnedPrefix
from llamabatch.generate.ram_cache import RamCache
from llamabatch.generate.request import Request, RequestStatus
from llamabatch.runtime.telemetry import RequestEvent, Telemetry, TickEvent


def greedy(max_tokens: int = 8, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **options)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` tokens (ids 1..63), different for every seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(n)]


def check_core(core: EngineCore, ctx: FakeContext) -> None:
    """What must hold between steps: the slot table agrees with the fake's real cells,
    position by position and token by token; slots and requests agree."""
    table = core.table
    table.check_invariants()  # includes check_kv: reference counts equal the positions held
    ctx.check()
    assert table.cells_used == ctx.cells_used(), "cells accounted for != cells llama.cpp holds"
    for seq in range(table.n_seq):
        n = table.seq_len(seq)
        assert ctx.seq_positions(seq) == list(range(n)), f"seq {seq}: positions differ from seq_len {n}"
        assert ctx.seq_tokens(seq) == table.seq_tokens(seq).tolist(), f"seq {seq}: tokens differ"
    running = [r for r in core.running if r is not None]
    for slot in range(core.n_parallel):
        request = core.running[slot]
        assert (request is None) == (table.state(slot) == SlotState.IDLE), f"slot {slot}"
        if request is not None:
            assert not request.done
            assert table.history(slot).tolist() == request.prompt_tokens + request.output_tokens
        elif not core.kv.reuse:
            assert table.seq_len(slot) == 0, f"idle slot {slot} holds KV with reuse off"
    assert len({id(r) for r in running}) == len(running), "a request runs in two slots"
    assert not {id(r) for r in running} & {id(r) for r in core.waiting}, "a request both waits and runs"
    assert all(not r.done for r in core.waiting)


class Recorder:
    """Drives a core step by step, recording every event per request, checking the
    invariants after every step."""

    def __init__(self, core: EngineCore, ctx: FakeContext, model: FakeModel) -> None:
        self.core, self.ctx, self.model = core, ctx, model
        self.requests: list[Request] = []
        self.tokens: dict[Request, list[int]] = defaultdict(list)
        self.texts: dict[Request, list[str]] = defaultdict(list)
        self.ends: Counter[Request] = Counter()
        self.samplers: dict[Request, dict] = {}
        self.steps = 0

    def add(self, *requests: Request) -> list[Request]:
        self.core.add(list(requests))
        self.requests += requests
        return list(requests)

    def new(
        self, tokens: list[int], params: SamplingParams | None = None, n: int = 1, priority: int = 0
    ) -> list[Request]:
        """Queue ``n`` completions of ``tokens`` (a parallel-sampling group when n > 1)."""
        params = params or greedy()
        group: list[Request] = []
        for i in range(n):
            r = Request(
                list(tokens),
                params,
                index=i,
                request_id=group[0].request_id if group else None,
                leader=group[0] if i else None,
                priority=priority,
            )
            if not r.fast_greedy:
                seed = None if params.seed is None else params.seed + i
                r.sampler = FakeSampler(self.model, _with_seed(params, seed))
            group.append(r)
        return self.add(*group)

    def step(self) -> list:
        events = self.core.step()
        self.steps += 1
        self.record(events)
        return events

    def record(self, events: list) -> None:
        for event in events:
            request, text, token_ids, reason = event.request, event.text, event.token_ids, event.finish_reason
            assert event.status is (request.status if reason is not None else RequestStatus.RUNNING)
            assert self.ends[request] == 0, f"request {request.request_id}: an event after its end"
            self.texts[request].append(text)
            self.tokens[request] += token_ids
            if reason is not None:
                self.ends[request] += 1
                assert request.done and reason == request.finish_reason
        self.check()

    def check(self) -> None:
        check_core(self.core, self.ctx)
        for r in self.requests:
            assert self.ends[r] == (1 if r.done else 0), f"request {r.request_id} ended {self.ends[r]} times"

    def run(self, max_steps: int = 5000) -> int:
        """Step until nothing is left; fails if that takes more than ``max_steps``."""
        start = self.steps
        while self.core.has_unfinished():
            self.step()
            assert self.steps - start < max_steps, "no end in sight: endless preemption or a stuck queue"
        return self.steps - start

    def expected(self, r: Request) -> tuple[list[int], str]:
        sampler = None
        if r.sampler is not None:
            seed = None if r.params.seed is None else r.params.seed + r.index
            sampler = FakeSampler(self.model, _with_seed(r.params, seed))
        return self.model.completion(
            r.prompt_tokens, r.params.max_tokens, self.ctx.n_ctx_seq, r.params.ignore_eos, sampler
        )

    def check_done(self, r: Request) -> None:
        """A finished request: its stream equals its output, and its tokens are those it
        would have produced alone (a prefix of them when cancelled or failed)."""
        out = r.output
        assert out is not None and self.ends[r] == 1
        assert self.tokens[r] == out.token_ids, "streamed tokens != final tokens"
        assert "".join(self.texts[r]) == out.text, "streamed text != final text"
        assert out.timings.preemptions == r.n_preemptions
        assert out.usage.prompt_tokens == len(r.prompt_tokens)
        assert out.usage.completion_tokens == len(out.token_ids)
        assert 0 <= out.usage.reused_tokens <= len(r.prompt_tokens) - 1
        if r.pin is not None:
            return
        tokens, reason = self.expected(r)
        if out.finish_reason in ("stop", "length"):
            assert (out.token_ids, out.finish_reason) == (tokens, reason), f"request {r.request_id}"
        else:
            assert out.token_ids == tokens[: len(out.token_ids)], f"request {r.request_id}"


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    from dataclasses import replace

    return params if seed is None or seed == params.seed else replace(params, seed=seed % 2**32)


def slot_of(core: EngineCore, request: Request) -> int:
    return core.running.index(request)


# -- the fake itself ------------------------------------------------------------------------


def test_fake_unified_cells_are_shared_and_freed_when_no_sequence_holds_them():
    core, ctx, _ = make_core(n_parallel=3, n_ctx=32)
    core.batch.add_sequence(prompt(5, 1), 0)
    assert ctx.decode_address(core.batch.address) == 0
    assert ctx.cells_used() == 5 and ctx.seq_tokens(0) == prompt(5, 1)
    ctx.seq_cp(0, 1, 0, 3)  # shares cells: none is used
    assert ctx.cells_used() == 5 and ctx.seq_positions(1) == [0, 1, 2]
    ctx.seq_rm(0, -1, -1)
    assert ctx.cells_used() == 3  # seq 1 still holds 0..2
    ctx.seq_rm(1, 1, -1)
    assert ctx.cells_used() == 1 and ctx.seq_positions(1) == [0]
    core.batch.clear()
    core.batch.add_sequence(prompt(32, 2), 2)  # 32 cells, 31 free: no room, nothing written
    assert ctx.decode_address(core.batch.address) == 1
    assert ctx.cells_used() == 1 and ctx.seq_positions(2) == []
    ctx.check()


def test_fake_refuses_a_partial_copy_across_streams():
    model = FakeModel()
    ctx = FakeContext(model, n_ctx=64, n_seq_max=2, kv_unified=False)
    ctx.seq_cp(0, 1, -1, -1)  # whole streams: fine
    with pytest.raises(FakeLlamaError, match="whole"):
        ctx.seq_cp(0, 1, 0, 5)


def test_fake_rejects_positions_that_do_not_continue_the_cache():
    core, ctx, _ = make_core(n_parallel=1)
    core.batch.add(5, 0, 0)
    core.batch.add(6, 2, 0)  # a hole
    with pytest.raises(FakeLlamaError, match="consecutively"):
        ctx.decode_address(core.batch.address)


# -- admission ------------------------------------------------------------------------------


def test_admission_is_first_come_first_served():
    core, ctx, model = make_core(n_parallel=2)
    rec = Recorder(core, ctx, model)
    a, b, c, d = (rec.new(prompt(4, i), greedy(2 + i))[0] for i in range(4))
    rec.step()
    assert core.running == [a, b] and list(core.waiting) == [c, d]
    rec.step()  # a ends (2 tokens): its slot goes to c, not d
    assert a.done and not b.done
    rec.step()
    assert core.running[0] is c and list(core.waiting) == [d]
    rec.run()
    for r in (a, b, c, d):
        rec.check_done(r)
        assert r.finish_reason == "length" and r.n_preemptions == 0


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_completions_are_the_same_however_they_are_batched(kv_unified, prefix_cache):
    core, ctx, model = make_core(
        n_parallel=3, n_ctx=3 * 64, kv_unified=kv_unified, prefix_cache=prefix_cache, n_batch=16, chunk_size=8
    )
    rec = Recorder(core, ctx, model)
    base = prompt(20, 99)
    requests = []
    for i in range(8):
        requests += rec.new(base[: 5 + 2 * i] + prompt(i % 4, i), greedy(3 + i % 5), n=1 + (i == 3))
    rec.run()
    for r in requests:
        rec.check_done(r)
        assert r.finish_reason == "length"
    assert core.counters.preemptions == 0
    if prefix_cache:
        assert core.counters.reused_tokens > 0


def test_admission_reserves_the_cells_of_prompts_still_to_compute():
    """Four 28-token prompts, 64 cells: two fit (plus the watermark), so only two are
    admitted; the others wait for room, and nothing needs preempting."""
    core, ctx, model = make_core(n_parallel=4, n_ctx=64)
    assert core.watermark == 4
    rec = Recorder(core, ctx, model)
    requests = [rec.new(prompt(28, i), greedy(3))[0] for i in range(4)]
    rec.step()
    assert core.running[:2] == requests[:2] and core.running[2:] == [None, None]
    assert list(core.waiting) == requests[2:]
    rec.run()
    for r in requests:
        rec.check_done(r)
    assert core.counters.preemptions == 0


def test_a_request_waits_while_its_prompt_does_not_fit_and_blocks_the_queue():
    core, ctx, model = make_core(n_parallel=3, n_ctx=64)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(40, 1), greedy(10))[0]
    big = rec.new(prompt(30, 2), greedy(2))[0]  # 30 + watermark 3 > 64 - 40
    small = rec.new(prompt(3, 3), greedy(2))[0]  # would fit, but waits its turn
    for _ in range(5):
        rec.step()
        assert core.running[0] is a and list(core.waiting) == [big, small]
    rec.run()
    for r in (a, big, small):
        rec.check_done(r)
        assert r.finish_reason == "length"
    assert core.counters.preemptions == 0


@pytest.mark.parametrize(("n_prompt", "admitted"), [(22, True), (23, False)])
def test_admission_keeps_a_watermark_of_free_cells(n_prompt, admitted):
    core, ctx, model = make_core(n_parallel=2, n_ctx=64)
    assert core.watermark == 2
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(40, 1), greedy(20))[0]
    rec.step()  # a's prompt: 40 cells, 24 free
    b = rec.new(prompt(n_prompt, 2), greedy(2))[0]
    rec.step()
    assert (core.running[1] is b) == admitted
    rec.run()
    rec.check_done(a)
    rec.check_done(b)
    assert a.finish_reason == b.finish_reason == "length"


def test_one_stream_per_sequence_admits_whatever_fits_a_slot():
    core, ctx, model = make_core(n_parallel=3, n_ctx=3 * 32, kv_unified=False)
    rec = Recorder(core, ctx, model)
    requests = [rec.new(prompt(30, i), greedy(5))[0] for i in range(4)]
    rec.step()
    assert core.running == requests[:3]
    rec.run()
    for r in requests:
        rec.check_done(r)
        assert r.finish_reason == "length" and len(r.output.token_ids) == 2  # the stream is full
    assert core.counters.preemptions == 0


@pytest.mark.parametrize("kv_unified", [True, False])
def test_parallel_samples_copy_the_leaders_prompt(kv_unified):
    core, ctx, model = make_core(n_parallel=3, kv_unified=kv_unified)
    rec = Recorder(core, ctx, model)
    leader, f1, f2 = rec.new(prompt(12, 1), greedy(4), n=3)
    rec.step()  # followers wait for the leader's prompt
    assert core.running[0] is leader and list(core.waiting) == [f1, f2]
    mark = len(ctx.log)
    rec.step()
    copies = [entry for entry in ctx.log[mark:] if entry[0] == "seq_cp"]
    if kv_unified:
        assert copies == [("seq_cp", 0, 1, 0, 11), ("seq_cp", 0, 2, 0, 11)]  # shared cells
    else:
        assert copies == [("seq_cp", 0, 1, -1, -1), ("seq_cp", 0, 2, -1, -1)]  # whole streams
        assert ("seq_rm", 1, 11, -1) in ctx.log[mark:]
    rec.run()
    for r in (leader, f1, f2):
        rec.check_done(r)
    assert f1.output.usage.reused_tokens == f2.output.usage.reused_tokens == 11


def test_a_request_always_starts_when_nothing_runs():
    core, ctx, model = make_core(n_parallel=2, n_ctx=32)
    rec = Recorder(core, ctx, model)
    r = rec.new(prompt(31, 1), greedy(5))[0]  # the whole pool: fits alone, context ends it
    rec.run()
    rec.check_done(r)
    assert r.finish_reason == "length" and len(r.output.token_ids) == 1


def test_a_full_queue_takes_nothing():
    core, ctx, model = make_core(n_parallel=1, max_queue=2)
    rec = Recorder(core, ctx, model)
    rec.new(prompt(3, 1), greedy(2))
    with pytest.raises(QueueFull):
        rec.new(prompt(3, 2), greedy(2), n=2)
    assert len(core.waiting) == 1 and len(rec.requests) == 1
    rec.run()
    rec.check_done(rec.requests[0])


# -- eviction -------------------------------------------------------------------------------


def test_idle_cached_prefixes_are_evicted_least_recently_used_first():
    core, ctx, model = make_core(n_parallel=5, n_ctx=128, prefix_cache=True)
    assert core.watermark == 5
    rec = Recorder(core, ctx, model)
    for i in range(3):  # a, b, c: each runs alone and leaves 21 cells cached in its slot
        rec.new(prompt(20, 10 + i), greedy(2))
        rec.run()
    slots = [s for s in range(5) if core.table.seq_len(s)]
    assert slots == [0, 1, 2] and [core.table.seq_len(s) for s in slots] == [21, 21, 21]
    long_runner = rec.new(prompt(10, 20), greedy(60))[0]
    rec.step()
    assert core.running[3] is long_runner and ctx.cells_used() == 63 + 10
    # 60 + watermark 5 > 128 - 74 free: a's cache (least recently used) goes, no more
    d = rec.new(prompt(60, 21), greedy(2))[0]
    mark = len(ctx.log)
    rec.step()
    assert ctx.log[mark] == ("seq_rm", 0, -1, -1)  # evicted before d's prompt is decoded
    assert core.counters.evictions == 1 and core.running[4] is d  # d takes the unused slot
    assert core.table.seq_len(0) == 0 and core.table.seq_len(1) == 21 and core.table.seq_len(2) == 21
    rec.step()  # d's second token
    assert d.done and core.table.seq_len(4) == 61
    # 40 + 5 > 128 - (42 + 13 + 61): b's cache goes first, then c's, not d's (the newest)
    e = rec.new(prompt(40, 22), greedy(2))[0]
    mark = len(ctx.log)
    rec.step()
    removed = [entry[1] for entry in ctx.log[mark:] if entry[0] == "seq_rm"]
    assert removed[:2] == [1, 2] and core.counters.evictions == 3
    assert core.running[0] is e and core.table.seq_len(4) == 61  # d's cache stays
    rec.run()
    for r in rec.requests:
        rec.check_done(r)
    assert long_runner.finish_reason == "length" and e.finish_reason == "length"


def test_eviction_that_keeps_the_reused_prefix_still_goes_by_lru():
    core, ctx, model = make_core(n_parallel=4, n_ctx=96, prefix_cache=True)
    rec = Recorder(core, ctx, model)
    a_prompt, b_prompt = prompt(20, 1), prompt(20, 2)
    rec.new(a_prompt, greedy(1))
    rec.run()  # slot 0: a's 20 tokens (the oldest cache)
    rec.new(b_prompt, greedy(1))
    rec.new(prompt(20, 3), greedy(1))
    rec.run()  # slot 1: b's, slot 2: c's
    rec.new(b_prompt + prompt(5, 4), greedy(1))
    rec.run()  # reuses slot 1 in place: slot 1 is now the most recently used
    assert [core.table.seq_len(s) for s in range(4)] == [20, 25, 20, 0]
    runner = rec.new(prompt(10, 5), greedy(50))[0]
    rec.step()
    # 96 - 75 = 21 free; 20 new tokens + watermark 4 need one cache gone: not a's (the
    # prefix reused), then the least recently used: c's (slot 2), not slot 1's
    r = rec.new(a_prompt + prompt(20, 6), greedy(2))[0]
    rec.step()
    assert core.running[0] is r and core.counters.evictions == 1
    assert core.table.seq_len(2) == 0 and core.table.seq_len(1) == 25
    rec.run()
    rec.check_done(runner)


def test_eviction_keeps_the_prefix_the_new_request_reuses():
    core, ctx, model = make_core(n_parallel=3, n_ctx=96, prefix_cache=True)
    rec = Recorder(core, ctx, model)
    shared = prompt(30, 1)
    rec.new(shared, greedy(1))
    rec.run()  # slot 0 caches 30 tokens (the oldest cache)
    rec.new(prompt(30, 2), greedy(1))
    rec.run()  # slot 1 caches 30 tokens
    runner = rec.new(prompt(20, 3), greedy(40))[0]
    rec.step()
    # 96 - 80 = 16 free; the new request needs 15 + watermark 3 new cells: the LRU cache
    # is slot 0's, but that is the prefix it reuses: slot 1's goes instead
    r = rec.new(shared + prompt(15, 4), greedy(2))[0]
    rec.step()
    assert core.counters.evictions == 1 and core.table.seq_len(1) == 0
    assert core.running[0] is r and r.reused_tokens == 30
    rec.run()
    rec.check_done(r)
    rec.check_done(runner)


# -- preemption -----------------------------------------------------------------------------


def _oversubscribed(n_ctx=64, n_parallel=2, **options) -> tuple[EngineCore, Recorder]:
    core, ctx, model = make_core(n_parallel=n_parallel, n_ctx=n_ctx, **options)
    return core, Recorder(core, ctx, model)


def test_preemption_takes_the_latest_arrival_back_to_the_front_of_the_queue():
    core, rec = _oversubscribed()
    a = rec.new(prompt(20, 1), greedy(30))[0]
    b = rec.new(prompt(20, 2), greedy(30))[0]
    c = rec.new(prompt(5, 3), greedy(3))[0]
    while not core.counters.preemptions:
        rec.step()
        assert rec.steps < 100
    assert core.counters.preemptions == 1
    assert core.running[0] is a and core.running[1] is None
    assert list(core.waiting) == [b, c], "the preempted request goes first"
    assert b.n_preemptions == 1 and len(b.output_tokens) > 0
    # b (generated tokens appended) does not fit beside a: it waits, and blocks c
    rec.step()
    assert list(core.waiting) == [b, c]
    rec.run()
    for r in (a, b, c):
        rec.check_done(r)
        assert r.finish_reason == "length"
    assert a.n_preemptions == 0 and b.output.timings.preemptions == 1
    assert core.counters.preemptions == 1
    assert core.counters.recomputed_tokens >= len(b.prompt_tokens) + 1


def test_preempted_request_resumes_without_repeating_or_losing_a_delta():
    events = []
    telemetry = Telemetry()
    telemetry.add_listener(events.append)
    core, rec = _oversubscribed(n_ctx=48, n_parallel=3, telemetry=telemetry)
    requests = [rec.new(prompt(12, i), greedy(25))[0] for i in range(3)]
    rec.run()
    assert core.counters.preemptions >= 1
    for r in requests:
        rec.check_done(r)  # stream == final output == what it produces alone
        assert r.finish_reason == "length" and len(r.output.token_ids) == 25
    assert requests[0].n_preemptions == 0  # the oldest is never preempted
    ticks = [e for e in events if isinstance(e, TickEvent)]
    ends = [e for e in events if isinstance(e, RequestEvent)]
    assert sum(e.preemptions for e in ticks) == core.counters.preemptions
    assert sum(e.preemptions for e in ends) == core.counters.preemptions


def test_a_preempted_sampled_request_draws_what_it_would_have_drawn_alone():
    """The sampler chain (seeded RNG, penalty history) lives on across a preemption."""
    core, rec = _oversubscribed(n_ctx=48, n_parallel=2)
    params = SamplingParams(max_tokens=24, temperature=1.5, seed=7, repeat_penalty=1.3, ignore_eos=True)
    a = rec.new(prompt(12, 1), params)[0]
    b = rec.new(prompt(12, 2), params)[0]
    rec.run()
    assert b.n_preemptions >= 1 and a.n_preemptions == 0
    assert core.counters.preemptions == b.n_preemptions
    for r in (a, b):
        rec.check_done(r)
        assert r.finish_reason == "length"
        assert r.output.token_ids != rec.model.completion(r.prompt_tokens, 24, 48)[0]  # not greedy


@pytest.mark.parametrize("kv_unified", [True, False])
def test_a_scripted_kv_full_preempts_then_resumes(kv_unified):
    core, ctx, model = make_core(n_parallel=3, kv_unified=kv_unified, prefix_cache=True)
    rec = Recorder(core, ctx, model)
    requests = [rec.new(prompt(6, i), greedy(8))[0] for i in range(3)]
    rec.step()
    rec.step()
    ctx.script.extend([1, 1])  # two KV-full decodes: preempt the two newest
    rec.step()
    assert core.counters.preemptions == 2
    assert [r.n_preemptions for r in requests] == [0, 1, 1]
    assert list(core.waiting) == requests[1:]  # oldest preempted first in the queue
    rec.run()
    for r in requests:
        rec.check_done(r)
        assert r.finish_reason == "length"


def test_preemptions_reach_telemetry_even_when_the_tick_fails():
    events = []
    telemetry = Telemetry()
    telemetry.add_listener(events.append)
    core, ctx, model = make_core(n_parallel=2, telemetry=telemetry)
    rec = Recorder(core, ctx, model)
    a = rec.new([5], greedy(2))[0]
    b = rec.new([6], greedy(2))[0]
    ctx.script.extend([1, 1])  # b is preempted, then a alone still finds no room: a fails
    rec.step()
    assert a.finish_reason == "error" and b.n_preemptions == 1
    rec.run()
    rec.check_done(b)
    assert core.counters.preemptions == 1
    assert sum(e.preemptions for e in events if isinstance(e, TickEvent)) == 1


def test_no_endless_preemption_everything_finishes():
    core, rec = _oversubscribed(n_ctx=96, n_parallel=4, n_batch=32, chunk_size=16)
    requests = [rec.new(prompt(8 + (i * 7) % 30, i), greedy(10 + (i * 5) % 40))[0] for i in range(14)]
    steps = rec.run(max_steps=2000)
    assert core.counters.preemptions > 0
    for r in requests:
        rec.check_done(r)
        assert r.finish_reason == "length"
    assert requests[0].n_preemptions == 0
    assert max(r.n_preemptions for r in requests) <= len(requests)
    assert steps < 2000


# -- cancellation ---------------------------------------------------------------------------


def test_cancelling_a_waiting_request_ends_it_once_without_running_it():
    core, ctx, model = make_core(n_parallel=1)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(5, 1), greedy(6))[0]
    b = rec.new(prompt(5, 2), greedy(6))[0]
    rec.step()
    core.abort(b)
    core.abort(b)
    rec.step()
    assert b.done and b.finish_reason == "cancelled" and b.output.token_ids == []
    assert b not in core.waiting and core.running[0] is a
    core.abort(b)  # after the end: nothing
    rec.run()
    rec.check_done(a)
    rec.check_done(b)
    assert a.finish_reason == "length"


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_cancelling_a_running_request_frees_its_slot_and_cells(prefix_cache):
    core, ctx, model = make_core(n_parallel=1, prefix_cache=prefix_cache)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(10, 1), greedy(20))[0]
    b = rec.new(prompt(10, 2), greedy(2))[0]
    for _ in range(4):
        rec.step()
    core.abort(a)
    rec.step()  # a ends first, then b is admitted into its slot in the same step
    assert a.finish_reason == "cancelled" and len(a.output.token_ids) == 4
    assert core.running[0] is b
    rec.run()
    rec.check_done(a)
    rec.check_done(b)
    if not prefix_cache:
        assert ctx.cells_used() == 0


def test_cancelling_a_preempted_request_keeps_what_it_generated():
    core, rec = _oversubscribed()
    a = rec.new(prompt(20, 1), greedy(30))[0]
    b = rec.new(prompt(20, 2), greedy(30))[0]
    while not b.n_preemptions:
        rec.step()
    generated = list(b.output_tokens)
    core.abort(b)
    rec.step()
    assert b.finish_reason == "cancelled" and b.output.token_ids == generated
    rec.run()
    rec.check_done(a)
    rec.check_done(b)


# -- decode failures ------------------------------------------------------------------------


def test_a_decode_error_fails_only_that_batch_and_the_engine_keeps_serving():
    core, ctx, model = make_core(n_parallel=3, n_batch=4)
    rec = Recorder(core, ctx, model)
    a, b, c = (rec.new([i + 1, i + 2], greedy(4))[0] for i in range(3))
    ctx.script.append(-3)
    rec.step()  # the batch holds a's and b's prompts (4 tokens), not c's
    assert a.finish_reason == "error" and b.finish_reason == "error"
    assert "fatal" in a.output.error
    assert not c.done
    d = rec.new(prompt(5, 4), greedy(4))[0]
    rec.run()
    for r in (a, b, c, d):
        rec.check_done(r)
    assert c.finish_reason == "length" and d.finish_reason == "length"


@pytest.mark.parametrize("kv_unified", [True, False])
def test_a_decode_failing_midway_leaves_no_cells_behind(kv_unified):
    core, ctx, model = make_core(n_parallel=2, n_ubatch=4, kv_unified=kv_unified)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(10, 1), greedy(3))[0]
    ctx.script.append((-3, 2))  # 8 cells written, then a failed compute
    rec.step()
    assert a.finish_reason == "error" and ctx.cells_used() == 0
    b = rec.new(prompt(10, 2), greedy(3))[0]
    ctx.script.append((1, 1))  # no room after one ubatch: 4 cells written, then retried smaller
    rec.run()
    rec.check_done(b)
    assert b.finish_reason == "length" and core.counters.decode_retries >= 1


def test_an_aborted_decode_is_an_error_unless_the_driver_is_closing():
    core, ctx, model = make_core(n_parallel=2)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(5, 1), greedy(5))[0]
    ctx.abort()
    rec.step()
    assert a.finish_reason == "error" and "aborted" in a.output.error
    assert not ctx.abort_requested  # cleared: the next decode runs
    b = rec.new(prompt(5, 2), greedy(5))[0]
    rec.step()
    core.stopping = True
    ctx.abort()
    rec.step()
    assert not b.done  # closing: no error; the driver ends it
    rec.record(core.fail_all("cancelled"))
    assert b.finish_reason == "cancelled"
    rec.check_done(b)


def test_a_request_that_cannot_fit_even_alone_fails_instead_of_looping():
    core, ctx, model = make_core(n_parallel=2, n_ctx=64)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(10, 1), greedy(4))[0]
    ctx.script.extend([1] * 100)  # no room, whatever is freed
    rec.step()
    assert a.finish_reason == "error" and "no room in the KV cache" in a.output.error
    ctx.script.clear()
    b = rec.new(prompt(10, 2), greedy(4))[0]
    rec.run()
    rec.check_done(b)
    assert b.finish_reason == "length"


def test_a_pinned_prefix_leaving_too_little_room_fails_the_request_in_bounded_steps():
    core, ctx, model = make_core(n_parallel=2, n_ctx=64, prefix_cache=True, max_prefixes=1)
    rec = Recorder(core, ctx, model)
    pin = PinnedPrefix(core.kv.new_pin_seq(), prompt(40, 1))
    pinner = Request(pin.tokens, greedy(1), pin=pin)
    rec.add(pinner)
    rec.run()
    assert pinner.finish_reason == "stop" and core.table.seq_len(pin.seq_id) == 40
    r = rec.new(prompt(40, 2), greedy(2))[0]  # 40 new cells; 24 are free
    rec.run(max_steps=100)
    assert r.finish_reason == "error"
    assert core.table.seq_len(pin.seq_id) == 40
    # a request starting with the pinned prefix computes only its own tail
    s = rec.new(pin.tokens + prompt(5, 3), greedy(3))[0]
    rec.run()
    rec.check_done(s)
    assert s.finish_reason == "length" and s.reused_tokens == 40


def test_a_pin_sequence_given_back_while_its_request_runs_is_not_pinned_into():
    """LLM.register_prefix gives the sequence back when its wait times out."""
    core, ctx, model = make_core(n_parallel=2, prefix_cache=True, max_prefixes=1, chunk_size=8)
    rec = Recorder(core, ctx, model)
    pin = PinnedPrefix(core.kv.new_pin_seq(), prompt(30, 1))
    pinner = Request(pin.tokens, greedy(1), pin=pin)
    rec.add(pinner)
    rec.step()  # 8 of 30 prompt tokens computed
    core.kv.drop_pin_seq(pin.seq_id)  # what LLM.register_prefix does when its wait times out
    rec.run()
    kv = core.kv
    assert not set(kv.pinned) & set(kv._free_pin_seqs), "a sequence both pinned and free"


# -- LLMEngine and LLM over the fake ----------------------------------------------------------


def _engine(monkeypatch, **options) -> tuple[LLMEngine, FakeModel]:
    model = patch_llamabatch(monkeypatch)
    engine = LLMEngine("fake.gguf", **options)
    engine.context.batch = engine.core.batch
    return engine, model


@pytest.mark.parametrize("kv_unified", [True, False])
def test_llm_engine_step_outputs_add_up_to_the_final_outputs(monkeypatch, kv_unified):
    engine, model = _engine(monkeypatch, n_ctx=256, n_parallel=4, n_batch=16, kv_unified=kv_unified)
    prompts = [prompt(6 + 5 * i, i) for i in range(6)]
    ids = [engine.add_request(p, greedy(12), request_id=f"r{i}") for i, p in enumerate(prompts)]
    group = engine.add_request(prompts[0], greedy(5, n=2))
    engine.abort_request("r5")
    tokens: dict = defaultdict(list)
    texts: dict = defaultdict(list)
    finished: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.index)
            assert key not in finished, "output after the end"
            tokens[key] += out.new_token_ids
            texts[key].append(out.text)
            if out.finished:
                finished[key] = out.output
                assert out.finish_reason == out.output.finish_reason
    assert set(finished) == {(i, 0) for i in ids} | {(group, 0), (group, 1)}
    for key, output in finished.items():
        assert tokens[key] == output.token_ids and "".join(texts[key]) == output.text
    assert finished[("r5", 0)].finish_reason == "cancelled"
    for i in range(5):
        expected = model.completion(prompts[i], 12, engine.n_ctx_seq)[0]
        assert finished[(f"r{i}", 0)].token_ids == expected
    assert finished[(group, 0)].token_ids == finished[(group, 1)].token_ids
    stats = engine.stats()
    assert stats.requests == 8 and stats.busy_slots == 0 and stats.queue_depth == 0
    engine.close()


def test_llm_engine_preempts_under_kv_pressure_and_counts_it(monkeypatch):
    engine, model = _engine(
        monkeypatch, n_ctx=64, n_parallel=4, n_batch=32, kv_unified=True, prefix_cache=False
    )
    prompts = [prompt(14, i) for i in range(6)]
    for p in prompts:
        engine.add_request(p, greedy(20))
    outs = engine.run_until_complete()
    assert [o.token_ids for o in outs] == [model.completion(p, 20, 64)[0] for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.preemptions == sum(o.timings.preemptions for o in outs)
    with pytest.raises(PromptTooLong):
        engine.add_request(prompt(60, 9), greedy(5))
    engine.close()


def test_llm_and_llm_engine_give_the_same_tokens(monkeypatch):
    model = patch_llamabatch(monkeypatch)
    options = dict(n_ctx=96, n_parallel=4, n_batch=16, kv_unified=True, prefix_cache=True)
    prompts = [prompt(5 + 3 * i, i % 5) for i in range(10)]
    with LLMEngine("fake.gguf", **options) as engine:
        for p in prompts:
            engine.add_request(p, greedy(9))
        via_engine = [o.token_ids for o in engine.run_until_complete()]
    with LLM("fake.gguf", **options) as llm:
        via_llm = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(9), use_tqdm=False)]
    assert via_engine == via_llm == [model.completion(p, 9, 96)[0] for p in prompts]


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
