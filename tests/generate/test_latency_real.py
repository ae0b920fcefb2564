"""``target_itl_ms`` and priorities on real llama.cpp, asserted on tick telemetry.

A long prompt arriving while other streams decode: without a target its 512-token chunk
shares a tick with every decoding stream (they all wait for it); with a target the chunks
shrink so each tick's predicted decode time stays under it, and the measured ticks follow
(with a generous margin: the machine is shared).
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


def _run(path, target_itl_ms):
    ticks: list[TickEvent] = []
    lock = threading.Lock()

    def listen(event):
        if isinstance(event, TickEvent):
            with lock:
                ticks.append(event)

    with LLM(path, n_parallel=4, n_ctx=8192, n_threads=1, chunk_size=512, target_itl_ms=target_itl_ms) as llm:
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
        for handle in [*streams, long]:
            assert handle.result().outputs[0].finish_reason == "length"
    # the ticks that prefilled part of the long prompt while the streams decoded
    mixed = [t for t in ticks if t.prefill_tokens and t.decode_tokens >= 3]
    decode_only = [t for t in ticks if t.decode_tokens >= 3 and not t.prefill_tokens]
    return mixed, decode_only


def test_long_prompt_no_longer_stalls_decoding_streams(small_path):
    mixed, _ = _run(small_path, None)
    full_chunks = [t for t in mixed if t.prefill_tokens >= 500]
    assert full_chunks  # without a target a full chunk shares the tick with the decodes
    assert all(t.token_budget == 512 and t.predicted_time is None for t in mixed)
    full = statistics.median(t.decode_time for t in full_chunks)
    target_s = full / 4  # a quarter of a full-chunk tick
    mixed, _ = _run(small_path, target_s * 1000.0)
    assert len(mixed) > N_LONG // 512
    chunks = [t.prefill_tokens for t in mixed]
    assert max(chunks) < 500, "the chunks did not shrink under the target"
    # every plan fits the target, the one-token floor aside
    planned = [t for t in mixed if t.prefill_tokens > 1]
    assert planned, "no tick above the floor: the target left no room"
    for t in mixed:
        assert t.predicted_time is not None
        assert t.predicted_time <= target_s + 1e-9 or t.prefill_tokens == 1
    # the cost model predicts the measured ticks (median relative error), and the ticks the
    # target shaped stay near it, with a generous margin (the machine may be shared)
    errors = [abs(t.decode_time - t.predicted_time) / t.decode_time for t in mixed]  # type: ignore[operator]
    assert statistics.median(errors) < 0.5
    assert statistics.median(t.decode_time for t in planned) <= 2 * target_s
