"""The engine core over the fake llama.cpp (``fake_llama.py``), continued from
``test_scheduler_fake.py``: cancellation, decode failures and aborts, requests that cannot
fit, and ``LLMEngine`` / ``LLM`` driven over the fake."""

from __future__ import annotations

from collections import defaultdict

import pytest
from fake_llama import FakeModel, make_core, patch_llamabatch
from fake_scheduling import Recorder, greedy, oversubscribed, prompt

from llamabatch import LLM, LLMEngine, PromptTooLong
from llamabatch.generate.kv_cache import PinnedPrefix
from llamabatch.generate.request import Request

# -- cancellation ---------------------------------------------------------------------------


def test_cancelling_a_waiting_request_ends_it_once_without_running_it():
    core, ctx, model = make_core(n_parallel=1)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(5, 1), greedy(6))[0]
    b = rec.new(prompt(5, 2), greedy(6))[0]
    rec.step()
    core.abort(b)
    core.abort(b)
    rec.step()
    assert b.done and b.finish_reason == "cancelled" and b.output.token_ids == []
    assert b not in core.waiting and core.running[0] is a
    core.abort(b)  # after the end: nothing
    rec.run()
    rec.check_done(a)
    rec.check_done(b)
    assert a.finish_reason == "length"


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_cancelling_a_running_request_frees_its_slot_and_cells(prefix_cache):
    core, ctx, model = make_core(n_parallel=1, prefix_cache=prefix_cache)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(10, 1), greedy(20))[0]
    b = rec.new(prompt(10, 2), greedy(2))[0]
    for _ in range(4):
        rec.step()
    core.abort(a)
    rec.step()  # a ends first, then b is admitted into its slot in the same step
    assert a.finish_reason == "cancelled" and len(a.output.token_ids) == 4
    assert core.running[0] is b
    rec.run()
    rec.check_done(a)
    rec.check_done(b)
    if not prefix_cache:
        assert ctx.cells_used() == 0


def test_cancelling_a_preempted_request_keeps_what_it_generated():
    core, rec = oversubscribed()
    a = rec.new(prompt(20, 1), greedy(30))[0]
    b = rec.new(prompt(20, 2), greedy(30))[0]
    while not b.n_preemptions:
        rec.step()
    generated = list(b.output_tokens)
    core.abort(b)
    rec.step()
    assert b.finish_reason == "cancelled" and b.output.token_ids == generated
    rec.run()
    rec.check_done(a)
    rec.check_done(b)


# -- decode failures ------------------------------------------------------------------------


def test_a_decode_error_fails_only_that_batch_and_the_engine_keeps_serving():
    core, ctx, model = make_core(n_parallel=3, n_batch=4)
    rec = Recorder(core, ctx, model)
    a, b, c = (rec.new([i + 1, i + 2], greedy(4))[0] for i in range(3))
    ctx.script.append(-3)
    rec.step()  # the batch holds a's and b's prompts (4 tokens), not c's
    assert a.finish_reason == "error" and b.finish_reason == "error"
    assert "fatal" in a.output.error
    assert not c.done
    d = rec.new(prompt(5, 4), greedy(4))[0]
    rec.run()
    for r in (a, b, c, d):
        rec.check_done(r)
    assert c.finish_reason == "length" and d.finish_reason == "length"


@pytest.mark.parametrize("kv_unified", [True, False])
def test_a_decode_failing_midway_leaves_no_cells_behind(kv_unified):
    core, ctx, model = make_core(n_parallel=2, n_ubatch=4, kv_unified=kv_unified)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(10, 1), greedy(3))[0]
    ctx.script.append((-3, 2))  # 8 cells written, then a failed compute
    rec.step()
    assert a.finish_reason == "error" and ctx.cells_used() == 0
    b = rec.new(prompt(10, 2), greedy(3))[0]
    ctx.script.append((1, 1))  # no room after one ubatch: 4 cells written, then retried smaller
    rec.run()
    rec.check_done(b)
    assert b.finish_reason == "length" and core.counters.decode_retries >= 1


def test_an_aborted_decode_is_an_error_unless_the_driver_is_closing():
    core, ctx, model = make_core(n_parallel=2)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(5, 1), greedy(5))[0]
    ctx.abort()
    rec.step()
    assert a.finish_reason == "error" and "aborted" in a.output.error
    assert not ctx.abort_requested  # cleared: the next decode runs
    b = rec.new(prompt(5, 2), greedy(5))[0]
    rec.step()
    core.stopping = True
    ctx.abort()
    rec.step()
    assert not b.done  # closing: no error; the driver ends it
    rec.record(core.fail_all("cancelled"))
    assert b.finish_reason == "cancelled"
    rec.check_done(b)


def test_a_request_that_cannot_fit_even_alone_fails_instead_of_looping():
    core, ctx, model = make_core(n_parallel=2, n_ctx=64)
    rec = Recorder(core, ctx, model)
    a = rec.new(prompt(10, 1), greedy(4))[0]
    ctx.script.extend([1] * 100)  # no room, whatever is freed
    rec.step()
    assert a.finish_reason == "error" and "no room in the KV cache" in a.output.error
    ctx.script.clear()
    b = rec.new(prompt(10, 2), greedy(4))[0]
    rec.run()
    rec.check_done(b)
    assert b.finish_reason == "length"


