"""Slot shares over the fake llama.cpp (``fake_llama.py``; ``generate/priority.py``:
``share_victim``): a client whose requests hold every slot gives one up to a client that
holds none, at once, instead of keeping it waiting until one of them ends."""

from __future__ import annotations

import pytest
from fake_llama import make_core
from test_scheduler_fake import check_core, greedy, prompt

from llamabatch.generate.priority import MAX_PRIORITY_PREEMPTIONS, share_victim
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
    for order, (client, priority) in enumerate(specs):
        request = Request([1, 2], greedy(4), client=client, priority=priority)
        request.admitted_order = order
        requests.append(request)
    return list(enumerate(requests))


def test_share_victim_rules():
    blocked = Request([1], greedy(4), client="b")
    # the client with the most slots gives up its most recently admitted request
    assert share_victim(_running(("a", 0), ("a", 0), ("c", 0)), blocked) == 1
    # a client already holding a slot waits its turn
    assert share_victim(_running(("a", 0), ("a", 0), ("b", 0)), blocked) == -1
    # one slot each: nothing to share
    assert share_victim(_running(("a", 0), ("c", 0)), blocked) == -1
    # a better priority is never taken, a pin never, nor a request preempted too often
    assert share_victim(_running(("a", -1), ("a", -1)), blocked) == -1
    running = _running(("a", 0), ("a", 0))
    running[1][1].kind = RequestKind.PIN
    assert share_victim(running, blocked) == 0
    running[0][1].n_preemptions = MAX_PRIORITY_PREEMPTIONS
    assert share_victim(running, blocked) == -1
    # no client: no share
    assert share_victim(_running(("a", 0), ("a", 0)), Request([1], greedy(4))) == -1
