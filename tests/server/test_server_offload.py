"""``llamabatch.server.offload``: the server's bounded worker pools and per-request budgets.

Steps that never end (a pure-Python loop, a call stuck in C) are abandoned at their budget or
at the client's disconnect, the pool keeps serving, and a process with stuck workers exits.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")

from llamabatch.server.offload import (
    PREPARE,
    Offload,
    RequestWork,
    WorkLimits,
)
from llamabatch.server.protocol import APIError
from llamabatch.server.streaming import ClientGone


def spin(stop: threading.Event) -> None:
    """A step that never returns by itself (pure Python: interruptible)."""
    while not stop.is_set():
        pass


def test_a_step_past_its_budget_is_503_and_interrupted() -> None:
    stopped = threading.Event()

    def forever() -> None:
        try:
            while True:
                pass
        finally:
            stopped.set()

    async def main() -> None:
        offload = Offload(WorkLimits(timeout_s=0.3, threads=1))
        work = RequestWork(offload, None)
        start = time.monotonic()
        with pytest.raises(APIError) as info:
            await work.run(PREPARE, forever)
        assert time.monotonic() - start < 2
        assert info.value.status == 503 and info.value.code == "work_timeout"
        assert "--work-timeout-s" in info.value.message
        assert await asyncio.to_thread(stopped.wait, 5), "the abandoned step's thread kept running"
        # the budget is spent: the request's next step is refused at once
        with pytest.raises(APIError):
            await work.run(PREPARE, lambda: 1)
        # the pool serves other requests
        assert await RequestWork(offload, None).run(PREPARE, lambda x: x + 1, 41) == 42
        offload.close()

    asyncio.run(main())


def test_steps_stuck_in_c_do_not_take_the_pool() -> None:
    """``time.sleep`` stands for a call stuck in C: its thread cannot be interrupted, so the
    pool starts another."""

    async def main() -> None:
        offload = Offload(WorkLimits(timeout_s=0.2, threads=2))
        for _ in range(2):
            with pytest.raises(APIError):
                await RequestWork(offload, None).run(PREPARE, time.sleep, 3600)
        start = time.monotonic()
        assert await RequestWork(offload, None).run(PREPARE, lambda: "ok") == "ok"
        assert time.monotonic() - start < 1
        offload.close()

    asyncio.run(main())


def test_results_and_errors_come_back() -> None:
    async def main() -> None:
        offload = Offload(WorkLimits(timeout_s=5, threads=2))
        work = RequestWork(offload, None)
        assert await work.run(PREPARE, sorted, [3, 1, 2], reverse=True) == [3, 2, 1]
        with pytest.raises(ValueError, match="boom"):
            await work.run(PREPARE, _raise, ValueError("boom"))
        results = await asyncio.gather(
            *(RequestWork(offload, None).run(PREPARE, pow, i, 2) for i in range(20))
        )
        assert results == [i * i for i in range(20)]
        offload.close()

    asyncio.run(main())


def _raise(exc: Exception) -> None:
    raise exc


def test_a_disconnect_abandons_the_step() -> None:
    stop = threading.Event()

    async def main() -> None:
        offload = Offload(WorkLimits(timeout_s=30, threads=1))
        gone = asyncio.Event()

        async def receive() -> dict[str, str]:
            await gone.wait()
            return {"type": "http.disconnect"}

        asyncio.get_running_loop().call_later(0.2, gone.set)
        start = time.monotonic()
        with pytest.raises(ClientGone):
            await RequestWork(offload, receive).run(PREPARE, spin, stop)
        assert time.monotonic() - start < 2
        assert await RequestWork(offload, None).run(PREPARE, lambda: 7) == 7
        offload.close()

    try:
        asyncio.run(main())
    finally:
        stop.set()


def test_close_fails_waiting_steps_with_503() -> None:
    stop = threading.Event()

    async def main() -> None:
        offload = Offload(WorkLimits(timeout_s=30, threads=1))
        task = asyncio.ensure_future(RequestWork(offload, None).run(PREPARE, spin, stop))
        queued = asyncio.ensure_future(RequestWork(offload, None).run(PREPARE, lambda: 1))
        await asyncio.sleep(0.1)
        offload.close()
        for t in (task, queued):
            with pytest.raises(APIError) as info:
                await asyncio.wait_for(t, 2)
            assert info.value.status == 503 and info.value.code == "shutting_down"

    try:
        asyncio.run(main())
    finally:
        stop.set()


def test_request_work_is_kept_on_the_request_state() -> None:
    offload = Offload(WorkLimits())
    state = SimpleNamespace()
    assert offload.request(state, None) is offload.request(state, None)
    offload.close()


@pytest.mark.parametrize(
    "kwargs", [{"timeout_s": 0}, {"timeout_s": float("inf")}, {"threads": 0}, {"threads": True}]
)
def test_bad_limits(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WorkLimits(**kwargs)


def test_a_process_with_stuck_workers_exits() -> None:
    script = textwrap.dedent(
        """
        import asyncio, time
        from llamabatch.server.offload import PREPARE, Offload, RequestWork, WorkLimits

        async def main():
            offload = Offload(WorkLimits(timeout_s=0.2, threads=2))
            for _ in range(3):
                try:
                    await RequestWork(offload, None).run(PREPARE, time.sleep, 3600)
                except Exception as exc:
                    print(type(exc).__name__)

        asyncio.run(main())
        """
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["APIError"] * 3
    assert time.monotonic() - start < 20  # the import is most of it; a join would never end


def test_logprobs_encoded_in_slices_match_the_whole() -> None:
    """``chat_logprobs_json`` / ``completion_logprobs_json`` (64 tokens per ``json.dumps``)
    give the JSON of ``chat_logprobs`` / ``completion_logprobs``, spliced by ``dumps_json``."""
    import json
    import math
    import random

    from llamabatch.server.protocol import chat_logprobs, completion_logprobs
    from llamabatch.server.streaming import RawJSON, chat_logprobs_json, completion_logprobs_json, dumps_json

    def token_text(token: int) -> tuple[str, list[int]]:
        text = f"t{token}é"
        return text, list(text.encode())

    rng = random.Random(0)
    ids = [rng.randrange(50) for _ in range(150)]
    logprobs = [{rng.randrange(50): -rng.random() * 5 for _ in range(5)} | {t: -0.5} for t in ids]
    logprobs[3][ids[3]] = -math.inf
    for n in (0, 1, 64, 65, 150):
        whole = {"content": chat_logprobs(token_text, ids[:n], logprobs[:n], 3)}
        sliced = chat_logprobs_json(token_text, ids[:n], logprobs[:n], 3)  # type: ignore[arg-type]
        assert json.loads(dumps_json({"x": sliced}))["x"] == whole
        whole = completion_logprobs(token_text, ids[:n], logprobs[:n], 7)  # type: ignore[arg-type]
        sliced = completion_logprobs_json(token_text, ids[:n], logprobs[:n], 7)  # type: ignore[arg-type]
        assert json.loads(dumps_json([sliced]))[0] == whole
    # a client's text that looks like the splice mark stays text
    assert (
        dumps_json({"a": RawJSON(b"[1]"), "b": [RawJSON(b"{}"), "\x00raw"]})
        == b'{"a":[1],"b":[{},"\\u0000raw"]}'
    )


def test_an_app_served_twice_gets_new_pools() -> None:
    from starlette.testclient import TestClient

    from llamabatch import LLM
    from llamabatch.gguf.testing import model_path
    from llamabatch.server.app import create_app
    from llamabatch.server.limits import ServerLimits

    with LLM(str(model_path("tiny")), n_ctx=256, n_parallel=1, n_threads=1) as llm:
        app = create_app(llm, limits=ServerLimits(allowed_hosts=("testserver",)))
        for _ in range(2):
            with TestClient(app) as client:
                assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200


def test_shorten_gil_waits_sets_a_short_switch_interval_and_never_lengthens_it() -> None:
    """The engine threads take the GIL back from Python-running pool threads within 0.5 ms
    (``llamabatch serve`` calls it), not CPython's 5 ms; a shorter interval stays."""
    from llamabatch.server.offload import SWITCH_INTERVAL_S, shorten_gil_waits

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        shorten_gil_waits()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S) and SWITCH_INTERVAL_S <= 0.001
        sys.setswitchinterval(0.0001)
        shorten_gil_waits()
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)


