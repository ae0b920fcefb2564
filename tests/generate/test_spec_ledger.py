"""No loss where drafts fail: speculation's exploration (its first lessons and its probes) is
bounded by its measured cost (``spec_ledger.SpecLedger``). On the fake context with a CPU's
scripted decode times (a one-token decode runs other kernels: the second token is dear), a
stream whose every draft is wrong runs within 2% of the same stream without speculation,
while one whose drafts hold gains several times over with the default draft cap of 64."""

from __future__ import annotations

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt
from test_speculative_fake import OracleDrafter

from llamabatch.generate.cost_model import TickFeatures
from llamabatch.generate.spec_ledger import SpecLedger
from llamabatch.generate.speculative import Speculator

#: a 2-core CPU's decode of the 135M model, scripted: one token ~9 ms, two ~19 ms, 17 ~40 ms
CPU_COST = (0.008, 0.0012, 0.0002, 0.0)
CPU_JUMP = 0.008


def _scripted_seconds(p_wrong: float | None, n_requests: int = 1, max_tokens: int = 200, k: int = 64):
    """Scripted decode seconds of ``n_requests`` one after the other (one stream); ``p_wrong``
    None: no speculation."""
    core, ctx, model = make_core(n_parallel=1, n_batch=128, n_ctx=1024)
    ctx.cost, ctx.batch_jump, core.clock = CPU_COST, CPU_JUMP, ctx.clock
    if p_wrong is not None:
        drafter = OracleDrafter(model, p_wrong)
        core.spec = Speculator({"method": "ngram", "num_speculative_tokens": k}, drafter)
    rec = Recorder(core, ctx, model)
    for i in range(n_requests):
        (r,) = rec.new(prompt(16, 100 + i), greedy(max_tokens))
        rec.run()
        rec.check_done(r)
    return ctx.clock(), core


@pytest.mark.parametrize("n_requests", [1, 4])
def test_drafts_that_always_fail_cost_at_most_two_percent(n_requests):
    plain, _ = _scripted_seconds(None, n_requests)
    spec, core = _scripted_seconds(1.0, n_requests)
    assert core.counters.spec_accepted_tokens < core.counters.spec_draft_tokens // 4 + 1
    assert plain / spec >= 0.98, (plain, spec, core.counters.spec_draft_tokens)


def test_drafts_that_hold_are_long_with_the_default_cap():
    plain, _ = _scripted_seconds(None)
    spec, core = _scripted_seconds(0.0)
    assert plain / spec >= 3.0, (plain, spec)
    assert len(core.counters.spec_accepted_per_pos) > 16  # drafts longer than the old default 5


def test_the_ledger_books_losses_and_gains_against_recent_decode_time():
    ledger = SpecLedger(share=0.01, decay=1.0)
    for _ in range(100):
        ledger.decoded(0.01)
    assert ledger.allows_exploration()
    ledger.drafted(0.03, base=0.01, n_streams=1, drafts=4, row_cost=0.0)  # 20 ms more, for nothing
    ledger.accepted(0)
    ledger.decoded(0.01)  # (books the tick before)
    assert ledger.loss == pytest.approx(0.02) and not ledger.allows_exploration()
    ledger.drafted(0.02, base=0.01, n_streams=1, drafts=4, row_cost=0.0)
    ledger.accepted(4)  # four tokens (40 ms of ticks) for 10 ms more: 30 ms gained
    ledger.settle()
    assert ledger.loss == pytest.approx(-0.01) and ledger.allows_exploration()


def test_the_speculators_own_work_is_booked_after_the_warmup():
    """The lookups' own time counts as loss, from the ``warmup``-th measured decode on: before,
    a first lookup (a prompt to index) would weigh against almost no decode time and hold every
    draft back."""
    ledger = SpecLedger(share=0.01, limit=0.02, decay=1.0, warmup=4)
    ledger.decoded(0.01)
    ledger.spent(0.005)  # half a tick, during the warm-up: not booked
    assert ledger.loss == 0.0 and ledger.allows_drafts()
    for _ in range(99):
        ledger.decoded(0.01)
    for _ in range(15):
        ledger.spent(0.0001)  # 1.5 ms of lookups against 1 s of decodes: 0.15%
    assert ledger.loss == pytest.approx(0.0015) and ledger.allows_exploration()
    ledger.spent(0.02)  # and 20 ms more: over the 2% any drafting may cost
    assert not ledger.allows_drafts()
    ledger.spent(-1.0)  # a clock that stepped back books nothing
    ledger.spent(float("nan"))
    assert ledger.loss == pytest.approx(0.0215)


