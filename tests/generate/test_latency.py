"""Latency-aware scheduling over the fake llama.cpp: ``target_itl_ms`` budgets and priorities.

The fake context scripts each decode's time (``FakeContext.cost``: fixed, per token, per
output, per attended KV cell) and the core times decodes with the fake's clock, so the cost
model sees exact times and the budgets it picks can be asserted exactly.
"""

from __future__ import annotations

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt

from llamabatch import EngineConfig, SamplingParams
from llamabatch.generate.admission import LatencyAdmission, PriorityAdmission
from llamabatch.generate.cost_model import DecodeCostModel, LatencyBudget, TickFeatures
from llamabatch.generate.priority import MAX_PRIORITY_PREEMPTIONS
from llamabatch.generate.request import RequestStatus
from llamabatch.generate.slo import SLO_HEADROOM, SLOAdmission
from llamabatch.runtime.telemetry import Telemetry, TickEvent

COST = (0.010, 0.001, 0.002, 0.0)  # 10 ms a decode, 1 ms a token, 2 ms an output row


def latency_core(target_itl_ms, *, kv_unified=False, cost=COST, prior=None, n_parallel=4):
    ticks: list[TickEvent] = []
    telemetry = Telemetry()
    telemetry.add_listener(lambda e: ticks.append(e) if isinstance(e, TickEvent) else None)
    core, ctx, model = make_core(
        n_parallel=n_parallel,
        n_ctx=1024 * n_parallel,
        kv_unified=kv_unified,
        n_batch=512,
        chunk_size=512,
        telemetry=telemetry,
        target_itl_ms=target_itl_ms,
    )
    ctx.cost = cost
    core.clock = ctx.clock
    if prior is not None:
        latency_of(core).model = DecodeCostModel(prior)
    return core, ctx, model, ticks


def latency_of(core):
    """The ``LatencyBudget`` of a core under ``target_itl_ms`` (its policy's layer)."""
    return latency_admission(core).latency


def latency_admission(core):
    """The ``LatencyAdmission`` layer of a core's admission policy (None: none)."""
    policy = core.admission
    while not isinstance(policy, LatencyAdmission):
        policy = getattr(policy, "inner", None)
        if policy is None:
            return None
    return policy


def decoding_then_long_prompt(core, ctx, model, *, n_long=600):
    """Three streams decoding, then a long prompt arrives: returns the recorder and the
    long request."""
    rec = Recorder(core, ctx, model)
    for seed in range(3):
        rec.new(prompt(4, seed), greedy(120))
    for _ in range(4):
        rec.step()
    (long,) = rec.new(prompt(n_long, 99), greedy(4))
    return rec, long


def test_config_checks_target():
    assert EngineConfig().target_itl_ms is None
    assert EngineConfig(target_itl_ms=50).target_itl_ms == 50
    for bad in (0, -1, float("inf"), float("nan"), "50", True):
        with pytest.raises(ValueError, match="target_itl_ms"):
            EngineConfig(target_itl_ms=bad)


def test_cli_flag_round_trip():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--target-itl-ms", "80"]))
    assert config.target_itl_ms == 80.0
    assert "--target-itl-ms" in config.to_cli_args()
    with pytest.raises(SystemExit):
        parser.parse_args(["--target-itl-ms", "0"])


def test_no_target_keeps_the_full_budget():
    core, ctx, model, ticks = latency_core(None)
    assert latency_admission(core) is None
    rec, _ = decoding_then_long_prompt(core, ctx, model)
    rec.step()
    assert ticks[-1].token_budget == 512 and ticks[-1].predicted_time is None
    assert ticks[-1].prefill_tokens == 509  # the whole budget: the decodes, then the prompt


def test_budget_follows_an_exact_model():
    """With the cost model's weights equal to the scripted costs, every tick's prefill is
    the most tokens whose predicted time fits the target: (target - decodes) / per token."""
    core, ctx, model, ticks = latency_core(100.5, prior=COST)
    rec, long = decoding_then_long_prompt(core, ctx, model)
    rec.step()
    tick = ticks[-1]
    # 3 decodes: 10 + 3 * 1 + 3 * 2 = 19 ms, plus the chunk's output row (2 ms): 79 tokens fit
    assert (tick.decode_tokens, tick.prefill_tokens) == (3, 79)
    assert tick.token_budget == 82
    # predicted for the batch decoded (the chunk's output row was planned, not needed): exact
    assert tick.predicted_time == pytest.approx(0.098, abs=1e-9) == tick.decode_time
    assert tick.decode_time <= 0.1005 + 1e-9
    rec.run()
    rec.check_done(long)
    prefill_ticks = [t for t in ticks if t.prefill_tokens and t.decode_tokens]
    assert all(t.decode_time <= 0.1005 + 1e-9 for t in ticks)
    assert len(prefill_ticks) >= 600 // 80


