"""Closing gaps among busy KV streams (``generate/compaction.py``): the move plan against a
brute force, the engine core over the fake llama.cpp, and real llama.cpp: the tiny model
against the teacher-forced reference, a sliding-window model against its answers alone, and
SmolLM2's tokens with and without moves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import product

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt
from hypothesis import given
from hypothesis import strategies as st
from llama_reference import check_against_reference

from llamabatch import LLM, SamplingParams
from llamabatch.generate import compaction
from llamabatch.generate.compaction import MIN_TOKENS_LEFT, plan_move


def _runs(busy) -> int:
    return sum(1 for i, b in enumerate(busy) if b and (i == 0 or not busy[i - 1]))


def _after(busy, move) -> list[bool]:
    src, dst = move
    out = list(busy)
    out[src], out[dst] = False, True
    return out


slots = st.integers(2, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
    )
)


@given(slots)
def test_a_planned_move_leaves_fewer_runs_and_the_fewest_among_few_slots(case):
    busy, movable, cached = case
    movable = [m and b for m, b in zip(movable, busy, strict=True)]
    move = plan_move(busy, movable, cached)
    moves = [(s, d) for s, d in product(range(len(busy)), repeat=2) if movable[s] and not busy[d]]
    best = min((_runs(_after(busy, m)) for m in moves), default=_runs(busy))
    if move is None:
        assert len(busy) > 8 or best >= _runs(busy)
        return
    src, dst = move
    assert movable[src] and not busy[dst]
    assert _runs(_after(busy, move)) < _runs(busy)
    if len(busy) <= 8:  # every candidate is looked at
        assert _runs(_after(busy, move)) == best


def test_the_plan_prefers_an_empty_gap_and_moves_the_highest_sequence():
    assert plan_move([True, False, True], [True, False, True], [0, 0, 0]) == (2, 1)
    assert plan_move([True, True, False, True], [True, True, False, True], [0, 0, 5, 0]) == (3, 2)
    # 0 into 3 joins three runs into one
    busy = [True, False, True, False, True]
    assert plan_move(busy, busy, [0, 7, 0, 0, 0]) == (0, 3)
    # two moves close the gap as well: the one into the empty slot is taken
    assert plan_move([True, False, True, False], [True, False, True, False], [0, 7, 0, 0]) == (0, 3)
    assert plan_move([True, True, False, False], [True, True, False, False], [0, 0, 0, 0]) is None
    assert plan_move([True, False, True], [False, False, False], [0, 0, 0]) is None


def _gap_core(n_tokens: int = MIN_TOKENS_LEFT + 8, **options):
    """Three requests in slots 0-2 of four KV streams; the middle one ends first."""
    core, ctx, model = make_core(n_parallel=4, kv_unified=False, **options)
    rec = Recorder(core, ctx, model)
    params = [greedy(n, ignore_eos=True) for n in (n_tokens, 2, n_tokens)]
    a, b, c = (rec.new(prompt(6, i), p)[0] for i, p in enumerate(params))
    rec.step()
    assert core.running[:3] == [a, b, c]
    return core, ctx, rec, (a, b, c)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_sequence_moves_into_the_gap_a_finished_request_leaves(prefix_cache):
    core, ctx, rec, (a, b, c) = _gap_core(prefix_cache=prefix_cache)
    while not b.done:
        rec.step()
    mark = len(ctx.log)
    rec.step()
    assert core.counters.slot_moves == 1
    if prefix_cache:  # the gap caches b's tokens: a moves next to c instead, into an empty slot
        assert core.running == [None, None, c, a]
        assert ctx.log[mark : mark + 2] == [("seq_cp", 0, 3, -1, -1), ("seq_rm", 0, -1, -1)]
        assert core.table.seq_len(1) > 0 and core.counters.evictions == 0
    else:
        assert core.running == [a, c, None, None]
        assert ctx.log[mark : mark + 2] == [("seq_cp", 2, 1, -1, -1), ("seq_rm", 2, -1, -1)]
    rec.run()
    for r in (a, b, c):
        rec.check_done(r)  # the tokens it would have produced alone
    assert core.counters.slot_moves == 1


def test_a_gap_caching_a_prefix_is_taken_when_no_empty_one_would_do():
    core, ctx, model = make_core(n_parallel=3, kv_unified=False, prefix_cache=True)
    rec = Recorder(core, ctx, model)
    params = [greedy(n, ignore_eos=True) for n in (MIN_TOKENS_LEFT + 8, 2, MIN_TOKENS_LEFT + 8)]
    a, b, c = (rec.new(prompt(6, i), p)[0] for i, p in enumerate(params))
    while not b.done:
        rec.step()
    assert core.table.seq_len(1) > 0  # b's tokens, cached
    rec.step()
    assert core.running == [a, c, None] and core.counters.slot_moves == 1
    assert core.counters.evictions == 1  # counted as admission counts it
    rec.run()
    for r in (a, b, c):
        rec.check_done(r)


def test_a_waiting_request_takes_the_gap_itself():
    core, _, rec, (_, b, _) = _gap_core()
    while not b.done:
        rec.step()
    rec.new(prompt(6, 9), greedy(3))
    rec.step()  # the newcomer takes the gap instead
    assert core.counters.slot_moves == 0 and core.running[1] is not None
    rec.run()


def test_a_sequence_with_few_tokens_left_does_not_move():
    core, _, rec, (a, b, c) = _gap_core(n_tokens=MIN_TOKENS_LEFT + 1)
    rec.run()
    assert core.counters.slot_moves == 0
    for r in (a, b, c):
        rec.check_done(r)


def test_one_kv_buffer_has_no_gaps_to_close():
    core, ctx, model = make_core(n_parallel=4, kv_unified=True)
    rec = Recorder(core, ctx, model)
    for i, n in enumerate((MIN_TOKENS_LEFT + 8, 2, MIN_TOKENS_LEFT + 8)):
        rec.new(prompt(6, i), greedy(n, ignore_eos=True))
    rec.run()
    assert core.counters.slot_moves == 0


def test_real_llama_moves_a_stream_and_keeps_the_reference_log_probs(tiny_path, reference):
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from llamabatch.runtime.metrics import PrometheusListener

    metrics = PrometheusListener(prometheus_client.CollectorRegistry())
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (48, 3, 48)]
    with LLM(tiny_path, n_ctx=4 * 256, n_parallel=4, kv_unified=False, flash_attn=False, n_threads=2) as llm:
        metrics.attach(llm, model_name="tiny")
        prompts = [f"Story number {i} begins on a quiet morning" for i in range(3)]
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
        text = metrics.generate_latest().decode()
    assert stats.slot_moves >= 1 and not stats.kv_unified
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["llamabatch:slot_moves"] == stats.slot_moves
    assert [len(o.token_ids) for o in outs] == [48, 3, 48]
    check_against_reference(reference, outs)


arrivals = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 30), st.integers(0, 60)),  # seed, max_tokens, step
    min_size=2,
    max_size=10,
)


@contextmanager
def _min_tokens_left(n: int) -> Iterator[None]:
    """Sequences with ``n`` tokens left move (short test requests move too)."""
    saved, compaction.MIN_TOKENS_LEFT = compaction.MIN_TOKENS_LEFT, n
    try:
        yield
    finally:
        compaction.MIN_TOKENS_LEFT = saved


@given(arrivals, st.integers(2, 6), st.booleans(), st.sampled_from([1, 4]))
def test_moves_among_random_arrivals_keep_every_answer(requests, n_parallel, reuse, min_left):
    """Requests arrive and end at random on KV streams; sequences move whenever a gap opens
    (with ``min_left`` tokens left), and every answer is what it would be alone."""
    with _min_tokens_left(min_left):
        core, ctx, model = make_core(n_parallel=n_parallel, kv_unified=False, prefix_cache=reuse)
        rec = Recorder(core, ctx, model)
        pending = sorted(requests, key=lambda r: r[2])
        step = 0
        while pending or core.has_unfinished():
            while pending and pending[0][2] <= step:
                seed, max_tokens, _ = pending.pop(0)
                rec.new(prompt(4 + seed % 7, seed), greedy(max_tokens, ignore_eos=True))
            rec.step()  # checks the table against the fake's cells after every step
            step += 1
            assert step < 2000
        for r in rec.requests:
            rec.check_done(r)


def test_random_arrivals_do_move_sequences():
    """The property above is not vacuous: its kind of workload opens gaps that close."""
    with _min_tokens_left(1):
        core, ctx, model = make_core(n_parallel=4, kv_unified=False)
        rec = Recorder(core, ctx, model)
        for seed, n in enumerate([20, 3, 20, 20]):
            rec.new(prompt(5, seed), greedy(n, ignore_eos=True))
        rec.run()
        assert core.counters.slot_moves >= 1
        for r in rec.requests:
            rec.check_done(r)


def test_a_longer_stream_asks_for_more_tokens_left_its_copy_costs_more():
    assert compaction.tokens_left_to_move(64) == compaction.tokens_left_to_move(4096) == MIN_TOKENS_LEFT
    assert compaction.tokens_left_to_move(16384) == 4 * MIN_TOKENS_LEFT
    assert compaction.tokens_left_to_move(16385) == 5 * MIN_TOKENS_LEFT


def test_a_sliding_window_models_moved_answers_match_the_ones_alone():
    """Gemma 3's two KV caches (sliding window and full) both move with the stream."""
    from llamabatch import testing

    path = testing.make_swa_model()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (60, 3, 60)]
    prompts = [f"Story number {i} begins on a quiet morning and goes on" for i in range(3)]
    options = dict(flash_attn=False, n_threads=2)
    with LLM(path, n_ctx=4 * 256, n_parallel=4, kv_unified=False, **options) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats().slot_moves >= 1
    with LLM(path, n_ctx=256, n_parallel=1, **options) as llm:
        alone = [llm.generate(p, params[i], use_tqdm=False)[0].outputs[0] for i, p in enumerate(prompts)]
    for out, ref in zip(outs, alone, strict=True):
        for token, ref_token, logprobs, ref_logprobs in zip(
            out.token_ids, ref.token_ids, out.logprobs, ref.logprobs, strict=True
        ):
            assert logprobs[token] == pytest.approx(ref_logprobs[ref_token], abs=1e-3)
            if token != ref_token:  # a near tie flipped: the rest differs by construction
                break


