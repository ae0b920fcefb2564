"""The adapter-set scheduler on fake slots (``generate/lora_schedule.py``): one set per tick,
switches amortised by the measured switch cost, no set starves."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch.generate.cost_model import TickFeatures
from llamabatch.generate.lora_schedule import (
    BASE,
    AdapterSetStrategy,
    LoraScheduler,
    SwitchCost,
    parse_lora_arg,
)
from llamabatch.params import SamplingParams
from llamabatch.strategies import DecodeMaximal


@dataclass
class FakeRegistry:
    loaded: list[str] = field(default_factory=list)

    def acquire(self, names: list[str]) -> list[str]:
        self.loaded.extend(n for n in names if n not in self.loaded)
        return list(names)


class FakeView:
    def __init__(self, decode: list[int], prefill: dict[int, int], n_parallel: int) -> None:
        self.decode_slots = decode
        self.prefill_slots = list(prefill)
        self.pending = prefill
        self.n_parallel = n_parallel

    def n_pending(self, slot: int) -> int:
        return self.pending[slot]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(lora: Any = (), priority: int = 0, client: Any = None) -> Any:
    return SimpleNamespace(params=SamplingParams(lora=lora), priority=priority, client=client)


def _scheduler(
    requests: list[Any], clock: Clock | None = None
) -> tuple[LoraScheduler, list[tuple[Any, ...]]]:
    applied: list[tuple[Any, ...]] = []
    context = object()
    scheduler = LoraScheduler(FakeRegistry(), lambda: context, lambda: requests, clock=clock or Clock())  # type: ignore[arg-type]
    scheduler.set_on_context = lambda ctx, adapters, scales: applied.append(
        tuple(zip(adapters, scales, strict=True))
    )
    return scheduler, applied


def test_each_tick_plans_one_adapter_set() -> None:
    requests = [_request(), _request(), _request("a"), _request("a"), _request({"a": 1.0, "b": 0.5})]
    scheduler, applied = _scheduler(requests)
    strategy = AdapterSetStrategy(DecodeMaximal(), scheduler)
    view = FakeView([0, 1, 2, 3], {4: 10}, 5)
    plan = list(strategy.plan(view, 64, 512, 0))
    sets = {scheduler.key_of(slot) for slot, _ in plan}
    assert len(sets) == 1 and sets == {scheduler.current}
    if scheduler.current == (("a", 1.0), ("b", 0.5)):
        assert plan == [(4, 10)] and applied[-1] == (("a", 1.0), ("b", 0.5))
    else:
        assert sorted(s for s, _ in plan) in ([0, 1], [2, 3])


def test_one_set_is_planned_by_the_inner_strategy_unchanged() -> None:
    requests = [_request("a")] * 3
    scheduler, applied = _scheduler(requests)
    view = FakeView([0, 2], {1: 7}, 3)
    plan = list(AdapterSetStrategy(DecodeMaximal(), scheduler).plan(view, 64, 4, 0))
    assert plan == list(DecodeMaximal().plan(view, 64, 4, 0))
    assert applied == [(("a", 1.0),)] and scheduler.current == (("a", 1.0),)


def test_base_requests_need_no_switch() -> None:
    scheduler, applied = _scheduler([_request(), _request()])
    list(AdapterSetStrategy(DecodeMaximal(), scheduler).plan(FakeView([0, 1], {}, 2), 8, 8, 0))
    assert applied == [] and scheduler.current == BASE and scheduler.n_switches == 0


def _run(
    requests: list[Any], ticks: int, tick_seconds: float = 0.01, switch_seconds: float = 0.0
) -> tuple[list[Any], list[float], float]:
    """Ticks with every slot runnable: the sets decoded, in order, the time each tick
    started, and the scheduler's starvation limit."""
    clock = Clock()
    scheduler, _ = _scheduler(requests, clock)
    scheduler.switch.seconds = switch_seconds
    for _ in range(40):  # a cost model that knows ticks take tick_seconds
        scheduler.switch.observe(TickFeatures(2, 2, 0.0), tick_seconds, switched=False)
    strategy = AdapterSetStrategy(DecodeMaximal(), scheduler)
    order, times = [], []
    view = FakeView(list(range(len(requests))), {}, len(requests))
    for _ in range(ticks):
        times.append(clock.now)
        plan = list(strategy.plan(view, 64, 512, 0))
        order.append(scheduler.key_of(plan[0][0]))
        clock.now += tick_seconds + (switch_seconds if scheduler.switched else 0.0)
        scheduler.switched = False
    return order, times, scheduler.starvation_limit()


