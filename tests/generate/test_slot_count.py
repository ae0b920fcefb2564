"""Slots follow the load: with ``n_parallel=None`` (the default) the slots are as many as the KV
memory holds and the tick's cost allows (``generate/slot_count.py``); a given ``n_parallel`` wins."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch import LLM, EngineConfig, SamplingParams
from llamabatch._ffi.kv_types import kv_bytes_per_cell
from llamabatch._ffi.model import Model
from llamabatch.generate.kv_memory import plan_kv
from llamabatch.generate.slot_count import MAX_SLOTS, MIN_CELLS_PER_SLOT, MIN_UNIFIED_SLOTS, slots_for_kv
from llamabatch.gguf.testing import PRESETS, model_path
from llamabatch.runtime.telemetry import TickEvent


@settings(max_examples=300, deadline=None)
@given(
    unified=st.booleans(),
    n_ctx=st.one_of(st.none(), st.integers(1, 1 << 20)),
    stream_bytes=st.integers(0, 1 << 32),
    budget=st.one_of(st.none(), st.integers(0, 1 << 40)),
    n_prefixes=st.integers(0, 64),
    extra_batch=st.integers(1, 4096),
    cap=st.integers(1, 256),
)
def test_never_more_sequences_than_the_kv_memory_holds(
    unified, n_ctx, stream_bytes, budget, n_prefixes, extra_batch, cap
) -> None:
    if unified and n_ctx is None:
        with pytest.raises(ValueError, match="n_ctx"):
            slots_for_kv(unified=True, n_ctx=None, stream_bytes=1, budget=1, n_prefixes=0, n_batch=8)
        return
    n_batch = n_prefixes + extra_batch  # EngineConfig's checks: n_batch >= one slot + prefixes
    count = slots_for_kv(
        unified=unified,
        n_ctx=n_ctx,
        stream_bytes=stream_bytes,
        budget=budget,
        n_prefixes=n_prefixes,
        n_batch=n_batch,
        cap=cap,
    )
    n = count.n_parallel
    assert 1 <= n <= cap and n + n_prefixes <= n_batch and count.reason
    if n == 1:
        return  # one slot always: a request must run
    if unified:
        # every slot 256+ cells of the buffer on average, or the small buffer's floor of slots
        assert n * MIN_CELLS_PER_SLOT <= n_ctx or n <= MIN_UNIFIED_SLOTS
    elif n_ctx is not None:
        assert (n + n_prefixes) * MIN_CELLS_PER_SLOT <= n_ctx  # every stream 256+ cells
    elif budget is not None and stream_bytes > 0:
        assert (n + n_prefixes) * stream_bytes <= budget  # every stream allocated whole
    else:
        assert n == min(cap, n_batch - n_prefixes)  # memory unknown: the tick's cost and n_batch


def test_the_tightest_bound_is_the_reason() -> None:
    kv = slots_for_kv(unified=True, n_ctx=4096, stream_bytes=0, budget=None, n_prefixes=4, n_batch=512)
    assert kv.n_parallel == 16 and "KV memory" in kv.reason
    tick = slots_for_kv(unified=True, n_ctx=1 << 20, stream_bytes=0, budget=None, n_prefixes=4, n_batch=512)
    assert tick.n_parallel == MAX_SLOTS and "tick's cost" in tick.reason
    batch = slots_for_kv(unified=True, n_ctx=1 << 20, stream_bytes=0, budget=None, n_prefixes=4, n_batch=20)
    assert batch.n_parallel == 16 and "n_batch" in batch.reason
    streams = slots_for_kv(unified=False, n_ctx=None, stream_bytes=10, budget=125, n_prefixes=2, n_batch=512)
    assert streams.n_parallel == 10 and "KV memory" in streams.reason


def test_a_small_unified_buffer_still_runs_the_old_default_of_slots() -> None:
    """``LLM(n_ctx=512)`` decoded 8 short requests together before slots followed the memory."""
    small = slots_for_kv(unified=True, n_ctx=512, stream_bytes=0, budget=None, n_prefixes=0, n_batch=512)
    assert small.n_parallel == MIN_UNIFIED_SLOTS and "share n_ctx 512" in small.reason


@pytest.fixture(scope="module")
def model_8k():
    spec = dataclasses.replace(PRESETS["small"], n_ctx_train=8192, name="llamabatch-small-8k")
    with Model(str(model_path(spec))) as model:
        yield model


@settings(max_examples=60, deadline=None)
@given(
    n_parallel=st.integers(1, 40),
    n_ctx=st.one_of(st.none(), st.integers(256, 1 << 17)),
    kv_unified=st.sampled_from([None, True, False]),
    budget=st.one_of(st.none(), st.integers(1 << 20, 1 << 36)),
)
def test_a_given_n_parallel_always_wins(model_8k, n_parallel, n_ctx, kv_unified, budget) -> None:
    config = EngineConfig(n_parallel=n_parallel, n_ctx=n_ctx, kv_unified=kv_unified)
    plan = plan_kv(model_8k, config, budget=budget)
    assert plan.n_parallel == n_parallel and plan.slots_reason == "n_parallel given"


@settings(max_examples=60, deadline=None)
@given(
    n_ctx=st.one_of(st.none(), st.integers(256, 1 << 17)),
    kv_unified=st.sampled_from([None, True, False]),
    budget=st.one_of(st.none(), st.integers(1 << 20, 1 << 36)),
    n_batch=st.sampled_from([16, 64, 512]),
)
def test_default_slots_fit_the_kv_plan(model_8k, n_ctx, kv_unified, budget, n_batch) -> None:
    """The default's slots fit the memory the plan chose: per-stream ones whole streams of the
    trained context (or of a given n_ctx) inside the per-stream budget, when the layout was
    chosen."""
    config = EngineConfig(n_ctx=n_ctx, kv_unified=kv_unified, n_batch=n_batch)
    plan = plan_kv(model_8k, config, budget=budget)
    resolved = config.replace(n_parallel=plan.n_parallel, kv_unified=plan.kv_unified)
    n_seq = resolved.n_seq_max
    assert 1 <= plan.n_parallel <= MAX_SLOTS and n_seq <= n_batch and n_seq <= plan.n_ctx
    if plan.kv_unified:
        assert plan.n_parallel <= MIN_UNIFIED_SLOTS or plan.n_parallel * MIN_CELLS_PER_SLOT <= plan.n_ctx
    elif kv_unified is None and budget is not None:  # per-stream chosen: it fits half the budget
        assert plan.n_ctx * kv_bytes_per_cell(model_8k) <= budget // 2
        assert plan.n_ctx == n_seq * (n_ctx or 8192)


@pytest.mark.parametrize(
    ("options", "slots", "bound"),
    [
        ({"n_ctx": 4096, "kv_unified": True}, 16, "KV memory"),
        ({"n_ctx": 4096}, MAX_SLOTS, "tick's cost"),
        ({}, MAX_SLOTS, "tick's cost"),
    ],
    ids=["n_ctx-4096-unified", "n_ctx-4096", "no-n_ctx"],
)
def test_defaults_run_16_requests_in_one_wave(tiny_path, options, slots, bound) -> None:
    """16 prompts x (16 + 8) on the defaults: in one unified buffer of ``n_ctx=4096`` 16 slots
    of 256 cells; otherwise a stream of ``n_ctx`` (or of the tiny model's whole context) for as
    many slots as the tick's cost allows; all 16 decode together (a fixed default of 8 slots
    ran them in two waves)."""
    busy: list[int] = []
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1] + [10 + (7 * i + j) % 200 for j in range(15)] for i in range(16)]
    with LLM(tiny_path, n_threads=1, **options) as llm:
        llm.add_listener(lambda e: busy.append(e.decode_tokens) if isinstance(e, TickEvent) else None)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 16
    assert stats.n_parallel == slots and bound in stats.n_parallel_reason
    assert max(busy) == 16  # one wave: every request decodes in the same ticks
    assert stats.ticks <= 8 + 4  # prompts in one or two ticks, then 7-8 decode ticks


def test_a_given_n_parallel_is_the_cap(tiny_path) -> None:
    busy: list[int] = []
    with LLM(tiny_path, n_threads=1, n_parallel=3) as llm:
        assert llm.stats().n_parallel == 3 and llm.stats().n_parallel_reason == "n_parallel given"
        llm.add_listener(lambda e: busy.append(e.decode_tokens) if isinstance(e, TickEvent) else None)
        llm.generate([[1, 20 + i, 30] for i in range(7)], SamplingParams(max_tokens=4), use_tqdm=False)
    assert max(busy) == 3
