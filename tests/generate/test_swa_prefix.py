"""Prefix reuse on a sliding-window (Gemma 3 style) model: a prompt continued from a cached
or saved prefix gives the log-probabilities a fresh computation gives, whatever the sliding
cache dropped; what cannot be reused is computed again, and counted."""

from __future__ import annotations

import numpy as np
import pytest
from fake_llama import FakeModel, make_core
from fake_scheduling import Recorder, greedy, prompt

from llamabatch import LLM, SamplingParams, testing
from llamabatch.generate.swa import SKIP_SLIDING_WINDOW, SlidingWindow, sliding_window_for

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
#: flash attention off: on, llama.cpp's kernel for the unified buffer depends on the cells a
#: sequence's KV sits in (see test_batch_invariant), a divergence not of the reuse
OPTIONS = dict(n_threads=2, n_threads_batch=2, flash_attn=False)


@pytest.fixture(scope="module")
def swa_path(tmp_path_factory):
    return testing.make_swa_model(tmp_path_factory.mktemp("swa"))


@pytest.fixture(scope="module")
def fresh(swa_path):
    """The log-probabilities of a prompt computed from nothing (no prefix reuse at all), by
    an engine of the tests' layout (``kv_unified``): another layout's kernels differ a little."""
    engines = {
        unified: LLM(swa_path, n_parallel=2, n_ctx=1024, prefix_cache=False, kv_unified=unified, **OPTIONS)
        for unified in (True, False)
    }

    def compute(tokens: list[int], kv_unified: bool) -> list[dict[int, float]]:
        return _logprobs(engines[kv_unified].generate(tokens, PARAMS, use_tqdm=False)[0].outputs[0])

    yield compute
    for llm in engines.values():
        llm.close()


def _logprobs(out) -> list[dict[int, float]]:
    assert out.finish_reason == "length", out.finish_reason
    return [dict(d) for d in out.logprobs]


def _same(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for token in w:
            assert g[token] == pytest.approx(w[token], abs=1e-3)


def _texts(llm: LLM, n: int, n_tokens: int, offset: int = 0) -> list[list[int]]:
    words = " ".join(testing.english_sentences(80)).split()
    return [llm.tokenize(" ".join(words[offset + 37 * i :]), add_special=False)[:n_tokens] for i in range(n)]


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "split"])
def test_a_prompt_back_from_the_ram_tier_gives_the_fresh_logprobs(swa_path, fresh, kv_unified):
    """The prompt again after others pushed it to the RAM tier: its saved state holds the
    sliding window at the end of its output, not of its prompt, so it is computed again."""
    with LLM(swa_path, n_parallel=2, n_ctx=1024, cache_ram=64, kv_unified=kv_unified, **OPTIONS) as llm:
        first, *others = [[*llm.tokenize(""), *t] for t in _texts(llm, 4, 60)]
        llm.generate(first, PARAMS, use_tqdm=False)
        for other in others:
            llm.generate(other, PARAMS, use_tqdm=False)
        again = llm.generate(first, PARAMS, use_tqdm=False)[0].outputs[0]
        stats = llm.stats()
    _same(_logprobs(again), fresh(first, kv_unified))
    assert stats.ram_cache_saves >= 1
    assert stats.ram_cache_restore_skipped.get(SKIP_SLIDING_WINDOW, 0) >= 1, stats.ram_cache_restore_skipped


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "split"])
def test_a_conversation_continued_from_the_ram_tier_is_restored(swa_path, fresh, kv_unified):
    """A next turn (the whole saved sequence and more) continues from the state's end: restored."""
    with LLM(swa_path, n_parallel=2, n_ctx=1024, cache_ram=64, kv_unified=kv_unified, **OPTIONS) as llm:
        first, *others = [[*llm.tokenize(""), *t] for t in _texts(llm, 4, 60)]
        out = llm.generate(first, PARAMS, use_tqdm=False)[0].outputs[0]
        for other in others:
            llm.generate(other, PARAMS, use_tqdm=False)
        follow = first + list(out.token_ids) + _texts(llm, 1, 10, offset=900)[0]
        got = llm.generate(follow, PARAMS, use_tqdm=False)[0].outputs[0]
        stats = llm.stats()
    assert stats.ram_cache_restores == 1, stats
    assert got.usage.reused_tokens >= 60
    _same(_logprobs(got), fresh(follow, kv_unified))


