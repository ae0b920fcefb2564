"""Misuse from the engine's own thread, and other call sequences that once crashed, hung
or lost requests (issue 11): each either works or raises a clear error, and every request
still ends exactly once."""

from __future__ import annotations

import logging
import threading

import pytest

from llamabatch import LLM, QueueFull, RequestEvent, SamplingParams, TickEvent

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


def _small(tiny_path, **kwargs) -> LLM:
    options = {"n_ctx": 2048, "n_parallel": 2, "n_batch": 64, "n_threads": 2, **kwargs}
    return LLM(tiny_path, **options)


def _ended_once(handles) -> list:
    outs = [c for h in handles for c in h.result(timeout=60).outputs]
    assert all(o.finish_reason in ("length", "cancelled", "stop") for o in outs)
    return outs


def test_close_from_a_tick_listener_is_deferred(tiny_path):
    # Once a segfault (sampling on a freed context) or a dead engine thread with requests
    # that never ended.
    llm = _small(tiny_path)
    ended: list = []

    def listener(event):
        if isinstance(event, TickEvent) and event.tick == 3:
            llm.close()
        if isinstance(event, RequestEvent):
            ended.append(event.request_id)

    llm.add_listener(listener)
    handles = [llm.submit(f"prompt {i}", LONG) for i in range(6)]
    outs = _ended_once(handles)
    assert any(o.finish_reason == "cancelled" for o in outs)
    assert sorted(ended) == sorted(o.request_id for o in outs)  # each ended exactly once
    assert llm.closed
    llm.close()


def test_close_from_a_request_listener(tiny_path):
    llm = _small(tiny_path)
    submitted = threading.Event()

    def listener(event):
        if isinstance(event, TickEvent):
            # the first tick waits for every submission: no request can end (and close the LLM,
            # making a later submit raise EngineClosed) before all five are queued
            assert submitted.wait(60)
        elif isinstance(event, RequestEvent):
            llm.close()

    llm.add_listener(listener)
    handles = [llm.submit(f"p{i}", SamplingParams(max_tokens=2 + i, temperature=0)) for i in range(5)]
    submitted.set()
    _ended_once(handles)
    assert llm.closed


def test_waiting_calls_inside_a_listener_raise_and_submit_works(tiny_path):
    errors: list[BaseException] = []
    submitted: list = []
    with _small(tiny_path) as llm:

        def listener(event):
            if isinstance(event, TickEvent) and event.tick == 1:
                try:
                    llm.generate("inner", SamplingParams(max_tokens=2))
                except RuntimeError as exc:
                    errors.append(exc)
                submitted.append(llm.submit("from the engine thread", SamplingParams(max_tokens=3)))

        llm.add_listener(listener)
        outer = llm.generate("outer", SamplingParams(max_tokens=4, temperature=0))
        assert outer[0].outputs[0].finish_reason == "length"
        assert len(errors) == 1 and "engine's own thread" in str(errors[0])
        assert submitted[0].result(timeout=60).outputs[0].finish_reason == "length"


def test_n_over_max_queue_raises_at_once(tiny_path):
    with _small(tiny_path, max_queue=4) as llm:
        with pytest.raises(QueueFull, match="n=5"):
            llm.generate("x", SamplingParams(n=5))
        with pytest.raises(QueueFull, match="n=128"):
            llm.submit("x", SamplingParams(n=128, temperature=1.0))  # no sampler is built
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be an int in \[1, 128\]"):
        SamplingParams(n=100_000)  # capped in validation (issue 26)


def test_empty_plan_falls_back_and_says_so_once(tiny_path, caplog):
    class Idle:
        def plan(self, view, budget, chunk_size, queue_depth):
            return []

    with caplog.at_level(logging.WARNING, logger="llamabatch"), _small(tiny_path, strategy=Idle()) as llm:
        outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    warnings = [r for r in caplog.records if "planned nothing" in r.message]
    assert len(warnings) == 1


def test_cancel_from_many_threads_ends_each_once(tiny_path):
    ended: list = []
    with _small(tiny_path, n_parallel=4) as llm:
        llm.add_listener(lambda e: isinstance(e, RequestEvent) and ended.append(e.request_id))
        handles = [llm.submit(f"c{i}", LONG) for i in range(12)]
        threads = [threading.Thread(target=h.cancel) for h in handles for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outs = _ended_once(handles)
        llm.clear_prefix_cache()
        assert llm.stats().busy_slots == 0
    assert sorted(ended) == sorted(o.request_id for o in outs)
