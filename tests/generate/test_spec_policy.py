"""The cost-aware draft lengths (``generate/spec_policy.py``): the chosen lengths are the
expected-value optimum of the tick's tokens per second, checked by brute force; with a
scripted decode cost on the fake context the engine drafts nothing when extra tokens are
dear and drafts are rejected, long runs when tokens are cheap and drafts accepted, and
nothing with many streams; its decode cost model learns the scripted cost."""

from __future__ import annotations

import itertools
import random

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt
from test_speculative_fake import OracleDrafter, _speculate

from llamabatch import SamplingParams
from llamabatch._core.slots import SlotState
from llamabatch.generate import speculative
from llamabatch.generate.cost_model import TickFeatures
from llamabatch.generate.spec_policy import (
    AcceptanceModel,
    DraftTimer,
    RequestAcceptance,
    SpecCostModel,
    SpecPolicy,
    choose_draft_lengths,
)
from llamabatch.generate.speculative import DraftJob, NgramDrafter, Speculator


def _rate(gains, ks, n_emit, cost):
    expected = n_emit + sum(sum(g[:k]) for g, k in zip(gains, ks, strict=True))
    return expected / max(cost(sum(ks), max(ks, default=0)), 1e-12)


def _best_by_brute_force(gains, n_emit, cost, room, margin):
    best, best_ks = n_emit / max(cost(0, 0), 1e-12) * (1 + margin), [0] * len(gains)
    for ks in itertools.product(*(range(len(g) + 1) for g in gains)):
        if 0 < sum(ks) <= room and _rate(gains, ks, n_emit, cost) > best + 1e-12:
            best, best_ks = _rate(gains, ks, n_emit, cost), list(ks)
    return best_ks


def _linear(fixed, per_token, per_step=0.0, n_decode=1):
    return lambda total, longest: fixed + per_token * (n_decode + total) + per_step * longest


def _geometric(a, n):
    return [a ** (i + 1) for i in range(n)]


def test_dear_tokens_and_low_acceptance_draft_nothing():
    # a draft token costs half a decode; a 30% draft is not worth it
    assert choose_draft_lengths([_geometric(0.3, 8)], 1, _linear(0.004, 0.004), 32) == [0]


def test_cheap_tokens_and_high_acceptance_draft_long_runs():
    assert choose_draft_lengths([_geometric(0.99, 16)], 1, _linear(0.010, 0.0002), 32) == [16]
    assert choose_draft_lengths([_geometric(0.99, 16)], 1, _linear(0.010, 0.0002), 5) == [5]  # room


def test_many_streams_draft_nothing():
    # the same costs and a 90% acceptance: one stream drafts, eight do not (their tick
    # already emits 8 tokens; a draft adds 0.9 of a token for the price of one)
    gains = _geometric(0.9, 8)
    assert choose_draft_lengths([gains], 1, _linear(0.004, 0.003), 32, 0.03)[0] > 0
    eight = _linear(0.004, 0.003, n_decode=8)
    assert choose_draft_lengths([gains] * 8, 8, eight, 32, 0.03) == [0] * 8


def test_the_draft_models_time_per_step_counts():
    gains = _geometric(0.95, 8)
    free = choose_draft_lengths([gains], 1, _linear(0.008, 0.0005), 32)
    dear = choose_draft_lengths([gains], 1, _linear(0.008, 0.0005, per_step=0.004), 32)
    assert free == [8] and 0 < dear[0] < 8


@pytest.mark.parametrize("seed", range(30))
def test_the_choice_is_the_expected_value_optimum(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 3)
    gains = [_geometric(rng.uniform(0.05, 1.0), rng.randint(0, 5)) for _ in range(n)]
    fixed, per_token = rng.uniform(0.001, 0.02), rng.uniform(0.0001, 0.005)
    per_step = rng.choice([0.0, 0.0, rng.uniform(0.0001, 0.003)])
    cost = _linear(fixed, per_token, per_step, n_decode=n)
    room, margin = rng.randint(0, 12), rng.choice([0.0, 0.03])
    got = choose_draft_lengths(gains, n, cost, room, margin)
    want = _best_by_brute_force(gains, n, cost, room, margin)
    assert sum(got) <= room and all(k <= len(g) for k, g in zip(got, gains, strict=True))
    if per_step == 0.0:  # the cost depends on the total only: the top gains are exact
        assert _rate(gains, got, n, cost) == pytest.approx(_rate(gains, want, n, cost), rel=1e-12)
        assert (sum(got) == 0) == (sum(want) == 0)
    else:  # a longest-run term: the top gains are within a hair of the best
        assert _rate(gains, got, n, cost) >= 0.97 * _rate(gains, want, n, cost)