def test_chat_logprobs_written_directly_are_the_bytes_json_dumps_writes() -> None:
    """``chat_logprobs_json`` writes the JSON text itself (no dicts, each token encoded once):
    byte for byte what ``dumps_json`` makes of ``chat_logprobs``, with ties (kept in their
    order), ``-inf``, numpy floats, and token texts needing escapes."""
    import math
    import random

    import numpy as np

    from llamabatch.server.protocol import chat_logprobs
    from llamabatch.server.streaming import chat_logprobs_json, dumps_json

    texts = ['a"b', "c\\d", "\n\t\x00", "é€😀", " ", ""]

    def token_text(token: int) -> tuple[str, list[int]]:
        text = texts[token % len(texts)] + str(token)
        return text, list(text.encode("utf-8", "strict"))

    rng = random.Random(1)
    ids = [rng.randrange(40) for _ in range(90)]
    logprobs = []
    for i, t in enumerate(ids):
        dist: dict = {rng.randrange(40): -float(rng.choice([0.5, 1.25, rng.random() * 9])) for _ in range(8)}
        dist[t] = np.float64(-0.5) if i % 3 else -math.inf
        logprobs.append(dist)
    for top_n in (0, 1, 3, 20):
        whole = dumps_json({"content": chat_logprobs(token_text, ids, logprobs, top_n)})
        assert chat_logprobs_json(token_text, ids, logprobs, top_n).data == whole  # type: ignore[arg-type]