def test_lookups_that_find_nothing_useful_cost_at_most_two_percent_with_their_own_time():
    """On the fake context, drafts that always fail and lookups taking a scripted 0.4 ms a
    tick (5% of a one-token tick): the ledger stops the lookups whenever drafts and lookups
    together have cost over 2%, so the stream stays within about 2% of one without
    speculation (it lost the lookups' 5% on top before they were booked)."""
    plain, _ = _scripted_seconds(None, max_tokens=400)
    core, ctx, model = make_core(n_parallel=1, n_batch=128, n_ctx=1024)
    ctx.cost, ctx.batch_jump, core.clock = CPU_COST, CPU_JUMP, ctx.clock
    drafter = OracleDrafter(model, 1.0)
    draft = drafter.draft

    def slow_draft(jobs):
        ctx.now += 0.0004  # the lookups' own time, on the fake clock
        return draft(jobs)

    drafter.draft = slow_draft
    core.spec = Speculator({"method": "ngram", "num_speculative_tokens": 64}, drafter)
    rec = Recorder(core, ctx, model)
    (r,) = rec.new(prompt(16, 100), greedy(400))
    rec.run()
    rec.check_done(r)
    assert ctx.clock() <= plain * 1.03, (ctx.clock(), plain)


def test_the_first_lessons_draft_their_full_size_while_they_hold():
    # the lessons (2, 4, 8, 16 drafts) teach the cost model what long drafts cost: a lesson cut
    # to the token or two an early guess chooses (on a real CPU the first decodes page the
    # weights in and make every guess dear) left long drafts unpriced and never chosen
    spec = Speculator({"method": "ngram", "num_speculative_tokens": 64}, OracleDrafter(None, 0.0))
    holds = [[0.9**i for i in range(1, 40)]]
    assert spec._probe([1], holds, free=4) == [4]
    spec._draft_ticks = 1
    assert spec._probe([1], holds, free=8) == [8]
    spec._lessons_held = False  # a lesson failed: the next ones are probes, the choice stands
    assert spec._probe([1], holds, free=16) == [1]
    assert spec._probe([0], holds, free=16) == [sum(g >= spec.policy.probe_gain for g in holds[0])]
    spec._draft_ticks = spec.policy.explore_ticks  # lessons over: a chosen length stands
    spec._lessons_held = True
    assert spec._probe([1], holds, free=16) == [1]


def test_lessons_stop_growing_where_drafts_fail():
    for p_wrong, first in ((0.0, [2, 4, 8, 16]), (1.0, [2])):
        core, ctx, model = make_core(n_parallel=1, n_batch=128, n_ctx=1024)
        ctx.cost, ctx.batch_jump, core.clock = CPU_COST, CPU_JUMP, ctx.clock
        drafter = OracleDrafter(model, p_wrong)
        core.spec = Speculator({"method": "ngram", "num_speculative_tokens": 64}, drafter)
        rec = Recorder(core, ctx, model)
        (r,) = rec.new(prompt(16, 100), greedy(60))
        lessons = []
        while core.has_unfinished() and len(lessons) < 4:
            rec.step()
            if core.table.n_draft_tokens:
                lessons.append(core.table.n_draft_tokens)
        rec.run()
        rec.check_done(r)
        assert lessons[: len(first)] == first, (p_wrong, lessons)
        if p_wrong:
            assert max(lessons) <= 2, lessons


def test_a_size_never_measured_is_measured_once_where_drafts_hold():
    # past the largest tick measured the cost is read along the last step's slope, dearer than
    # a CPU's (each token costs less in a bigger batch): one tick of twice that size measures it
    spec = Speculator({"method": "ngram", "num_speculative_tokens": 64}, OracleDrafter(None, 0.0))
    spec._draft_ticks = spec.policy.explore_ticks  # the first lessons are over
    for tokens, ms in ((1, 9.0), (2, 20.0), (3, 27.0)):
        spec.cost.observe(TickFeatures(tokens, tokens, 0.0), ms / 1000)
    holds, fails = [[0.99**i for i in range(1, 64)]], [[0.6**i for i in range(1, 64)]]
    assert spec._size_lesson([2], holds, free=64, n_decode=1) == [7]  # a tick of 8 tokens
    assert spec._size_lesson([2], fails, free=64, n_decode=1) == [2]
    spec.cost.observe(TickFeatures(8, 8, 0.0), 0.045)
    assert spec._size_lesson([2], holds, free=64, n_decode=1) == [15]
    assert spec._size_lesson([2], holds, free=4, n_decode=1) == [2]  # (no room for it)