def test_under_a_tick_time_limit_a_move_waits_for_a_decode_only_tick_its_copy_fits():
    from types import SimpleNamespace

    from fake_llama import FakeModel

    from llamabatch._core.slots import SlotState
    from llamabatch.generate.admission import TickLimit

    model = FakeModel()  # 2 layers x 2 KV heads x (32 + 32) f16 values: 512 bytes a cell
    copy = 512 * 4096 / compaction.COPY_BYTES_PER_S  # one 4,096-cell stream

    def core(limit, prefilling=0):
        admission = SimpleNamespace(tick_limit=lambda: None if limit is None else TickLimit(None, limit))
        table = SimpleNamespace(count=lambda state: prefilling if state is SlotState.PREFILL else 0)
        config = SimpleNamespace(type_k="f16", type_v="f16")
        return SimpleNamespace(admission=admission, table=table, config=config, model=model, n_ctx_seq=4096)

    fits = compaction.copy_fits_the_tick
    assert fits(core(None)) and fits(core(None, prefilling=1))  # no limit: the copy is free to join
    assert fits(core(2 * copy)) and not fits(core(2 * copy * 0.99))  # within half the limit
    assert not fits(core(1.0, prefilling=1))  # a prompt's slice fills the tick up to the limit


def test_a_move_happens_under_a_loose_latency_target():
    core, _, rec, (a, b, c) = _gap_core(target_itl_ms=10_000.0)
    rec.run()
    assert core.counters.slot_moves == 1
    for r in (a, b, c):
        rec.check_done(r)


def test_the_real_models_tokens_are_the_same_with_and_without_moves(smollm2_path, monkeypatch):
    """SmolLM2 (real weights): moving a stream changes which ubatch its row is decoded in, not
    its tokens."""
    from llamabatch.generate import core

    prompts = [
        "Write a short story about a lighthouse keeper.",
        "List three colours.",
        "Explain how a bicycle works, step by step.",
    ]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (64, 4, 64)]

    def run() -> tuple[list[list[int]], int]:
        with LLM(smollm2_path, n_ctx=4 * 512, n_parallel=4, kv_unified=False, n_threads=2) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs], llm.stats().slot_moves

    moved, n_moves = run()
    monkeypatch.setattr(core, "compact", lambda _core: False)
    kept, no_moves = run()
    assert n_moves >= 1 and no_moves == 0
    assert moved == kept