def test_short_requests_steps_run_on_the_loop_and_big_ones_in_the_pools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short completion's and ``/tokenize``'s steps take microseconds: they run on the event
    loop, never queued in a pool behind other requests' heavy steps; a long prompt, a body
    with a grammar and an answer with log-probabilities still go to their pools."""
    from starlette.testclient import TestClient

    from llamabatch import LLM
    from llamabatch.gguf.testing import model_path
    from llamabatch.server.app import create_app
    from llamabatch.server.limits import ServerLimits
    from llamabatch.server.offload import ENCODE, GRAMMAR, WorkPool

    submitted: list[str] = []
    submit = WorkPool.submit

    def spy(self: WorkPool, fn, args, kwargs):  # type: ignore[no-untyped-def]
        submitted.append(self.name)
        return submit(self, fn, args, kwargs)

    monkeypatch.setattr(WorkPool, "submit", spy)
    with LLM(str(model_path("tiny")), n_ctx=4096, n_parallel=1, n_threads=1) as llm:
        app = create_app(llm, limits=ServerLimits(allowed_hosts=("testserver",)))
        with TestClient(app) as client:
            short = {"prompt": "Hello", "max_tokens": 3}
            assert client.post("/v1/completions", json=short).status_code == 200
            assert client.post("/tokenize", json={"prompt": "hello world"}).status_code == 200
            assert submitted == []
            long = {"prompt": "Hello " * 400, "max_tokens": 1}
            assert client.post("/v1/completions", json=long).status_code == 200
            assert submitted == [PREPARE, PREPARE]  # tokenizing, the fields (the answer is short)
            submitted.clear()
            assert client.post("/v1/completions", json={**short, "logprobs": 2}).status_code == 200
            assert submitted == [ENCODE]
            submitted.clear()
            assert (
                client.post("/v1/completions", json={**short, "grammar": 'root ::= "a"'}).status_code == 200
            )
            assert submitted == [GRAMMAR]


def test_a_request_leaves_no_reference_cycle_holding_its_body() -> None:
    """A request's state (its parsed body, its work record holding ``receive``) was in a
    reference cycle through the ASGI scope, freed only by a full garbage collection: a flood of
    1 MB bodies held tens of MB. ``EdgeGuard`` drops the state when the answer ends."""
    import gc

    from starlette.testclient import TestClient

    from llamabatch import LLM
    from llamabatch.gguf.testing import model_path
    from llamabatch.server.app import create_app
    from llamabatch.server.limits import ServerLimits
    from llamabatch.server.protocol import Body

    with LLM(str(model_path("tiny")), n_ctx=1024, n_parallel=1, n_threads=1) as llm:
        app = create_app(llm, limits=ServerLimits(allowed_hosts=("testserver",)))
        with TestClient(app) as client:
            gc.collect()
            gc.disable()
            try:
                assert (
                    client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code
                    == 200
                )
                refused = {"prompt": "Hello", "max_tokens": 1, "stop": ["x" * 100_000]}  # too long a stop
                assert client.post("/v1/completions", json=refused).status_code == 400
                logprobs = {"prompt": "Hello", "max_tokens": 2, "n": 2, "logprobs": 2}
                assert client.post("/v1/completions", json=logprobs).status_code == 200
                assert client.post("/tokenize", json={"prompt": "q" * 200_000}).status_code == 400  # too long
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                left = [o for o in gc.garbage if isinstance(o, (Body, RequestWork))]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            assert left == []
