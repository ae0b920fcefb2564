"""A llamabatch worker thread gives back its OpenMP workers when it goes idle
(``llamabatch/_ffi/openmp.py``), on the real llama.cpp build (ggml's CPU backend, libgomp)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from llamabatch import LLM, SamplingParams
from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch._ffi.openmp import release_openmp_threads

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux only)"
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _gone(tids: set[str], seconds: float = 5.0) -> bool:
    """Whether the threads ``tids`` have left the process within ``seconds``: a released
    worker is told to exit and leaves ``/proc/self/task`` a moment later."""
    deadline = time.monotonic() + seconds
    while tids & _tids() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not tids & _tids()


def test_release_frees_the_calling_threads_team_and_the_next_decode_makes_one(tiny_path) -> None:
    seen: dict[str, object] = {}
    with Model(tiny_path) as model, Context(model, n_ctx=256, n_threads=3) as ctx:

        def work() -> None:
            before = _tids()
            ctx.decode_tokens([1, 2, 3, 4])
            team = _tids() - before
            seen["team"] = team
            seen["released"] = release_openmp_threads()
            seen["gone"] = _gone(team)
            ctx.memory_clear()
            after = _tids()
            ctx.decode_tokens([5, 6])  # a new team, and a correct decode
            seen["again"] = _tids() - after

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    if not seen["team"]:
        pytest.skip("this llama.cpp build keeps no OpenMP team (not built with libgomp)")
    assert seen["released"] is True
    # (the sets compare thread ids, so another thread of the process starting or ending in
    # between cannot move them; counts of all threads once did)
    assert len(seen["team"]) >= 2  # 3 threads: the caller and two workers
    assert seen["gone"]
    assert len(seen["again"]) >= 2


def test_an_idle_llm_holds_no_openmp_workers(tiny_path) -> None:
    with LLM(tiny_path, n_ctx=512, n_parallel=2, n_threads=3) as llm:
        idle = _threads()  # the engine thread asleep (it has not computed yet)
        llm.generate(["a b c", "d e f"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        deadline = time.monotonic() + 10
        while _threads() > idle and time.monotonic() < deadline:  # until the engine thread sleeps
            time.sleep(0.01)
        assert _threads() == idle
        outs = llm.generate(["g h i"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 4


def test_the_image_encoder_thread_keeps_no_openmp_workers(tmp_path) -> None:
    """The image encoder's thread gives back its OpenMP workers after each encode
    (``generate/vision.py``). Kept, they made the process hold more OpenMP threads than CPUs,
    libgomp throttled every thread's spin-wait, and on 2 cores every later decode of the
    engine took 23 ms a token instead of 8.5, for good."""
    import numpy as np

    from llamabatch._ffi.mtmd import mtmd_available
    from llamabatch.testing import make_vision_model

    if not mtmd_available():
        pytest.skip("this llama.cpp build has no libmtmd")
    model, mmproj = make_vision_model(tmp_path)
    image = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    prompt = {"prompt": "<__media__>\nWhat is in the image?", "multi_modal_data": {"image": image}}
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=2) as llm:
        idle = _tids()
        out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert llm.stats().encoder_encoded == 1

        def openmp_workers() -> set[str]:  # new threads that are not Python's (the encoder's own)
            return _tids() - idle - {str(t.native_id) for t in threading.enumerate()}

        deadline = time.monotonic() + 10
        while openmp_workers() and time.monotonic() < deadline:  # until the engine thread sleeps
            time.sleep(0.01)
        assert not openmp_workers()


def test_llm_engine_gives_back_the_callers_workers_when_it_goes_quiet(tiny_path) -> None:
    """``LLMEngine`` decodes on its caller's thread; once nothing runs or waits, ``step()``
    gives back that thread's OpenMP workers, as an idle engine thread does."""
    from llamabatch import LLMEngine

    seen: dict[str, object] = {}

    def work() -> None:
        engine = LLMEngine(tiny_path, n_ctx=512, n_parallel=2, n_threads=3)
        try:
            before = _tids()
            engine.add_request("a b c", SamplingParams(max_tokens=4, temperature=0), request_id="r")
            engine.step()  # the prompt: a team starts
            seen["team"] = _tids() - before
            while engine.has_unfinished_requests():
                engine.step()
            seen["gone"] = _gone(seen["team"])  # type: ignore[arg-type]
        finally:
            engine.close()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if not seen["team"]:
        pytest.skip("this llama.cpp build keeps no OpenMP team (not built with libgomp)")
    assert seen["gone"]
