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
