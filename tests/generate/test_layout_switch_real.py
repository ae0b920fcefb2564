"""The KV layout switch on real llama.cpp: a sequence's state rewritten for another layout
gives the log-probabilities of the same prefix computed there; an engine serving requests
sharing a prefix switches to one unified buffer between workloads and loses no cached prefix
(the same prompt after the switch reuses it and gives the same log-probabilities)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from llamabatch import LLMEngine, SamplingParams, testing
from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch.generate import layout_switch
from llamabatch.generate.kv_state_format import convert_seq_state

LAYOUTS = [(True, True), (True, False), (False, False), (False, True)]


@pytest.mark.parametrize("src", LAYOUTS, ids=str)
def test_a_rewritten_state_loads_in_every_layout(tiny_path, src):
    model = Model(tiny_path)
    try:
        tokens = [1, *range(5, 60)]
        source = Context(model, n_ctx=512, n_batch=256, n_seq_max=3, kv_unified=src[0], flash_attn=src[1])
        source.decode_tokens(tokens, seq_id=2)
        data = source.state_seq_get(2)
        source.close()
        for unified, flash in LAYOUTS:
            target = Context(model, n_ctx=512, n_batch=256, n_seq_max=3, kv_unified=unified, flash_attn=flash)
            target.decode_tokens(tokens, seq_id=0)
            target.decode_tokens([7], pos0=len(tokens), seq_id=0)
            computed = np.array(target.logits_rows(1)[0])
            state = convert_seq_state(data, 1 if unified else 3, not flash, model.n_layer)
            assert state is not None and target.state_seq_set(1, state)
            target.decode_tokens([7], pos0=len(tokens), seq_id=1)
            restored = np.array(target.logits_rows(1)[0])
            target.close()
            tolerance = 1e-4 if flash == src[1] else 0.05  # flash attention's own rounding
            assert np.abs(restored - computed).max() <= tolerance, (unified, flash)
    finally:
        model.close()


@pytest.fixture
def eager(monkeypatch):
    """Switch at the first quiet moment the rules allow (the hysteresis is tested pure)."""
    monkeypatch.setattr(layout_switch, "CONFIRM", 1)
    monkeypatch.setattr(layout_switch, "MIN_REQUESTS_BETWEEN", 0)
    monkeypatch.setattr(layout_switch, "COST_MARGIN", 0.0)


def test_switch_between_workloads_keeps_the_cached_prefixes(tiny_path, eager):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    words = " ".join(testing.english_sentences(200)).split()
    with LLMEngine(tiny_path, n_parallel=4, n_batch=256, flash_attn=False, cache_ram=0) as engine:
        assert not engine.stats().kv_unified  # the default here: a stream per sequence
        system = engine.tokenize(" ".join(words[:150]))[:120]
        prompts = [
            system + engine.tokenize(" ".join(words[150 + 7 * i :]), add_special=False)[:10] for i in range(8)
        ]
        engine.add_request(prompts[0], params)  # the prefix first, then the rest reuse it
        engine.run_until_complete()
        for p in prompts[1:]:
            engine.add_request(p, params)
        before = {tuple(o.prompt_token_ids): o for o in engine.run_until_complete()}
        stats = engine.stats()
        assert stats.layout_switches == 1, stats
        assert stats.layout_switch_reasons == {"shared_prefix": 1}
        assert stats.kv_unified and stats.flash_attn is False
        assert stats.layout_switch_time_s > 0 and stats.layout_lost_tokens == 0
        assert stats.layout_carried_tokens >= 120
        # the carried states share the prefix's cells again, as before the switch: one copy
        assert stats.kv_cells_used < 2 * 120 + 4 * 20, stats.kv_cells_used
        again = prompts[5]
        engine.add_request(again, params)
        (after,) = engine.run_until_complete()
    assert after.usage.reused_tokens >= 120  # the prefix came through the switch
    old = before[tuple(again)]
    assert after.token_ids == old.token_ids  # same layout family (flash attention off): same tokens
    for a, b in zip(after.logprobs, old.logprobs, strict=True):
        for token, value in b.items():
            assert a[token] == pytest.approx(value, abs=1e-3)


def test_pinned_layout_never_switches(tiny_path, eager):
    params = SamplingParams(max_tokens=2, temperature=0)
    with LLMEngine(tiny_path, n_parallel=4, n_batch=256, kv_unified=False, flash_attn=False) as engine:
        system = list(range(5, 130))
        for i in range(10):
            engine.add_request([1, *system, 200 + i], params)
        engine.run_until_complete()
        assert engine.stats().layout_switches == 0


def test_llm_thread_switches_when_quiet(tiny_path, eager):
    """The same through ``LLM``: its engine thread switches after its last request, and the
    requests after the switch run on the new context."""
    from llamabatch import LLM

    params = SamplingParams(max_tokens=3, temperature=0)
    with LLM(tiny_path, n_parallel=4, n_batch=256, flash_attn=False) as llm:
        system = [1, *range(5, 125)]
        llm.generate([*system, 300], params, use_tqdm=False)
        first = llm.generate([[*system, 301 + i] for i in range(8)], params, use_tqdm=False)
        deadline = time.monotonic() + 10
        while llm.stats().layout_switches == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the switch runs on the engine thread, after the last answer
        stats = llm.stats()
        assert stats.layout_switches == 1 and stats.kv_unified, stats
        again = llm.generate([[*system, 301 + i] for i in range(8)], params, use_tqdm=False)
        assert llm.stats().layout_lost_tokens == 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert all(o.outputs[0].usage.reused_tokens >= 120 for o in again)


def test_prompts_repeated_without_a_common_prefix_are_not_a_shared_prefix(tiny_path, eager):
    """Rounds of the same independent prompts reuse each prompt's own cache (one sequence's
    cells, in place), not a prefix several sequences hold at once: one buffer gains nothing
    there, so the layout stays."""
    params = SamplingParams(max_tokens=4, temperature=0)
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(5, 250, size=60).tolist()] for _ in range(4)]
    with LLMEngine(tiny_path, n_parallel=4, n_batch=256, flash_attn=False, cache_ram=0) as engine:
        for _ in range(6):
            for p in prompts:
                engine.add_request(p, params)
            outputs = engine.run_until_complete()
            assert len(outputs) == 4
        stats = engine.stats()
    assert stats.reused_tokens >= 4 * 4 * 59  # the rounds after the first reused their prompts
    assert stats.layout_switches == 0, stats.layout_switch_reasons


def test_a_switch_puts_each_state_back_where_it_was(tiny_path):
    """A carried RAM-tier state goes back to the RAM tier, not into a slot the new context
    has to spare (an idle slot's cells are attended by every tick of one unified buffer);
    a slot's state goes to a slot."""
    params = SamplingParams(max_tokens=2, temperature=0)
    prompts = [[1, *range(5 + 50 * i, 5 + 50 * i + 60)] for i in range(2)]
    with LLMEngine(tiny_path, n_parallel=4, n_batch=256, flash_attn=False, cache_ram=64) as engine:
        for p in prompts:
            engine.add_request(p, params)
        engine.run_until_complete()
        (a, a_state, _, _), (b, b_state, _, _) = sorted(layout_switch.carry_states(engine.core))
    with LLMEngine(tiny_path, n_parallel=4, n_batch=256, kv_unified=True, cache_ram=64) as engine:
        core = engine.core
        carried = [(a, a_state, False, "client a"), (b, b_state, True, "client b")]
        kept, lost = layout_switch.restore_states(core, carried, engine.model.n_layer)
        assert (kept, lost) == (len(a) + len(b), 0)
        held = [(core.table.seq_tokens(s).tolist(), core.kv.owners[s]) for s in range(4)]
        held = [(tokens, owner) for tokens, owner in held if tokens]
        assert held == [(b, "client b")]  # each keeps the client it was saved for
        assert engine.stats().ram_cache_entries == 1
        assert core.kv.ram is not None and [e.owner for e in core.kv.ram.entries()] == ["client a"]
        engine.add_request([*a, 7], params)  # and both are found where they went
        engine.add_request([*b, 7], params)
        outs = engine.run_until_complete()
        assert all(o.usage.reused_tokens >= 60 for o in outs), [o.usage.reused_tokens for o in outs]
        assert engine.stats().ram_cache_restores == 1


def test_a_given_n_ctx_stays_each_requests_through_switches(tiny_path, eager):
    """With ``n_ctx`` given, the default's streams hold ``n_ctx`` each; a shared prefix moves
    the engine to one unified buffer of ``n_ctx`` and independent prompts move it back to the
    streams, undivided: a request may use all of ``n_ctx`` in every layout."""
    params = SamplingParams(max_tokens=6, temperature=0)  # long enough to run together (busy >= 2)
    options = dict(n_ctx=1024, n_parallel=4, n_batch=256, flash_attn=False, cache_ram=0)
    with LLMEngine(tiny_path, **options) as engine:
        stats = engine.stats()
        assert not stats.kv_unified and engine.n_ctx_seq == 1024 and stats.n_ctx == 4 * 1024
        system = [1, *range(5, 125)]
        engine.add_request([*system, 300], params)
        engine.run_until_complete()
        for i in range(8):
            engine.add_request([*system, 301 + i], params)
        engine.run_until_complete()
        assert engine.stats().kv_unified and engine.n_ctx_seq == 1024
        for i in range(layout_switch.WINDOW):  # independent prompts fill the watcher's window
            engine.add_request([1, *range(400 + 30 * i, 420 + 30 * i)], params)
        engine.run_until_complete()
        stats = engine.stats()
        assert stats.layout_switches == 2
        assert stats.layout_switch_reasons == {"shared_prefix": 1, "independent": 1}
        assert not stats.kv_unified and engine.n_ctx_seq == 1024 and stats.n_ctx == 4 * 1024
        engine.add_request([1, *range(5, 1000)], params)  # nearly all of n_ctx, in one stream
        (out,) = engine.run_until_complete()
    assert len(out.token_ids) == 6
