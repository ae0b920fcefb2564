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

import pytest
from fake_llama import FakeContext, FakeLlamaError, FakeModel, make_core
from fake_scheduling import Recorder, greedy, oversubscribed, prompt

from llamabatch import QueueFull, SamplingParams
from llamabatch.runtime.telemetry import RequestEvent, Telemetry, TickEvent

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


def test_preemption_takes_the_latest_arrival_back_to_the_front_of_the_queue():
    core, rec = oversubscribed()
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
    core, rec = oversubscribed(n_ctx=48, n_parallel=3, telemetry=telemetry)
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
    core, rec = oversubscribed(n_ctx=48, n_parallel=2)
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
    core, rec = oversubscribed(n_ctx=96, n_parallel=4, n_batch=32, chunk_size=16)
    requests = [rec.new(prompt(8 + (i * 7) % 30, i), greedy(10 + (i * 5) % 40))[0] for i in range(14)]
    steps = rec.run(max_steps=2000)
    assert core.counters.preemptions > 0
    for r in requests:
        rec.check_done(r)
        assert r.finish_reason == "length"
    assert requests[0].n_preemptions == 0
    assert max(r.n_preemptions for r in requests) <= len(requests)
    assert steps < 2000