def test_floor_keeps_prefill_moving():
    """A target the decodes alone fill: a prompt being computed still moves one token a tick
    (the floor), and the tick overshoots the target by that one token only. (Admission keeps
    the decodes under the target; the floor is for a target that tightens after it, as the
    model's error margin or a slower machine make it.)"""
    core, ctx, model, ticks = latency_core(25.0, prior=COST)
    rec, long = decoding_then_long_prompt(core, ctx, model, n_long=200)
    rec.step()  # admitted: four streams decoding (10 + 4 * 3 = 22 ms) fit 25 ms
    assert ticks[-1].prefill_tokens > 0
    latency_of(core).target = latency_of(core).aim = 0.018
    rec.step()
    # 3 decodes: 10 + 3 * 1 + 3 * 2 = 19 ms > 18 ms; the floor's token (no output row) adds 1 ms
    assert (ticks[-1].decode_tokens, ticks[-1].prefill_tokens) == (3, 1)
    assert ticks[-1].predicted_time == pytest.approx(0.020)
    rec.run()
    rec.check_done(long)


def test_admission_waits_while_one_more_stream_would_overshoot():
    """Streams decoding alone cost 10 + 3 ms each: under 23 ms at most four decode at once
    (22 ms; five: 25 ms). The fifth and sixth requests wait in the queue with slots free, and
    start as streams end; none is lost, and no tick of decodes overshoots."""
    core, ctx, model, ticks = latency_core(23.0, prior=COST, n_parallel=6)
    rec = Recorder(core, ctx, model)
    requests = [rec.new(prompt(4, seed), greedy(20 + 10 * seed))[0] for seed in range(6)]
    rec.step()
    assert core.table.busy_slots == 4 and len(core.waiting) == 2
    rec.run()
    for r in requests:
        rec.check_done(r)
    assert max(t.decode_tokens for t in ticks) == 4
    assert all(t.decode_time <= 0.023 + 0.002 + 1e-9 for t in ticks if t.decode_tokens)  # (+ the floor)


def test_model_learns_from_a_wrong_prior_and_follows_drift():
    """From the default (slow) prior the ticks start short, then fill the target within a
    few ticks; when the machine gets 30% slower, the model follows within a few dozen."""
    core, ctx, model, ticks = latency_core(100.0)
    rec = Recorder(core, ctx, model)
    for seed in range(3):
        rec.new(prompt(4, seed), greedy(400))
    for i in range(12):
        rec.new(prompt(300, 100 + i), greedy(2), priority=1)
    rec.run()
    # the first tick has no stream to wait on it: no limit; a couple of ticks later the model fits
    assert ticks[0].decode_tokens == 0 and ticks[0].token_budget == 512
    warm = [t for t in ticks[5:] if t.prefill_tokens and t.decode_tokens == 3]
    assert warm, "no mixed ticks after warm-up"
    assert max(t.decode_time for t in warm) <= 0.1 * 1.05
    assert max(t.prefill_tokens for t in warm) >= 70  # not collapsed to the floor
    # 30% slower machine
    slow = tuple(c * 1.3 for c in COST)
    ctx.cost = slow  # type: ignore[assignment]
    n_before = len(ticks)
    for seed in range(3):
        rec.new(prompt(4, 200 + seed), greedy(400))
    for i in range(12):
        rec.new(prompt(300, 300 + i), greedy(2), priority=1)
    rec.run()
    late = [t for t in ticks[n_before + 20 :] if t.prefill_tokens and t.decode_tokens == 3]
    assert late
    assert max(t.decode_time for t in late) <= 0.1 * 1.05
    assert max(t.prefill_tokens for t in late) >= 50


