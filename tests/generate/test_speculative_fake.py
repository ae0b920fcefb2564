"""Speculative decoding on the fake context: verification of drafts in the batch keeps every
completion what it would be alone (greedy and seeded sampled), the KV record exact and
every request ending once, with drafts right, wrong or partly right, in both KV layouts,
with prefix reuse, preemption, cancellation and scripted decode failures (the scheduler
state machine of ``test_scheduler_machine.py`` with speculating requests)."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from types import SimpleNamespace

import pytest
from fake_llama import FakeModel, FakeSampler, make_core
from fake_scheduling import Recorder, check_core, greedy, prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_scheduler_machine import SchedulerMachine

from llamabatch import SamplingParams
from llamabatch._core.slots import SlotState
from llamabatch._ffi.sampler import SamplingError
from llamabatch.generate.draft_cuts import first_end
from llamabatch.generate.speculative import Draft, DraftJob, SpecPolicy, Speculator


class OracleDrafter:
    """Drafts the fake model's greedy continuation, each token wrong with probability
    ``p_wrong`` (a random other token): acceptance from 100% down to none."""

    def __init__(self, model: FakeModel, p_wrong: float, seed: int = 0) -> None:
        self.model, self.p_wrong = model, p_wrong
        self.rng = random.Random(seed)
        self.released: list[tuple[Hashable, bool]] = []
        self.calls = 0

    def draft(self, jobs: Sequence[DraftJob]) -> dict[Hashable, Draft]:
        self.calls += 1
        out = {}
        for job in jobs:
            hist = list(job.prompt) + list(job.output)
            tokens = []
            for _ in range(job.k):
                t = self.model.next_token(hist)
                if self.rng.random() < self.p_wrong:
                    t = (t + self.rng.randrange(1, self.model.n_vocab)) % self.model.n_vocab
                tokens.append(t)
                hist.append(t)
            out[job.key] = Draft(tokens, "match")
        return out

    def verify(self, key, draft, logits_rows, params):  # pragma: no cover - match rule only
        raise NotImplementedError

    def release(self, key: Hashable, *, done: bool = True) -> None:
        self.released.append((key, done))

    def close(self) -> None:
        pass


#: a scripted decode time (fixed, per token, per logits row, per attended cell; seconds) under
#: which drafts pay when they are mostly accepted: a decode's fixed cost dominates
CHEAP_DRAFTS = (0.008, 0.0002, 0.0003, 0.0)


def _speculate(core, model, p_wrong=0.0, k=4, seed=0, cost=CHEAP_DRAFTS, **policy) -> OracleDrafter:
    """Attach an oracle drafter; decodes take the scripted ``cost`` (unless the test scripted
    one already), so the speculator's decisions do not depend on this machine's timings."""
    drafter = OracleDrafter(model, p_wrong, seed)
    config = {"method": "ngram", "num_speculative_tokens": k}
    core.spec = Speculator(config, drafter, SpecPolicy(**policy))
    if cost is not None and core.context.cost is None:
        core.context.cost = cost
        core.clock = core.context.clock
    return drafter


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("p_wrong", [0.0, 0.3, 1.0])
def test_completions_are_those_without_speculation(kv_unified, p_wrong):
    core, ctx, model = make_core(n_parallel=3, kv_unified=kv_unified, prefix_cache=True, n_batch=32)
    drafter = _speculate(core, model, p_wrong)
    rec = Recorder(core, ctx, model)
    for i in range(6):
        params = greedy(20) if i % 2 else SamplingParams(max_tokens=20, temperature=1.0, seed=i)
        rec.new(prompt(5 + i, i), params)
    rec.run()
    for r in rec.requests:
        rec.check_done(r)
    assert core.counters.spec_draft_tokens > 0
    if p_wrong == 0.0:  # the greedy ones' drafts are right (the sampled ones' often not)
        timings = [r.output.timings for i, r in enumerate(rec.requests) if i % 2]
        assert sum(t.spec_accepted_tokens for t in timings) > sum(t.spec_draft_tokens for t in timings) // 2
    if p_wrong == 1.0:
        assert core.counters.spec_accepted_tokens < core.counters.spec_draft_tokens // 4
    assert sorted(k for k, done in drafter.released if done) == sorted(r.arrival for r in rec.requests)


def test_full_acceptance_takes_fewer_ticks_and_the_draft_length_grows():
    steps = []
    for spec in (False, True):
        core, ctx, model = make_core(n_parallel=1, n_batch=32)
        if spec:
            _speculate(core, model, 0.0, k=8)
        rec = Recorder(core, ctx, model)
        (r,) = rec.new(prompt(6, 1), greedy(40))
        steps.append(rec.run())
        rec.check_done(r)
        if spec:
            assert r.output.timings.spec_accepted_tokens == r.output.timings.spec_draft_tokens > 0
    assert steps[1] * 3 < steps[0]


def test_stops_and_limits_inside_an_accepted_run():
    core, ctx, model = make_core(n_parallel=2, n_batch=32)
    _speculate(core, model, 0.0, k=8)
    rec = Recorder(core, ctx, model)
    full, _ = model.completion(prompt(6, 2), 30, 64, False, None)
    rec.new(prompt(6, 2), greedy(7))  # max_tokens inside a run of 8 drafts
    rec.new(prompt(6, 2), greedy(30, stop_token_ids=[full[10]]))
    rec.run()
    rec.check_done(rec.requests[0])  # (the recorder's expectation knows no stop tokens)
    assert rec.requests[0].output.token_ids == full[:7]
    assert rec.requests[1].output.finish_reason == "stop"
    assert rec.requests[1].output.stop_reason == full[10]
    assert rec.requests[1].output.token_ids == full[: full.index(full[10]) + 1]


@pytest.mark.parametrize("end", ["eog", "stop_token", "stop_string", "ignore_eos"])
def test_a_draft_is_cut_before_the_token_that_ends_its_request(end):
    """Drafts that are all right, running past the token that ends the request (the
    end-of-generation token, a stop token, the token completing a two-token stop string):
    cut before it (the last draft's row samples it), every drafted token is accepted, and the
    completion is the one without speculation. With ``ignore_eos`` the end-of-generation
    token ends nothing, and the drafts run through it."""
    model = FakeModel(natural_eog=end in ("eog", "ignore_eos"))
    seed = next(  # a prompt whose greedy completion ends at its EOG after 12 to 40 tokens
        i for i in range(500) if 12 <= len(model.completion(prompt(6, i), 64, 256)[0]) <= 40 or end != "eog"
    )
    full, _ = model.completion(prompt(6, seed), 64, 256, ignore_eos=end == "ignore_eos")
    params = greedy(64, ignore_eos=end == "ignore_eos")
    if end == "stop_token":
        params = greedy(64, stop_token_ids=[full[12]])
    elif end == "stop_string":  # two tokens' pieces (" w5 w19"), both whole characters
        j = next(j for j in range(12, 40) if all(full[i] % 11 not in (3, 4) for i in (j - 1, j)))
        params = greedy(64, stop=[model.detokenize(full[j - 1 : j + 1])])
    outputs = []
    for speculate in (False, True):
        core, ctx, model = make_core(model=model, n_parallel=1, n_ctx=256, n_batch=64)
        if speculate:
            _speculate(core, model, 0.0, k=32)
        rec = Recorder(core, ctx, model)
        (r,) = rec.new(prompt(6, seed), params)
        rec.run()
        outputs.append(r.output)
    plain, speculated = outputs
    assert speculated.token_ids == plain.token_ids and speculated.text == plain.text
    assert len(plain.token_ids) < 64 or end == "ignore_eos"
    assert speculated.timings.spec_draft_tokens == speculated.timings.spec_accepted_tokens > 0
    if end == "ignore_eos":  # the drafts ran through the end-of-generation token
        assert plain.token_ids == full and 0 in full


def test_where_a_draft_would_end_its_request():
    """``first_end``: the first drafted token that ends the request; a stop string that
    began in the output's last bytes counts, one that could only begin further back not."""
    pieces = {1: b"ab", 2: b"c", 3: b"d\n", 4: b"Q", 5: b":", 0: b"</s>"}

    def request(output, stop=(), stop_token_ids=(), ignore_eos=False):
        params = SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
        return SimpleNamespace(params=params, stop_ids=frozenset(stop_token_ids), output_tokens=output)

    def end(tokens, req):
        return first_end(tokens, req, bytes([1, 0, 0, 0, 0, 0]), lambda t, special: pieces[t])

    assert end([1, 2, 0, 1], request([])) == 2
    assert end([1, 2, 0, 1], request([], ignore_eos=True)) == 4
    assert end([1, 2, 3, 1], request([], stop_token_ids=[3])) == 2
    assert end([3, 4, 5, 1], request([1], stop=["\nQ:"])) == 2  # "d\n" "Q" ":"
    assert end([5, 1], request([3, 4], stop=["\nQ:"])) == 0  # begun in the output
    assert end([2, 1], request([1, 2, 1], stop=["bca"])) == 1  # "ab" + "c" + "ab"
    assert end([2], request([1], stop=["abc"])) == 0
    assert end([2, 2], request([4, 1], stop=["Qabc"])) == 0
    assert end([2, 2], request([1, 1], stop=["xabc"])) == 2


@settings(max_examples=300, deadline=None)
@given(
    output=st.lists(st.integers(0, 5), max_size=12),
    draft=st.lists(st.integers(0, 5), max_size=12),
    stops=st.lists(st.text("abc", min_size=1, max_size=5), max_size=3),
    stop_ids=st.lists(st.integers(0, 5), max_size=2),
)
def test_where_a_draft_would_end_matches_a_search_of_every_prefix(output, draft, stops, stop_ids):
    """``first_end`` against the obvious search: the first drafted token after which the
    output and the draft so far hold a stop string ending past the output, or which is a stop
    id or the end-of-generation token (5 here); over pieces of 0 to 2 bytes."""
    pieces = [b"", b"a", b"b", b"ab", b"ca", b"</s>"]
    eog = bytes([0, 0, 0, 0, 0, 1])
    params = SamplingParams(stop=stops, stop_token_ids=stop_ids)
    request = SimpleNamespace(params=params, stop_ids=frozenset(stop_ids), output_tokens=output)
    text = b"".join(pieces[t] for t in output)
    in_output = len(text)

    def ends_past_the_output(stop: bytes) -> bool:
        at = text.find(stop)
        while at >= 0:
            if at + len(stop) > in_output:
                return True
            at = text.find(stop, at + 1)
        return False

    expected = len(draft)
    for i, token in enumerate(draft):
        text += pieces[token]
        if eog[token] or token in stop_ids or any(ends_past_the_output(s.encode()) for s in stops):
            expected = i
            break
    assert first_end(draft, request, eog, lambda t, special: pieces[t]) == expected


def test_drafts_only_take_spare_budget_and_never_run_at_full_concurrency():
    core, ctx, model = make_core(n_parallel=4, n_batch=8, chunk_size=8)
    _speculate(core, model, 0.0, k=8, max_streams=2)
    rec = Recorder(core, ctx, model)
    for i in range(4):
        rec.new(prompt(8, i), greedy(12))
    while core.has_unfinished():
        streams = core.table.count(SlotState.DECODE)
        rec.step()
        n_decode, n_prefill = core.table.last_fill_stats
        assert n_decode + n_prefill + core.table.n_draft_tokens <= 8
        if streams > 2:
            assert core.table.n_draft_tokens == 0
    assert core.counters.spec_draft_tokens > 0  # once fewer than 3 streams decode
    for r in rec.requests:
        rec.check_done(r)


def test_a_request_that_opts_out_or_keeps_rejecting_stops_drafting():
    core, ctx, model = make_core(n_parallel=2, n_batch=32)
    drafter = _speculate(core, model, 1.0, k=4)
    rec = Recorder(core, ctx, model)
    (opt_out,) = rec.new(prompt(6, 3), greedy(40, speculative=False))
    (rejected,) = rec.new(prompt(6, 4), greedy(40))
    rec.run()
    rec.check_done(opt_out)
    rec.check_done(rejected)
    assert opt_out.output.timings.spec_draft_tokens == 0
    # its acceptance estimate falls with each rejected draft: it soon stops drafting
    assert rejected.output.timings.spec_draft_tokens < 40 // 2
    assert drafter.calls > 0  # (an n-gram lookup is free: it is made every tick, then weighed)


# -- the state machine with speculating requests -------------------------------------------


class SpeculatingMachine(SchedulerMachine):
    """``SchedulerMachine`` with an oracle drafter of random accuracy attached."""

    @initialize(p_wrong=st.sampled_from([0.0, 0.2, 0.6, 1.0]), k=st.integers(1, 8), seed=st.integers(0, 99))
    def choose_speculation(self, p_wrong, k, seed):
        self.spec_choice = (p_wrong, k, seed)

    @rule(n=st.integers(1, 8))
    def step(self, n):
        if self.core.spec is None:
            p_wrong, k, seed = self.spec_choice
            _speculate(self.core, self.model, p_wrong, k, seed)
        super().step(n)

    def teardown(self):
        super().teardown()
        if hasattr(self, "rec") and self.core.spec is not None:
            assert self.core.counters.spec_accepted_tokens <= self.core.counters.spec_draft_tokens
            drafted = sum(r.output.timings.spec_draft_tokens for r in self.rec.requests if r.output)
            assert drafted <= self.core.counters.spec_draft_tokens


TestSpeculatingMachine = SpeculatingMachine.TestCase
TestSpeculatingMachine.settings = settings(settings.default, stateful_step_count=60)


def test_under_a_latency_target_drafts_stay_within_the_predicted_tick_time():
    core, ctx, model = make_core(n_parallel=1, n_batch=32, target_itl_ms=10.0)
    ctx.cost = (0.004, 0.0005, 0.001, 1e-6)  # a scripted decode time: 1 stream + 8 drafts ~ 18 ms
    core.clock = ctx.clock
    _speculate(core, model, 0.0, k=8)
    rec = Recorder(core, ctx, model)
    (r,) = rec.new(prompt(6, 5), greedy(120))
    times = []
    while core.has_unfinished():
        t0 = ctx.clock()
        rec.step()
        times.append((ctx.clock() - t0, core.table.n_draft_tokens))
    rec.check_done(r)
    assert r.output.timings.spec_accepted_tokens > 0
    late = times[10:]  # once the cost model has seen a few ticks
    assert max(d for _, d in late) < 8
    assert all(t <= 0.0105 for t, _ in late)


def test_recurrent_models_do_not_speculate(caplog):
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    core, _, _ = make_core(n_parallel=1, model=FakeModel(is_recurrent=True), speculative_config=ngram)
    assert core.spec is None
    assert "speculative decoding switched off" in caplog.text


def test_the_ngram_method_on_the_fake_context():
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    core, ctx, model = make_core(n_parallel=2, speculative_config=ngram, n_batch=32)
    assert isinstance(core.spec, Speculator)
    ctx.cost, core.clock = CHEAP_DRAFTS, ctx.clock  # (the decisions do not hang on this machine)
    rec = Recorder(core, ctx, model)
    for i in range(4):
        rec.new(prompt(4, i) * 4, greedy(30))  # repeated prompts: lookups find drafts
    rec.run()
    for r in rec.requests:
        rec.check_done(r)
    assert core.counters.spec_draft_tokens > 0


class _DeadEnd(FakeSampler):
    """A sampler whose grammar reaches a dead end at its ``after``-th call."""

    def __init__(self, model, params, after):
        super().__init__(model, params)
        self.after = after

    def sample(self, context, idx):
        if self.calls >= self.after:
            raise SamplingError("no token the grammar accepts")
        return super().sample(context, idx)


def test_a_grammar_dead_end_inside_a_draft_emits_what_came_before():
    outs = []
    for spec in (False, True):
        core, ctx, model = make_core(n_parallel=1, n_batch=32)
        if spec:
            _speculate(core, model, 0.0, k=8)
        rec = Recorder(core, ctx, model)
        params = SamplingParams(max_tokens=30, temperature=0, repeat_penalty=1.01)
        (r,) = rec.new(prompt(6, 9), params)
        r.sampler = _DeadEnd(model, params, 7)
        rec.run()
        assert r.output.finish_reason == "error" and "grammar" in r.output.error
        assert rec.tokens[r] == r.output.token_ids
        check_core(core, ctx)
        outs.append(r.output)
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 7
    assert outs[1].timings.spec_accepted_tokens > 0


def test_stats_count_drafts_as_computed_and_kept_drafts_as_generated():
    core, ctx, model = make_core(n_parallel=1, n_batch=32)
    _speculate(core, model, 0.3, k=4)
    rec = Recorder(core, ctx, model)
    (r,) = rec.new(prompt(6, 11), greedy(40))
    rec.run()
    rec.check_done(r)
    c = core.counters
    assert c.decode_tokens == 40 - 1  # every generated token but the first came from a decode row
    assert c.batch_tokens == c.prefill_tokens + c.decode_tokens + (
        c.spec_draft_tokens - c.spec_accepted_tokens
    )