def test_a_pinned_prefix_leaving_too_little_room_fails_the_request_in_bounded_steps():
    core, ctx, model = make_core(n_parallel=2, n_ctx=64, prefix_cache=True, max_prefixes=1)
    rec = Recorder(core, ctx, model)
    pin = PinnedPrefix(core.kv.new_pin_seq(), prompt(40, 1))
    pinner = Request(pin.tokens, greedy(1), pin=pin)
    rec.add(pinner)
    rec.run()
    assert pinner.finish_reason == "stop" and core.table.seq_len(pin.seq_id) == 40
    r = rec.new(prompt(40, 2), greedy(2))[0]  # 40 new cells; 24 are free
    rec.run(max_steps=100)
    assert r.finish_reason == "error"
    assert core.table.seq_len(pin.seq_id) == 40
    # a request starting with the pinned prefix computes only its own tail
    s = rec.new(pin.tokens + prompt(5, 3), greedy(3))[0]
    rec.run()
    rec.check_done(s)
    assert s.finish_reason == "length" and s.reused_tokens == 40


def test_a_pin_sequence_given_back_while_its_request_runs_is_not_pinned_into():
    """LLM.register_prefix gives the sequence back when its wait times out."""
    core, ctx, model = make_core(n_parallel=2, prefix_cache=True, max_prefixes=1, chunk_size=8)
    rec = Recorder(core, ctx, model)
    pin = PinnedPrefix(core.kv.new_pin_seq(), prompt(30, 1))
    pinner = Request(pin.tokens, greedy(1), pin=pin)
    rec.add(pinner)
    rec.step()  # 8 of 30 prompt tokens computed
    core.kv.drop_pin_seq(pin.seq_id)  # what LLM.register_prefix does when its wait times out
    rec.run()
    kv = core.kv
    assert not set(kv.pinned) & set(kv._free_pin_seqs), "a sequence both pinned and free"


# -- LLMEngine and LLM over the fake ----------------------------------------------------------


def _engine(monkeypatch, **options) -> tuple[LLMEngine, FakeModel]:
    model = patch_llamabatch(monkeypatch)
    engine = LLMEngine("fake.gguf", **options)
    engine.context.batch = engine.core.batch
    return engine, model


@pytest.mark.parametrize("kv_unified", [True, False])
def test_llm_engine_step_outputs_add_up_to_the_final_outputs(monkeypatch, kv_unified):
    engine, model = _engine(monkeypatch, n_ctx=256, n_parallel=4, n_batch=16, kv_unified=kv_unified)
    prompts = [prompt(6 + 5 * i, i) for i in range(6)]
    ids = [engine.add_request(p, greedy(12), request_id=f"r{i}") for i, p in enumerate(prompts)]
    group = engine.add_request(prompts[0], greedy(5, n=2))
    engine.abort_request("r5")
    tokens: dict = defaultdict(list)
    texts: dict = defaultdict(list)
    finished: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.index)
            assert key not in finished, "output after the end"
            tokens[key] += out.new_token_ids
            texts[key].append(out.text)
            if out.finished:
                finished[key] = out.output
                assert out.finish_reason == out.output.finish_reason
    assert set(finished) == {(i, 0) for i in ids} | {(group, 0), (group, 1)}
    for key, output in finished.items():
        assert tokens[key] == output.token_ids and "".join(texts[key]) == output.text
    assert finished[("r5", 0)].finish_reason == "cancelled"
    for i in range(5):
        expected = model.completion(prompts[i], 12, engine.n_ctx_seq)[0]
        assert finished[(f"r{i}", 0)].token_ids == expected
    assert finished[(group, 0)].token_ids == finished[(group, 1)].token_ids
    stats = engine.stats()
    assert stats.requests == 8 and stats.busy_slots == 0 and stats.queue_depth == 0
    engine.close()


def test_llm_engine_preempts_under_kv_pressure_and_counts_it(monkeypatch):
    engine, model = _engine(
        monkeypatch, n_ctx=64, n_parallel=4, n_batch=32, kv_unified=True, prefix_cache=False
    )
    prompts = [prompt(14, i) for i in range(6)]
    for p in prompts:
        engine.add_request(p, greedy(20))
    outs = engine.run_until_complete()
    assert [o.token_ids for o in outs] == [model.completion(p, 20, 64)[0] for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.preemptions == sum(o.timings.preemptions for o in outs)
    with pytest.raises(PromptTooLong):
        engine.add_request(prompt(60, 9), greedy(5))
    engine.close()


def test_llm_and_llm_engine_give_the_same_tokens(monkeypatch):
    model = patch_llamabatch(monkeypatch)
    options = dict(n_ctx=96, n_parallel=4, n_batch=16, kv_unified=True, prefix_cache=True)
    prompts = [prompt(5 + 3 * i, i % 5) for i in range(10)]
    with LLMEngine("fake.gguf", **options) as engine:
        for p in prompts:
            engine.add_request(p, greedy(9))
        via_engine = [o.token_ids for o in engine.run_until_complete()]
    with LLM("fake.gguf", **options) as llm:
        via_llm = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(9), use_tqdm=False)]
    assert via_engine == via_llm == [model.completion(p, 9, 96)[0] for p in prompts]