def test_a_partial_restore_beside_a_shared_system_prompt_is_not_sent(swa_path, fresh):
    """Unified KV cache: a prompt matching a saved conversation's start (not its end) while
    another slot holds their system prompt. Sharing that slot's cells into the restored
    sequence once gave llama.cpp "inconsistent sequence positions" (an error, no output)."""
    with LLM(swa_path, n_parallel=2, n_ctx=1024, cache_ram=64, kv_unified=True, **OPTIONS) as llm:
        system = [*llm.tokenize(""), *_texts(llm, 1, 29, offset=500)[0]]
        a, b, tail = _texts(llm, 3, 40)
        conv_a, conv_b = system + a, system + b
        partial = conv_a[:50] + tail[:20]
        outs = [llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0] for p in (conv_a, conv_b, partial)]
        stats = llm.stats()
    assert outs[1].usage.reused_tokens == 30  # the system prompt, from conversation a's slot
    assert stats.ram_cache_saves >= 1 and stats.ram_cache_hits >= 1
    _same(_logprobs(outs[2]), fresh(partial, True))


# -- the window's rules, on the fake engine --------------------------------------------------


class _Positions:
    def __init__(self, pos_min: dict[int, int]) -> None:
        self.pos_min = pos_min

    def seq_pos_min(self, seq_id: int) -> int:
        return self.pos_min.get(seq_id, -1)


def test_the_window_rules():
    window = SlidingWindow(_Positions({0: 0, 1: 30, 2: 35}), n_swa=16)
    assert window.lowest_needed(10) == 0 and window.lowest_needed(50) == 35
    assert window.holds(0, 50) and window.holds(2, 50) and not window.holds(1, 44)
    assert window.holds(1, 45) and not window.holds(3, 5) and window.holds(3, 0)
    assert window.restorable(80, 80) and not window.restorable(80, 79) and not window.restorable(80, 40)
    assert window.restorable(15, 3)  # shorter than the window: nothing was left out
    assert sliding_window_for(_Positions({}), 0) is None
    with pytest.raises(ValueError, match="n_swa"):
        SlidingWindow(_Positions({}), 0)


def test_a_prefix_whose_window_the_cache_dropped_is_computed_and_counted():
    core, ctx, model = make_core(n_parallel=2, prefix_cache=True, cache_ram=0, model=FakeModel(n_swa=8))
    rec = Recorder(core, ctx, model)
    base = prompt(40, 1)
    (r,) = rec.new(base, greedy(4))
    rec.run()
    rec.check_done(r)
    held = ctx.seq_pos_min
    # as a sliding cache does: both slots' positions below 24 left the window
    ctx.seq_pos_min = lambda seq: max(held(seq), 24) if held(seq) >= 0 else -1
    (cut,) = rec.new(base[:30] + prompt(10, 2), greedy(4))  # 30 attends to [23, 30): 23 is gone
    rec.run()
    rec.check_done(cut)
    assert cut.output.usage.reused_tokens == 0
    assert core.kv.tier_stats()["swa_prefix_recomputed"] == 1
    (whole,) = rec.new(base[:31] + prompt(10, 3), greedy(4))  # 31 attends to [24, 31): held
    rec.run()
    rec.check_done(whole)
    assert whole.output.usage.reused_tokens == 31
    assert core.kv.tier_stats()["swa_prefix_recomputed"] == 1


def test_a_prompt_waits_only_for_a_state_it_can_continue():
    """Unified cache, a running request holding the room: a prompt whose best match is a
    saved state waits for the room only when the sliding window lets it continue that state."""
    core, ctx, model = make_core(
        n_parallel=2, n_ctx=128, prefix_cache=True, cache_ram=64, model=FakeModel(n_swa=8)
    )
    rec = Recorder(core, ctx, model)
    conv = prompt(40, 1)
    (first,) = rec.new(conv, greedy(6))
    rec.run()
    for seed in (2, 3):  # two other conversations push the first to the RAM tier
        rec.new(prompt(40, seed), greedy(6))
        rec.run()
    ram = core.kv.ram
    assert ram is not None and ram.covers(np.asarray(conv, dtype=np.int32)) is not None
    rec.new(prompt(90, 4), greedy(30))
    for _ in range(5):  # its prompt computed, decoding
        rec.step()
    assert core.kv.table.busy_slots == 1
    again = conv  # its state ends 5 generated tokens later: cut, its window is gone
    assert not core.kv.restore_worth_waiting(again)
    assert ram.restore_waits == 0
    next_turn = conv + first.output.token_ids[:5] + prompt(10, 5)
    assert core.kv.restore_worth_waiting(next_turn)
    assert ram.restore_waits == 1
    rec.run()
