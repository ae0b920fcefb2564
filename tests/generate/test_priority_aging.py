"""Aging of waiting requests' priorities over the fake llama.cpp (``fake_llama.py``), and a
hypothesis property of the queue order (``generate/priority.py``): no request waits forever
behind a stream of higher priorities."""

from __future__ import annotations

from collections import deque

import pytest
from fake_llama import make_core
from fake_scheduling import check_core, greedy, prompt
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch import EngineConfig, SamplingParams
from llamabatch.generate.priority import ClientTurns, enqueue, priority_victim
from llamabatch.generate.request import Request

DEFAULT_AGING = EngineConfig().priority_aging


def _stream_until_done(core, ctx, target: Request, *, priority: int, max_steps: int) -> int:
    """Add one request of ``priority`` every step (a continuous stream, as fast as the
    slots serve it) until ``target`` ends; returns the steps taken (fails past ``max_steps``)."""
    for step in range(max_steps):
        core.add([Request(prompt(4, 1000 + step), greedy(2), priority=priority)])
        core.step()
        if step % 64 == 0:
            check_core(core, ctx)
        if target.done:
            return step
    raise AssertionError(f"the request did not finish within {max_steps} steps of a stream")


@pytest.mark.parametrize("kv_unified", [False, True])
def test_a_default_request_finishes_behind_a_stream_of_priority_minus_100(kv_unified):
    """Before aging, a priority-0 request waited as long as priority -100 requests kept
    arriving. Now it gains a level per ``priority_aging`` admissions: it starts once about
    101 x priority_aging requests were admitted after it, and the stream cannot preempt it."""
    core, ctx, _ = make_core(n_parallel=2, n_ctx=512, kv_unified=kv_unified)
    assert core.config.priority_aging == DEFAULT_AGING > 0
    for i in range(4):  # the stream is under way when the request arrives
        core.add([Request(prompt(4, 500 + i), greedy(2), priority=-100)])
        core.step()
    target = Request(prompt(4, 7), greedy(3))
    core.add([target])
    bound = (100 + 2) * DEFAULT_AGING + len(core.waiting) + 8
    steps = _stream_until_done(core, ctx, target, priority=-100, max_steps=2 * bound)
    assert target.output is not None and target.output.finish_reason == "length"
    assert target.n_preemptions == 0  # once it ranks first, the stream cannot push it out
    assert steps <= bound


def test_aging_off_keeps_strict_priorities():
    """``priority_aging=0``: the order vLLM has, priorities only (the stream wins)."""
    core, _, _ = make_core(n_parallel=1, n_ctx=256, priority_aging=0)
    target = Request(prompt(4, 7), greedy(3))
    core.add([target])
    core.add([Request(prompt(4, 8), greedy(2), priority=-1)])
    for step in range(200):
        core.add([Request(prompt(4, 2000 + step), greedy(1), priority=-1)])
        core.step()
    assert not target.done and target.admitted_order == -1


def test_aging_protects_an_aged_request_from_preemption():
    """A request that waited its way in is not preempted by a newer request of a better
    priority that ranks behind it once aged (before aging: priority alone decided)."""
    core, ctx, _ = make_core(n_parallel=2, n_ctx=256, priority_aging=1)
    runner = Request(prompt(4, 1), greedy(60, ignore_eos=True), priority=-10)
    core.add([runner])
    core.step()
    old = Request(prompt(4, 2), greedy(30, ignore_eos=True), priority=3)
    core.add([old])
    for step in range(100):  # a stream of -5 in the other slot until ``old`` aged its way in
        if old.admitted_order >= 0:
            break
        core.add([Request(prompt(4, 100 + step), greedy(1), priority=-5)])
        core.step()
    assert old.admitted_order >= 0 and runner.status.name == "RUNNING"
    core.add([Request(prompt(4, 200), greedy(2), priority=0)])
    core.step()
    check_core(core, ctx)
    assert old.status.name == "RUNNING" and old.n_preemptions == 0


@pytest.mark.parametrize("clients", [False, True])
def test_clients_take_turns(clients):
    """One client queues ten requests, then another one: with clients named, the second
    client's request, its client holding no slot, runs next (``ClientSlots.newcomer_first``);
    without, first come, first served."""
    core, ctx, _ = make_core(n_parallel=1, n_ctx=256)
    flood = [Request(prompt(4, i), greedy(2), client="a" if clients else None) for i in range(10)]
    core.add(flood[:1])
    core.step()
    order = [core.running[0]]
    core.add(flood[1:])
    other = Request(prompt(4, 99), greedy(2), client="b" if clients else None)
    core.add([other])
    while core.has_unfinished():
        core.step()
        running = core.running[0]
        if running is not None and running not in order:
            order.append(running)
    check_core(core, ctx)
    assert order[0] is flood[0]
    assert order.index(other) == (1 if clients else 10)


def test_config_checks_priority_aging():
    assert EngineConfig(priority_aging=0).priority_aging == 0
    for bad in (-1, 1.5, True, "8", None):
        with pytest.raises(ValueError, match="priority_aging"):
            EngineConfig(priority_aging=bad)


# -- the queue order as a property ------------------------------------------------------------

PARAMS = SamplingParams(max_tokens=1)


@settings(max_examples=150, deadline=None)
@given(
    aging=st.integers(1, 6),
    arrivals=st.lists(
        st.lists(st.tuples(st.integers(-20, 20), st.sampled_from([None, "a", "b", "c"])), max_size=3),
        min_size=1,
        max_size=120,
    ),
)
def test_every_waiting_request_is_admitted_within_its_bound(aging, arrivals):
    """Whatever arrives, from whichever clients, a request is admitted after at most the
    requests ahead of it when it came, plus those arriving while it ages its way past every
    better priority: until ``(its priority - the best priority + 1) x aging`` admissions after
    its turn. So under any endless stream of finite rate, every waiting request is admitted."""
    waiting: deque[Request] = deque()
    turns = ClientTurns()
    admitted = 0
    info: dict[int, tuple[int, int, int]] = {}  # arrival -> (admissions then, ahead then, priority)
    arrivals_at: list[int] = []  # the admission count at each arrival, in arrival order
    best = min((p for batch in arrivals for p, _ in batch), default=0)
    waited: dict[int, Request] = {}
    for batch in [*arrivals, *([[]] * 400)]:
        new = [Request([1], PARAMS, priority=p, client=c) for p, c in batch]
        enqueue(waiting, new, aging, admitted, turns)
        for r in new:
            info[r.arrival] = (admitted, waiting.index(r), r.priority)
            arrivals_at.append(admitted)
        if waiting:
            r = waiting.popleft()
            r.admitted_order = admitted  # the admissions before it
            waited[r.arrival] = r
            admitted += 1
    assert not waiting
    for arrival, (came, ahead, priority) in info.items():
        r = waited[arrival]
        window_end = r.wait_stamp + (priority - best + 1) * aging
        overtakers = sum(1 for s in arrivals_at if came <= s < window_end)
        assert r.admitted_order - came <= ahead + overtakers, (arrival, priority, r.client)


def test_priority_victim_respects_aging():
    low = Request([1], PARAMS, priority=2)
    low.wait_stamp, low.admitted_order = 0, 0
    urgent = Request([1], PARAMS, priority=0)
    urgent.wait_stamp = 100
    assert priority_victim([(0, low)], urgent, 0) == 0  # no aging: priorities only
    assert priority_victim([(0, low)], urgent, 1) == -1  # ``low`` aged 100 levels since
    assert priority_victim([(0, low)], urgent, 1000) == 0