def test_acceptance_estimates_follow_the_drafts():
    policy = SpecPolicy()
    model = AcceptanceModel(8, policy)
    hot, cold = RequestAcceptance(8), RequestAcceptance(8)
    assert model.gains(hot, 3) == pytest.approx([0.7, 0.49, 0.343])  # the prior
    for _ in range(20):
        model.decay(hot)
        model.decay(cold)
        model.observe(hot, 8, 8)  # always accepted
        model.observe(cold, 4, 0)  # always rejected at the first
    assert min(model.gains(hot, 8)) > 0.5
    assert model.gains(cold, 1)[0] < 0.1
    for _ in range(60):  # no drafts: the request's evidence fades toward the engine's rate
        model.decay(cold)
    assert model.gains(cold, 1)[0] == pytest.approx(model.rate(RequestAcceptance(8), 0), rel=0.05)


def test_one_old_rejection_does_not_cap_later_drafts():
    # measured: one early rejection at position 8 (engine-wide, per position) made every later
    # request's ninth draft look a third less likely, so none drafted past 8 to correct it
    model = AcceptanceModel(16, SpecPolicy())
    model.observe(RequestAcceptance(16), 9, 8)  # another request's drafts: the ninth rejected
    req = RequestAcceptance(16)
    for _ in range(10):
        model.decay(req)
        model.observe(req, 8, 8)  # this one's eight drafts always hold
    gains = model.gains(req, 16)
    assert gains[8] > 0.95 * gains[7] and gains[15] > 0.8


def test_the_draft_timer_averages_seconds_per_step():
    timer = DraftTimer(weight=0.5)
    assert timer.predict(4) == 0.0
    timer.observe(0.5, 4)  # the first call pages the draft model in: not counted
    assert timer.predict(4) == 0.0
    timer.observe(0.008, 4)
    timer.observe(0.004, 1)
    assert timer.predict(2) == pytest.approx(2 * 0.003)


# -- the engine on the fake context, with a scripted decode cost ----------------------------


def _run(n_streams, p_wrong, cost, k=8, max_tokens=60, streams=False):
    core, ctx, model = make_core(n_parallel=n_streams, n_batch=64, n_ctx=256 * n_streams)
    ctx.cost = cost
    core.clock = ctx.clock
    _speculate(core, model, p_wrong, k=k)
    rec = Recorder(core, ctx, model)
    for i in range(n_streams):
        rec.new(prompt(6, 20 + i), greedy(max_tokens))
    drafts = []  # per tick: the draft tokens in its batch (with ``streams``: and the streams decoding)
    while core.has_unfinished():
        n_decode = core.table.count(SlotState.DECODE)
        rec.step()
        drafts.append((core.table.n_draft_tokens, n_decode) if streams else core.table.n_draft_tokens)
    for r in rec.requests:
        rec.check_done(r)
    return core, drafts