def test_a_costly_switch_makes_runs_longer() -> None:
    requests = [_request(), _request(), _request("a"), _request("a")]
    cheap = _run(requests, 200, switch_seconds=0.0)[0]
    costly = _run(requests, 200, switch_seconds=0.05)[0]
    switches = [sum(a != b for a, b in pairwise(o)) for o in (cheap, costly)]
    assert switches[1] < switches[0]
    for order in (cheap, costly):
        assert {BASE, (("a", 1.0),)} == set(order)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    priorities=st.lists(st.integers(-3, 8), min_size=5, max_size=5),
    switch_ms=st.floats(0.0, 200.0),
)
def test_no_set_starves(sizes: list[int], priorities: list[int], switch_ms: float) -> None:
    requests = []
    for i, size in enumerate(sizes):
        lora = () if i == 0 else f"adapter{i}"
        requests += [_request(lora, priorities[i])] * size
    switch = switch_ms / 1000.0
    order, times, limit = _run(requests, 600, switch_seconds=switch)
    keys = {r.params.lora for r in requests}
    # every set runs again within the starvation limit (plus the ticks of the sets that
    # passed it at the same time, each with its switch)
    bound = limit + len(keys) * (0.01 + switch) + 1e-9
    last = dict.fromkeys(keys, 0.0)
    for t, key in zip(times, order, strict=True):
        for other in keys:
            assert t - last[other] <= bound, (other, t, last[other], limit)
        last[key] = t
    assert set(order) == keys


@pytest.mark.parametrize("switch_seconds", [0.0, 0.02])
def test_a_client_spreading_its_requests_over_sets_gets_no_more_ticks(switch_seconds: float) -> None:
    """One client's six requests, each in a set of its own (its own scale), beside another
    client's one base request: the base request's set runs at least as often as the six
    together (it ran one tick in seven or six when every set's one request counted alike),
    and the six still run, within the starvation limit."""
    requests = [_request({"a": 0.5 + i / 10}, client="many") for i in range(6)]
    requests.append(_request(client="one"))
    order = _run(requests, 280, switch_seconds=switch_seconds)[0]
    share = order.count(BASE) / len(order)
    assert share >= 0.5, share
    assert len(set(order)) == 7  # and every set of the other client still runs


def test_one_client_or_none_the_choice_is_unchanged() -> None:
    a = [_request(), _request(), _request("a"), _request("b")]
    named = [_request(r.params.lora, client="c") for r in a]
    assert _run(a, 100)[0] == _run(named, 100)[0]


def test_switch_cost_is_learnt_on_a_slow_machine() -> None:
    """Ticks of seconds and a switch of 50 ms: before a switch was measured, sets run a few
    ticks each (so ticks without a switch give the baseline); then the fitted cost is the
    switch's, and a switch that cheap next to a tick lets the sets alternate."""
    requests = [_request(), _request("a")]
    clock = Clock()
    scheduler, _ = _scheduler(requests, clock)
    strategy = AdapterSetStrategy(DecodeMaximal(), scheduler)
    view = FakeView([0, 1], {}, 2)
    order = []
    for _ in range(120):
        list(strategy.plan(view, 64, 512, 0))
        order.append(scheduler.current)
        elapsed = 2.5 + (0.05 if scheduler.switched else 0.0)
        clock.now += elapsed
        scheduler.observe(TickFeatures(1, 1, 0.0), elapsed)
    assert scheduler.switch.n_measured > 0
    assert scheduler.switch.seconds == pytest.approx(0.05, abs=0.02)
    early = sum(a != b for a, b in pairwise(order[:20]))
    assert early < 19  # runs of more than one tick until a switch was measured


def test_switch_cost_is_fitted_from_decodes() -> None:
    cost = SwitchCost(prior=0.5)
    features = TickFeatures(4, 4, 0.0)
    for _ in range(30):
        cost.observe(features, 0.010, switched=False)
    for i in range(10):  # one stalled tick among them changes nothing
        cost.observe(features, 30.0 if i == 3 else 0.013, switched=True)
    assert cost.n_measured == 10
    assert cost.seconds == pytest.approx(0.003, abs=0.001)


def test_parse_lora_arg() -> None:
    assert parse_lora_arg("sql=/a/sql.gguf") == ("sql", "/a/sql.gguf")
    assert parse_lora_arg("/models/my-adapter.gguf") == ("my-adapter", "/models/my-adapter.gguf")
    for bad in ("", "=x", "name="):
        with pytest.raises(ValueError, match="--lora"):
            parse_lora_arg(bad)


def test_a_request_without_adapter_room_is_passed_over_then_waited_for() -> None:
    from llamabatch.generate.admission import AdmissionPolicy, Verdict
    from llamabatch.generate.lora_schedule import LoraAdmission

    class Registry:
        def can_load(self, names: list[str]) -> bool:
            return False

    scheduler = SimpleNamespace(registry=Registry())
    policy = LoraAdmission(AdmissionPolicy(), scheduler, lambda r, e: None, patience=3)  # type: ignore[arg-type]
    request = SimpleNamespace(params=SamplingParams(lora="a"), arrival=7, request_id="r")
    verdicts = [policy.admits(request, 4, None, [0]) for _ in range(5)]  # type: ignore[arg-type]
    assert verdicts == [Verdict.PASS] * 3 + [Verdict.STOP] * 2
    base = SimpleNamespace(params=SamplingParams(), arrival=8, request_id="b")
    assert policy.admits(base, 4, None, [0]) is Verdict.ADMIT  # type: ignore[arg-type]
