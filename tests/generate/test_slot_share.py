"""Slot shares over the fake llama.cpp (``fake_llama.py``; ``generate/priority.py``:
``share_victim``, ``ClientSlots``): a client whose requests hold every slot gives one up to a
client that holds none, at once, instead of keeping it waiting until one of them ends; and a
client with nothing running goes ahead of preempted requests and of other clients' turns."""

from __future__ import annotations

from collections import deque

import pytest
from fake_llama import make_core
from fake_scheduling import check_core, greedy, prompt

from llamabatch.generate.priority import MAX_SHARE_PREEMPTIONS, ClientSlots, share_victim
from llamabatch.generate.request import Request, RequestKind


def _hog_then_other(other_client, *, other_priority: int = 0, hog_priority: int = 0):
    core, ctx, _ = make_core(n_parallel=4, n_ctx=1024)
    hog = [Request(prompt(4, i), greedy(200), client="hog", priority=hog_priority) for i in range(4)]
    core.add(hog)
    core.step()
    assert all(r is not None and r.client == "hog" for r in core.running)
    other = Request(prompt(4, 99), greedy(2), client=other_client, priority=other_priority)
    core.add([other])
    core.step()
    return core, ctx, hog, other


def test_a_client_holding_no_slot_takes_one_from_the_client_holding_every_slot():
    core, ctx, hog, other = _hog_then_other("other")
    assert other in core.running  # started in the step it arrived, not after 200 tokens
    preempted = [r for r in hog if r not in core.running]
    assert preempted == [hog[-1]]  # the most recently admitted of the hog's
    assert preempted[0].n_preemptions == 1
    while core.has_unfinished():
        core.step()
    check_core(core, ctx)
    assert other.done and all(r.done for r in hog)
    assert [r.output.finish_reason for r in hog] == ["length"] * 4  # recomputed, unchanged to its caller


@pytest.mark.parametrize(
    ("other_client", "other_priority", "hog_priority"),
    [
        (None, 0, 0),  # no client (an in-process caller): first come, first served, as before
        ("other", 5, 0),  # a worse priority does not take a better one's slot
    ],
)
def test_no_share_preemption(other_client, other_priority, hog_priority):
    core, ctx, hog, other = _hog_then_other(
        other_client, other_priority=other_priority, hog_priority=hog_priority
    )
    assert other not in core.running
    assert all(r in core.running for r in hog)
    check_core(core, ctx)


def _running(*specs):
    requests = []
    for order, spec in enumerate(specs):
        client, priority, max_tokens = (*spec, 8)[:3]
        request = Request([1, 2], greedy(max_tokens), client=client, priority=priority)
        request.admitted_order = order
        requests.append(request)
    return list(enumerate(requests))


def test_share_victim_rules():
    blocked = Request([1], greedy(4), client="b")
    # the client with the most slots gives up the request with the most tokens left
    assert share_victim(_running(("a", 0, 8), ("a", 0, 6), ("c", 0)), blocked) == 0
    # of equals, the most recently admitted
    assert share_victim(_running(("a", 0), ("a", 0), ("c", 0)), blocked) == 1
    # a client already holding a slot waits its turn
    assert share_victim(_running(("a", 0), ("a", 0), ("b", 0)), blocked) == -1
    # one slot each: the one with the most tokens left
    assert share_victim(_running(("a", 0, 6), ("c", 0, 9)), blocked) == 1
    # never a request with no more tokens left than the newcomer may generate in all
    assert share_victim(_running(("a", 0, 4), ("c", 0, 3)), blocked) == -1
    # a better priority is never taken, a pin never, nor a request preempted too often
    assert share_victim(_running(("a", -1), ("a", -1)), blocked) == -1
    running = _running(("a", 0), ("a", 0))
    running[1][1].kind = RequestKind.PIN
    assert share_victim(running, blocked) == 0
    running[0][1].n_preemptions = MAX_SHARE_PREEMPTIONS - 1
    assert share_victim(running, blocked) == 0
    running[0][1].n_preemptions = MAX_SHARE_PREEMPTIONS
    assert share_victim(running, blocked) == -1
    # of the client's requests, the one preempted least often goes first
    running = _running(("a", 0, 9), ("a", 0, 6))
    running[0][1].n_preemptions = 1
    assert share_victim(running, blocked) == 1
    # no client: no share
    assert share_victim(_running(("a", 0), ("a", 0)), Request([1], greedy(4))) == -1


def test_newcomer_goes_to_the_head_of_the_queue():
    slots = ClientSlots()
    running = Request([1], greedy(8), client="a")
    slots.admitted(running)
    preempted = Request([1], greedy(8), client="a")
    preempted.n_preemptions = 1
    other = Request([1], greedy(8), client="c")
    other.n_preemptions = 1  # admitted before: not a newcomer
    worse = Request([1], greedy(8), client="d", priority=1)
    newcomer = Request([1], greedy(8), client="b")
    second = Request([1], greedy(8), client="b")  # the same client's next one stays
    third = Request([1], greedy(8), client="e")
    waiting = deque([preempted, other, worse, newcomer, second, third])
    slots.newcomer_first(waiting)
    assert list(waiting) == [newcomer, third, preempted, other, worse, second]
    slots.newcomer_first(waiting)  # already first: unchanged
    assert list(waiting) == [newcomer, third, preempted, other, worse, second]
    slots.released(running)
    assert slots.held == {}
    assert slots.is_newcomer(Request([1], greedy(8), client="a"))
    assert not slots.is_newcomer(Request([1], greedy(8)))  # no client: no share


def test_a_client_with_nothing_running_gets_a_slot_within_one_step_while_other_clients_flood():
    """Four clients each hold one slot with long requests, and more of theirs (preempted
    ones among them) wait; each of a fifth client's short requests starts in the step it
    arrives, ahead of them all."""
    core, ctx, _ = make_core(n_parallel=4, n_ctx=2048)
    floods = [Request(prompt(4, i), greedy(60), client=f"hog{i % 4}") for i in range(12)]
    core.add(floods)
    for _ in range(3):
        core.step()
    for i in range(4):
        assert sum(r is not None and r.client == f"hog{i}" for r in core.running) == 1
    for k in range(6):
        other = Request(prompt(4, 100 + k), greedy(3), client="other")
        core.add([other])
        core.step()
        assert other in core.running or other.done, k  # started in the step it arrived
        check_core(core, ctx)
        while not other.done:
            core.step()
    assert any(r.n_preemptions for r in floods)  # the newcomers went ahead of preempted ones
    while core.has_unfinished():
        core.step()
    check_core(core, ctx)
    assert [r.output.finish_reason for r in floods] == ["length"] * 12
    assert max(r.n_preemptions for r in floods) <= MAX_SHARE_PREEMPTIONS
