"""SLO scheduling on real llama.cpp, asserted on tick telemetry (``generate/slo.py``).

A long prompt arrives while three streams decode. Under a loose ITL SLO its chunks run at
full speed (a 512-token chunk shares the tick with the decodes); under a tight one, the
chunks shrink so that each tick's predicted time stays under it, and the attainment of every
request shows in its metrics and in ``stats()``.
"""

from __future__ import annotations

import statistics
import threading

import pytest

from llamabatch import LLM, SamplingParams, TickEvent, testing

N_LONG = 900


@pytest.fixture(scope="module")
def small_path():
    return testing.model_path("small")


def _run(path, slo_itl_ms):
    ticks: list[TickEvent] = []
    lock = threading.Lock()

    def listen(event):
        if isinstance(event, TickEvent):
            with lock:
                ticks.append(event)

    config = {"n_parallel": 4, "n_ctx": 8192, "n_threads": 1, "chunk_size": 512}
    with LLM(path, **config, slo_ttft_ms=600_000, slo_itl_ms=slo_itl_ms) as llm:
        llm.add_listener(listen)
        params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        streams = [llm.submit([10 + i, 20, 30, 40], params) for i in range(3)]
        while True:  # the streams decode before the long prompt arrives
            with lock:
                if sum(t.decode_tokens >= 3 for t in ticks) >= 20:
                    break
            threading.Event().wait(0.005)
        long_prompt = [(7 * i) % 200 + 5 for i in range(N_LONG)]
        long = llm.submit(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        outputs = [handle.result().outputs[0] for handle in [*streams, long]]
        stats = llm.stats()
    mixed = [t for t in ticks if t.prefill_tokens and t.decode_tokens >= 3]
    return mixed, outputs, stats


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
