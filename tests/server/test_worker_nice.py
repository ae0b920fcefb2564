"""``--worker-nice``: the server's pools of clients' CPU work, and a served reranker's and
embedder's engine threads, run at a lower OS priority than the generation engine's thread,
which keeps the main thread's (``server/offload.py``, ``runtime/thread_priority.py``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import pytest

pytest.importorskip("starlette")
pytest.importorskip("safetensors")  # the test reranker's making
pytest.importorskip("tokenizers")

from llamabatch import LLM
from llamabatch.embed.reranker import Reranker
from llamabatch.gguf.testing import model_path
from llamabatch.gguf.testing_reranker import reranker_path
from llamabatch.runtime.thread_priority import DEFAULT_WORKER_NICE, MAX_NICE, thread_niceness
from llamabatch.server.app import create_app
from llamabatch.server.cli import add_arguments
from llamabatch.server.offload import GRAMMAR, POOLS, PREPARE, Offload, RequestWork, WorkLimits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def main_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


def niced(n: int) -> int:
    return min(MAX_NICE, main_nice() + n)


def step_niceness(limits: WorkLimits, pool: str) -> int | None:
    async def run() -> int | None:
        offload = Offload(limits)
        try:
            return await RequestWork(offload, None).run(pool, thread_niceness)
        finally:
            offload.close()

    return asyncio.run(run())


@pytest.mark.parametrize("pool", POOLS)
def test_every_pools_threads_report_the_niceness(pool: str) -> None:
    assert step_niceness(WorkLimits(nice=7), pool) == niced(7)


def test_the_default_is_ten_and_zero_turns_it_off() -> None:
    assert WorkLimits().nice == DEFAULT_WORKER_NICE == 10
    assert step_niceness(WorkLimits(), PREPARE) == niced(10)
    assert step_niceness(WorkLimits(nice=0), GRAMMAR) == main_nice()


@pytest.mark.parametrize("bad", [-1, 20, 1.5, True])
def test_a_bad_niceness_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="nice"):
        WorkLimits(nice=bad)  # type: ignore[arg-type]


def test_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).worker_nice == 10
    assert parser.parse_args(["--worker-nice", "0"]).worker_nice == 0
    assert parser.parse_args(["--worker-nice", "19"]).worker_nice == 19
    for bad in ("-1", "20", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--worker-nice", bad])


def test_the_rerankers_engine_thread_is_niced_and_the_generation_engines_is_not() -> None:
    llm = LLM(str(model_path("tiny")), n_ctx=256, n_parallel=1)
    with llm, Reranker(str(reranker_path("f32"))) as reranker:
        assert reranker.call(thread_niceness) == llm.call(thread_niceness) == main_nice()
        create_app(llm, reranker=reranker, work_limits=WorkLimits(nice=5))
        assert reranker.call(thread_niceness) == niced(5)
        assert llm.call(thread_niceness) == main_nice()
        assert thread_niceness() == main_nice()  # the caller's (the event loop's) thread
        assert reranker.predict([("a cat", "a cat sat")]).shape == (1,)  # still works
