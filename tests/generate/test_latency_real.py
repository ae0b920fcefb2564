"""``target_itl_ms`` and priorities on real llama.cpp, asserted on tick telemetry.

A long prompt arriving while other streams decode: without a target its 512-token chunk
shares a tick with every decoding stream (they all wait for it); with a target the chunks
shrink so each tick's predicted decode time stays under it, and the measured ticks follow
(with a generous margin: the machine is shared).
"""

from __future__ import annotations

import statistics

import pytest
from long_prompt_run import N_LONG, run_long_prompt

from llamabatch import testing


@pytest.fixture(scope="module")
def small_path():
    return testing.model_path("small")


def test_long_prompt_no_longer_stalls_decoding_streams(small_path):
    mixed = run_long_prompt(small_path, target_itl_ms=None).mixed
    full_chunks = [t for t in mixed if t.prefill_tokens >= 500]
    assert full_chunks  # without a target a full chunk shares the tick with the decodes
    assert all(t.token_budget == 512 and t.predicted_time is None for t in mixed)
    full = statistics.median(t.decode_time for t in full_chunks)
    target_s = full / 4  # a quarter of a full-chunk tick
    mixed = run_long_prompt(small_path, target_itl_ms=target_s * 1000.0).mixed
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