def test_budget_unit():
    model = DecodeCostModel((0.01, 0.001, 0.0, 0.0))
    assert model.predict(TickFeatures(100, 1, 0.0)) == pytest.approx(0.11)
    for _ in range(200):  # converges to the truth: 5 ms + 2 ms a token
        for n in (1, 8, 64):
            model.observe(TickFeatures(n, min(n, 8), 0.0), 0.005 + 0.002 * n)
    assert model.predict(TickFeatures(32, 8, 0.0)) == pytest.approx(0.005 + 0.064, rel=0.02)
    with pytest.raises(ValueError, match="forgetting"):
        DecodeCostModel(forgetting=0.1)


def test_budget_aims_below_the_target_by_the_models_recent_error():
    """Ticks that come out 30% above or below the model's line (a kernel that changes speed
    with the batch's shape): the plans aim at target / 1.3, so the slow ticks fit too; an
    exact model keeps the aim at the target."""
    noisy = LatencyBudget(0.05, 512, model=DecodeCostModel((0.01, 0.001, 0.0, 0.0)))
    exact = LatencyBudget(0.05, 512, model=DecodeCostModel((0.01, 0.001, 0.0, 0.0)))
    for i in range(200):
        features = TickFeatures(8 + i % 5, 4, 0.0)
        truth = 0.01 + 0.001 * features.tokens
        noisy.observe(features, truth * (1.3 if i % 2 else 0.7))
        exact.observe(features, truth)
    assert noisy.aim == pytest.approx(0.05 / 1.3, rel=0.05)
    assert exact.aim == pytest.approx(0.05)


def test_an_slo_budget_aims_under_the_largest_recent_error():
    """An SLO bounds every gap: its budget aims under the largest error of its window (one
    tick in ten 1.5x slow: the aim is target / 1.5, where the 90th percentile gives about
    1), and under ``first_margin`` until a quarter of the window is measured."""

    def budget(**kw):
        return LatencyBudget(0.05, 512, model=DecodeCostModel((0.01, 0.001, 0.0, 0.0)), **kw)

    slo, p90 = budget(margin_quantile=1.0, error_window=256, first_margin=1.5), budget()
    # and the SLO policy's own: 5% under the largest error (a new tick exceeds the largest of
    # 256 about once in 257 ticks, and breaks the SLO of every stream in it)
    slo_policy = SLOAdmission(PriorityAdmission(), ttft=None, itl=0.05, n_batch=512).latency
    slo_policy.model = DecodeCostModel((0.01, 0.001, 0.0, 0.0))
    assert slo.aim == pytest.approx(0.05 / 1.5) and p90.aim == pytest.approx(0.05)
    for i in range(200):
        features = TickFeatures(8, 4, 0.0)
        truth = (0.01 + 0.008) * (1.5 if i % 10 == 0 else 1.0)
        for b in (slo, p90, slo_policy):
            b.observe(features, truth)
    assert slo.aim == pytest.approx(0.05 / 1.5, rel=0.1)
    assert slo_policy.aim == pytest.approx(slo.aim / SLO_HEADROOM)
    assert p90.aim > 0.05 / 1.2
    with pytest.raises(ValueError, match="margin_quantile"):
        budget(margin_quantile=0.0)
    with pytest.raises(ValueError, match="headroom"):
        budget(headroom=0.9)


# -- priorities -------------------------------------------------------------------------


@pytest.mark.parametrize("kv_unified", [False, True])
def test_admission_goes_by_priority_then_arrival(kv_unified):
    core, ctx, model = make_core(n_parallel=1, kv_unified=kv_unified, n_ctx=256)
    rec = Recorder(core, ctx, model)
    (a,) = rec.new(prompt(4, 1), greedy(3))
    rec.step()
    (low,) = rec.new(prompt(4, 2), greedy(3), priority=5)
    (mid1,) = rec.new(prompt(4, 3), greedy(3), priority=1)
    (mid2,) = rec.new(prompt(4, 4), greedy(3), priority=1)
    order = [a]
    while core.has_unfinished():
        rec.step()
        r = core.running[0]
        if r is not None and (not order or order[-1] is not r):
            order.append(r)
    # ``a`` (priority 0) is not preempted by waiting priorities 1 and 5 (higher numbers)
    assert order == [a, mid1, mid2, low]
    assert a.n_preemptions == 0
    for r in (a, low, mid1, mid2):
        rec.check_done(r)