def test_engine_drafts_nothing_when_tokens_are_dear_and_drafts_fail():
    core, drafts = _run(1, 0.7, (0.002, 0.003, 0.002, 0.0))  # a draft: 5 ms on a 7 ms tick
    assert sum(drafts[len(drafts) // 3 :]) == 0  # (the first ticks learn what drafts cost)
    assert core.counters.spec_draft_tokens < 40


def test_engine_drafts_long_runs_when_tokens_are_cheap_and_drafts_hold():
    core, drafts = _run(1, 0.0, (0.008, 0.0002, 0.0003, 0.0), k=8, max_tokens=120)
    assert max(drafts) == 8
    late = [d for d in drafts[5:] if d]
    assert sum(late) / len(late) > 7
    assert core.counters.spec_accepted_tokens == core.counters.spec_draft_tokens


def test_engine_with_many_streams_drafts_nothing():
    cost = (0.004, 0.001, 0.002, 0.0)  # a draft token: 3 ms; one stream's tick: 7 ms
    _, one = _run(1, 0.1, cost)
    assert sum(one) > 10  # one stream gains from 90% drafts
    _, eight = _run(8, 0.1, cost, streams=True)
    # 8 streams: nothing once the first ticks have shown what drafts cost (fewer streams, as
    # requests end, may draft again)
    assert sum(d for d, n in eight[len(eight) // 4 :] if n == 8) == 0
    assert sum(d for d, n in eight if n == 8) < 60  # (the first ticks: a few drafts, to learn)


def test_engine_decisions_are_the_optimum_of_its_estimates(monkeypatch):
    calls = []
    real = speculative.choose_draft_lengths

    def spy(gains, n_emit, cost, room, margin=0.0):
        got = real(gains, n_emit, cost, room, margin)
        calls.append((gains, n_emit, cost, room, margin, got))
        return got

    monkeypatch.setattr(speculative, "choose_draft_lengths", spy)
    _run(2, 0.3, (0.006, 0.0005, 0.001, 0.0), k=4, max_tokens=40)
    assert calls
    for gains, n_emit, cost, room, margin, got in calls:
        want = _best_by_brute_force(gains, n_emit, cost, room, margin)
        assert _rate(gains, got, n_emit, cost) == pytest.approx(_rate(gains, want, n_emit, cost))


def test_the_decode_cost_model_learns_the_scripted_cost():
    fixed, per_token, per_output = 0.006, 0.0005, 0.001
    core, _ = _run(1, 0.2, (fixed, per_token, per_output, 0.0), k=8, max_tokens=120)
    model = core.spec.cost
    for n in (1, 3, 5, 9):  # decode ticks (each token with its logits row), the drafts' cost
        want = fixed + (per_token + per_output) * n
        assert model.predict(TickFeatures(n, n, 0.0)) == pytest.approx(want, rel=0.05)


class _TimedDrafter(OracleDrafter):
    """An oracle drafter whose draft steps take ``per_step`` seconds of the fake's clock
    (one step per draft token of the longest job, as the draft model's batched decodes)."""

    def __init__(self, model, ctx, per_step, p_wrong=0.0):
        super().__init__(model, p_wrong)
        self.ctx, self.per_step = ctx, per_step

    def draft(self, jobs):
        self.ctx.now += self.per_step * max((job.k for job in jobs), default=0)
        return super().draft(jobs)


def _draft_model_core(per_step, cost, p_wrong=0.0, k=8):
    core, ctx, model = make_core(n_parallel=2, n_batch=64, n_ctx=512)
    ctx.cost, core.clock = cost, ctx.clock
    drafter = _TimedDrafter(model, ctx, per_step, p_wrong)
    core.spec = Speculator({"method": "draft_model", "num_speculative_tokens": k}, drafter, SpecPolicy())
    return core, ctx, model


def _drafts_of_one_request(core, ctx, model, seed, max_tokens):
    """Run one greedy request to its end; the draft tokens of each tick."""
    rec = Recorder(core, ctx, model)
    (r,) = rec.new(prompt(6, seed), greedy(max_tokens))
    drafts = []
    while core.has_unfinished():
        rec.step()
        drafts.append(core.table.n_draft_tokens)
    rec.check_done(r)
    return drafts


def test_the_draft_models_measured_time_shortens_its_drafts():
    lengths = {}
    # drafts right 90% of the time: free draft steps, then each about half a target decode
    # (with drafts that always hold, even dear steps pay up to the longest draft)
    for per_step in (0.0, 0.004):
        core, ctx, model = _draft_model_core(per_step, (0.006, 0.0002, 0.0003, 0.0), p_wrong=0.1)
        drafts = _drafts_of_one_request(core, ctx, model, 40, 120)
        lengths[per_step] = max(drafts[10:-2])
        if per_step:
            assert core.spec.draft_timer.per_step == pytest.approx(per_step)
    assert lengths[0.0] == 8 > lengths[0.004] > 0


def test_one_stream_drafts_long_when_the_second_token_is_the_dear_one():
    # a 2-core CPU's curve: one token 8 ms, two 17 ms, seventeen 40 ms; a draft step 1.6 ms.
    # Drafts that always hold pay only when long (17 tokens in 66 ms, against 8 ms a token):
    # two drafts (19 ms + 3.2) do not. Fitted on short drafts alone, the model never drafted
    # long; the lessons (2, 4, 8, 16 drafts) and one-token ticks fitted apart find it
    core, ctx, model = _draft_model_core(0.0016, (0.0065, 0.0015, 0.0, 0.0), k=16)
    ctx.batch_jump = 0.008
    drafts = _drafts_of_one_request(core, ctx, model, 43, 240)
    late = [d for d in drafts[6:] if d]
    assert len(late) >= 8 and sum(late) / len(late) >= 12
    assert core.spec.cost.predict(TickFeatures(1, 1, 0.0)) == pytest.approx(0.008, rel=0.05)
    assert core.spec.cost.predict(TickFeatures(17, 17, 0.0)) == pytest.approx(0.04, rel=0.1)


def test_seeded_sampled_requests_against_a_draft_model_draft_their_full_length():
    # dear drafts that always fail: a free choice drafts nothing, a seeded sampled request
    # drafts its full length (its tokens must not depend on timings), an unseeded one chooses
    core, ctx, model = _draft_model_core(0.004, (0.002, 0.003, 0.002, 0.0), p_wrong=1.0, k=3)
    rec = Recorder(core, ctx, model)
    (seeded,) = rec.new(prompt(6, 41), SamplingParams(max_tokens=30, temperature=1.0, seed=5))
    (free,) = rec.new(prompt(6, 42), SamplingParams(max_tokens=30, temperature=1.0))
    rec.run()
    rec.check_done(seeded)
    rec.check_done(free)
    assert seeded.output.timings.spec_draft_tokens >= 3 * 25
    assert free.output.timings.spec_draft_tokens < 3 * 10


def test_draft_classes_are_estimated_apart():
    # an n-gram draft's class is the length of the suffix it matched: long matches (a loop)
    # hold, short ones fail, and one request's estimates keep them apart
    model = AcceptanceModel(4, SpecPolicy())
    long, short = RequestAcceptance(4), RequestAcceptance(4)
    for _ in range(10):
        model.observe(long, 4, 4, cls=5)
        model.observe(short, 4, 0, cls=2)
    assert model.gains(long, 4, 5)[-1] > 0.8
    assert model.gains(short, 1, 2)[0] < 0.15
    fresh = RequestAcceptance(4)  # a new request starts from the engine's rate of the class
    assert model.gains(fresh, 1, 5)[0] > 0.8 > 0.3 > model.gains(fresh, 1, 2)[0]


def test_the_ngram_drafter_reports_the_match_length():
    drafter = NgramDrafter(1, 4)
    loop = [1, 2, 3, 4, 5] * 3
    got = drafter.draft(
        [DraftJob("a", loop, [], 8, SamplingParams()), DraftJob("b", [7, 8, 9, 7], [], 3, SamplingParams())]
    )
    assert got["a"].tokens == [1, 2, 3, 4, 5, 1, 2, 3]  # the loop goes on past the end
    assert drafter.last_match == {"a": 4, "b": 1}
    drafter.release("a")
    assert "a" not in drafter.last_match


def test_probes_keep_the_draft_cost_known_when_nobody_drafts():
    # drafts right 60% of the time, each costing 5 ms on a 7 ms tick: not worth it, but now
    # and then one draft token is tried, so the cost model keeps measuring what drafts cost
    _, drafts = _run(1, 0.4, (0.002, 0.003, 0.002, 0.0), max_tokens=240)
    late = drafts[60:]
    # one-token probes (or short runs of them, as the fit forgets older drafts) now and then
    assert 0 < sum(late) <= len(late) // 8
    # (probes that held make the request's rate, shared by its positions, look good for a few
    # ticks: a short run of longer drafts, until a rejection)
    assert max(late) <= 3


def test_prompt_chunks_do_not_price_the_drafts():
    # measured on a 2-core CPU (looping text, 135M model): one-token ticks, a first 512-token
    # chunk that also paid for its buffers, the rest of the prompt, then the lessons' ticks.
    # Fitted with the chunks, the line stayed where the chunks set it whatever the lessons
    # said (3 tokens: 15 ms predicted, 28 measured; in another run a draft token at 100 ms)
    model = SpecCostModel()
    ticks = [(1, 1, 15.2), (1, 1, 14.5), (512, 0, 3048.6), (328, 1, 991.2), (1, 1, 10.1)]
    lessons = [(3, 3, 27.7), (5, 5, 33.5), (9, 9, 57.3), (17, 17, 85.4)]
    for tokens, outputs, ms in ticks + lessons:
        model.observe(TickFeatures(tokens, outputs, 0.0), ms / 1000)
    for tokens, _, ms in lessons:
        assert model.predict(TickFeatures(tokens, tokens, 0.0)) == pytest.approx(ms / 1000, rel=0.3)


def test_the_draft_cost_follows_the_cpu_curve_not_a_line():
    # measured on a 2-core CPU (looping text, 135M model): one token 10 ms, the lessons, then
    # drafts of 10 to 15 tokens; a line through them put a one-token draft at 34 ms (3x a
    # tick, so short drafts never ran to show they cost 20)
    model = SpecCostModel()
    for tokens, ms in [(1, 10.0), (2, 20.0), (3, 27.7), (5, 33.5), (9, 57.3), (17, 85.4)] + [
        (11, 61.0),
        (14, 72.0),
    ] * 20:
        model.observe(TickFeatures(tokens, tokens, 0.0), ms / 1000)
    assert model.predict(TickFeatures(2, 2, 0.0)) == pytest.approx(0.020, rel=0.15)
    assert model.predict(TickFeatures(4, 4, 0.0)) == pytest.approx(0.031, rel=0.15)
    assert model.predict(TickFeatures(12, 12, 0.0)) == pytest.approx(0.065, rel=0.15)
    assert model.predict(TickFeatures(30, 30, 0.0)) == pytest.approx(0.131, rel=0.25)  # (past the last)
    assert model.predict(TickFeatures(1, 1, 0.0)) == pytest.approx(0.010)
