"""Admission policies as plug-ins (``generate/admission.py``), over the fake llama.cpp.

The default policy's behaviour is covered by the scheduler, priority and latency tests; here:
a policy composed over it (``GroupedAdmission``) and the verdicts the core obeys.
"""

from __future__ import annotations

from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt

from llamabatch.generate.admission import (
    AdmissionPolicy,
    DelegatingAdmission,
    GroupedAdmission,
    PriorityAdmission,
    Verdict,
)
from llamabatch.generate.request import Request


def _by_client(rec, client, seed, max_tokens=6):
    (r,) = rec.add(Request(prompt(4, seed), greedy(max_tokens), client=client))
    return r


def test_grouped_admission_keeps_one_group_running_and_no_group_waits_forever():
    core, ctx, model = make_core(n_parallel=4)
    core.admission = GroupedAdmission(PriorityAdmission(), key=lambda r: r.client, max_groups=1, patience=2)
    rec = Recorder(core, ctx, model)
    a1 = _by_client(rec, "a", 1, max_tokens=12)
    b1 = _by_client(rec, "b", 2)
    a2 = _by_client(rec, "a", 3)
    rec.step()
    assert {id(r) for r in core.running if r is not None} == {id(a1), id(a2)}  # b1 passed over
    a3 = _by_client(rec, "a", 4)
    rec.step()
    assert a3 in core.running  # passed b1 a second time: its patience is spent
    a4 = _by_client(rec, "a", 5)
    rec.step()
    assert a4 not in core.running, "admission stops at b1 once its patience is spent"
    mixed = False
    while core.has_unfinished():
        rec.step()
        clients = {r.client for r in core.running if r is not None}
        mixed = mixed or len(clients) > 1
    assert not mixed, "two groups ran at once"
    assert b1.t_admitted < a4.t_admitted  # b1 went before the request queued behind it
    for r in (a1, a2, a3, a4, b1):
        rec.check_done(r)


class _PassOdd(DelegatingAdmission):
    """Passes over requests with an odd ``max_tokens`` while anything runs."""

    def admits(self, request, n_prompt, table, busy):
        if busy and request.params.max_tokens % 2:
            return Verdict.PASS
        return self.inner.admits(request, n_prompt, table, busy)


def test_the_core_obeys_pass_and_stop():
    core, ctx, model = make_core(n_parallel=4)
    core.admission = _PassOdd(PriorityAdmission())
    rec = Recorder(core, ctx, model)
    first = rec.new(prompt(4, 1), greedy(4))[0]
    odd = rec.new(prompt(4, 2), greedy(5))[0]
    even = rec.new(prompt(4, 3), greedy(6))[0]
    rec.step()
    assert first in core.running and even in core.running and odd not in core.running
    rec.run()
    rec.check_done(odd)

    class _Stop(AdmissionPolicy):
        def admits(self, request, n_prompt, table, busy):
            return Verdict.STOP if busy else Verdict.ADMIT

    core, ctx, model = make_core(n_parallel=4)
    core.admission = _Stop()
    rec = Recorder(core, ctx, model)
    requests = [rec.new(prompt(4, s), greedy(4))[0] for s in range(3)]
    rec.step()
    assert sum(r is not None for r in core.running) == 1  # one at a time
    rec.run()
    for r in requests:
        rec.check_done(r)
