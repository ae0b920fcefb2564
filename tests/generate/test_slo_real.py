"""SLO scheduling on real llama.cpp, asserted on tick telemetry (``generate/slo.py``).

A long prompt arrives while three streams decode. Under a loose ITL SLO its chunks run at
full speed (a 512-token chunk shares the tick with the decodes); under a tight one, the
chunks shrink so that each tick's predicted time stays under it, and the attainment of every
request shows in its metrics and in ``stats()``.
"""

from __future__ import annotations

import statistics
import time

import pytest
from long_prompt_run import N_LONG, run_long_prompt

from llamabatch import LLM, SamplingParams, testing


@pytest.fixture(scope="module")
def small_path():
    return testing.model_path("small")


def _run(path, slo_itl_ms):
    run = run_long_prompt(path, slo_ttft_ms=600_000, slo_itl_ms=slo_itl_ms)
    return run.mixed, run.outputs, run.stats


def test_prefill_is_sliced_only_under_a_tight_itl_slo(small_path):
    mixed, outputs, stats = _run(small_path, 600_000)
    full_chunks = [t for t in mixed if t.prefill_tokens >= 500]
    assert full_chunks, "under a loose SLO the prompt runs at full speed"
    assert all(out.timings.slo_met is True for out in outputs)
    assert (stats.slo_requests, stats.slo_met) == (4, 4)
    full = statistics.median(t.decode_time for t in full_chunks)
    slo_s = full / 4  # a quarter of a full-chunk tick
    mixed, outputs, stats = _run(small_path, slo_s * 1000.0)
    assert len(mixed) > N_LONG // 512
    assert max(t.prefill_tokens for t in mixed) < 500, "the chunks did not shrink under the SLO"
    assert any(t.prefill_tokens > 1 for t in mixed), "no tick above the floor"
    for t in mixed:  # every plan fits the SLO, the one-token floor aside
        assert t.predicted_time is not None
        assert t.predicted_time <= slo_s + 1e-9 or t.prefill_tokens == 1
    assert stats.slo_requests == 4
    assert all(out.timings.slo_met is not None for out in outputs)


def test_a_short_prompt_is_not_computed_behind_a_long_one():
    """Under SLOs a short prompt admitted while a long one is being computed takes the next
    ticks' prompt tokens first (it used to wait for the whole long prompt)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with LLM(testing.model_path("tiny"), n_ctx=8192, n_parallel=4, n_batch=64, slo_ttft_ms=60_000) as llm:
        bos = llm.model.bos
        t_long = time.perf_counter()
        long = llm.submit([bos] + [300 + i % 50 for i in range(3000)], params)
        while llm.stats().prefill_tokens < 128:  # its prompt is being computed
            time.sleep(0.001)
        t_short = time.perf_counter()
        short = llm.submit([bos] + [400 + i % 50 for i in range(40)], params)
        ttft_short = short.result().outputs[0].timings.time_to_first_token
        ttft_long = long.result().outputs[0].timings.time_to_first_token
    assert ttft_short is not None and ttft_long is not None
    assert t_short + ttft_short < t_long + ttft_long