@pytest.mark.parametrize("kv_unified", [False, True])
def test_higher_priority_preempts_latest_admitted_lower(kv_unified):
    core, ctx, model = make_core(n_parallel=2, kv_unified=kv_unified, n_ctx=256)
    rec = Recorder(core, ctx, model)
    (first,) = rec.new(prompt(4, 1), greedy(20), priority=3)
    rec.step()
    (second,) = rec.new(prompt(4, 2), greedy(20), priority=3)
    rec.step()
    rec.step()
    assert second.status is RequestStatus.RUNNING and first.status is RequestStatus.RUNNING
    (urgent,) = rec.new(prompt(4, 3), greedy(5), priority=0)
    rec.step()
    # the latest admitted of the lower priority gave its slot; the urgent one runs now
    assert second.status is RequestStatus.WAITING or second.status is RequestStatus.PREEMPTED
    assert second.n_preemptions == 1 and first.n_preemptions == 0
    assert urgent.status is RequestStatus.RUNNING
    assert core.counters.preemptions == 1
    rec.run()
    for r in (first, second, urgent):
        rec.check_done(r)  # the preempted request's tokens are those it makes alone


def test_equal_priorities_never_preempt():
    core, ctx, model = make_core(n_parallel=1, n_ctx=256)
    rec = Recorder(core, ctx, model)
    (a,) = rec.new(prompt(4, 1), greedy(10), priority=2)
    rec.step()
    (b,) = rec.new(prompt(4, 2), greedy(10), priority=2)
    rec.run()
    assert core.counters.preemptions == 0
    rec.check_done(a)
    rec.check_done(b)


def test_preemption_bound_no_starvation():
    """A low-priority request is preempted for priority at most MAX_PRIORITY_PREEMPTIONS
    times, then runs to its end whatever arrives."""
    core, ctx, model = make_core(n_parallel=1, n_ctx=256)
    rec = Recorder(core, ctx, model)
    (low,) = rec.new(prompt(4, 1), greedy(30), priority=9)
    for i in range(10):
        rec.step()
        rec.step()
        rec.new(prompt(4, 10 + i), greedy(2), priority=0)
        while core.running[0] is not low and core.has_unfinished():
            rec.step()
    assert low.n_preemptions == MAX_PRIORITY_PREEMPTIONS
    rec.run()
    rec.check_done(low)


def test_priority_is_checked():
    from llamabatch.generate.priority import check_priority

    assert check_priority(-3) == -3
    for bad in (1.5, "1", True, None, 2**40):
        with pytest.raises(ValueError, match="priority"):
            check_priority(bad)


def test_llm_engine_priority(monkeypatch):
    from fake_llama import patch_llamabatch

    from llamabatch import LLMEngine

    patch_llamabatch(monkeypatch)
    engine = LLMEngine("fake.gguf", n_parallel=1, n_ctx=256, n_batch=64)
    try:
        a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0), priority=5)
        engine.step()
        b = engine.add_request([4, 5, 6], SamplingParams(max_tokens=3, temperature=0), priority=0)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
        assert finished == [b, a]
        with pytest.raises(ValueError, match="priority"):
            engine.add_request([1], priority="high")  # type: ignore[arg-type]
    finally:
        engine.close()


def test_latency_tracker(monkeypatch):
    from fake_llama import patch_llamabatch

    from llamabatch import LLMEngine
    from llamabatch.runtime.latency import LatencyTracker

    patch_llamabatch(monkeypatch)
    tracker = LatencyTracker()
    assert tracker.summary() == {
        "requests": 0,
        **{f"ttft_p{p}_ms": None for p in (50, 90, 99)},
        **{f"itl_p{p}_ms": None for p in ("50", "90", "99", "99_9")},
        "itl_max_ms": None,
    }
    with LLMEngine("fake.gguf", n_parallel=2, n_ctx=256, n_batch=64) as engine:
        engine.add_listener(tracker)
        for i in range(3):
            engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        outputs = engine.run_until_complete()
    summary = tracker.summary(slo_ttft_ms=1e6, slo_itl_ms=1e6)
    assert summary["requests"] == 3 and summary["goodput"] == 1.0
    assert 0 <= summary["itl_p50_ms"] <= summary["itl_p99_9_ms"] <= summary["itl_max_ms"]
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    for out in outputs:
        t = out.timings
        assert t.itl_p50 is not None and 0 <= t.itl_p50 <= t.itl_p99 <= t.itl_max
    assert tracker.summary(slo_itl_ms=1e-9)["goodput"] == 0.0
    tracker.clear()
    assert tracker.summary()["requests"] == 0
