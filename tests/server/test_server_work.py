"""Heavy requests against the real ``llamabatch serve`` (a subprocess): their CPU work runs in
bounded pools, is abandoned when its client leaves, and never holds up other requests or
SIGTERM (``server/offload.py``).

- big rerank requests do not stop ``/tokenize`` and completions from answering;
- a 1 MB rerank query is refused at once (400 naming ``query``), and the query is
  tokenized once per request; a ``top_n`` error names ``top_n``;
- log-probabilities x ``n`` are built and encoded off the event loop;
- SIGTERM ends the server within seconds while heavy work runs;
- a request whose steps run past ``--work-timeout-s`` gets 503 ``work_timeout``.

``WORK_BASELINE=1`` starts the server without the flags these tests add (to run them against
an older llamabatch put first on ``PYTHONPATH``, where they fail).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from llamabatch.gguf.testing import model_path  # noqa: E402
from llamabatch.gguf.testing_reranker import reranker_path  # noqa: E402

BASELINE = os.environ.get("WORK_BASELINE") == "1"
WORK_TIMEOUT_S = 20


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def check_alive(self) -> None:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200


def start_server(log: Path, *extra: str) -> Server:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "llamabatch", "serve", "-m", str(model_path("tiny")),
        "--rerank-model", str(reranker_path("f32")), "--port", str(port), "-np", "4", "-c", "4096",
        "-t", "1", "--max-queue", "128", "--max-queue-per-client", "128", "--log-level", "warning",
    ]  # fmt: skip
    if not BASELINE:
        command += ["--work-timeout-s", str(WORK_TIMEOUT_S)]
    command += extra  # the last of a repeated flag wins
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "llamabatch serve did not come up"
        time.sleep(0.1)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("work") / "server.log")
    try:
        yield srv
    finally:
        stop_server(srv)


def big_rerank_bodies(n: int) -> list[dict]:
    """Rerank requests that cost many seconds of tokenizing each where the query is tokenized
    per document (a 1 MB query: more of them than the default executor has threads), and
    ones that cost some (64 documents of many words)."""
    words = " ".join(f"w{i}x" for i in range(4000))
    return [{"query": "q" * 1_000_000, "documents": ["a b c"] * 256}] * n + [
        {"query": "cats and dogs", "documents": [words] * 64}
    ] * (n // 2)


def fire(server: Server, path: str, bodies: list[dict], timeout: float = 120) -> list:
    """Send ``bodies`` at once, each from its own thread; the futures of the answers."""
    pool = ThreadPoolExecutor(len(bodies))

    def send(body: dict):
        try:
            return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)
        except httpx.TransportError as exc:
            return exc

    futures = [pool.submit(send, b) for b in bodies]
    pool.shutdown(wait=False)
    return futures


def timed_post(server: Server, path: str, body: dict, timeout: float) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    response = httpx.post(f"{server.url}{path}", json=body, timeout=timeout)
    return time.monotonic() - start, response


def test_heavy_reranks_do_not_stop_tokenize_and_completions(server: Server) -> None:
    futures = fire(server, "/v1/rerank", big_rerank_bodies(8))
    time.sleep(1.0)  # they are being worked on
    try:
        took, r = timed_post(server, "/tokenize", {"prompt": "hello world"}, timeout=15)
        assert r.status_code == 200 and took < 5, (took, r.text)
        took, r = timed_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4}, timeout=15)
        assert r.status_code == 200 and took < 8, (took, r.text)
    finally:
        for f in futures:
            f.result(timeout=300)
    server.check_alive()


def test_a_1mb_rerank_query_is_refused_at_once(server: Server) -> None:
    took, r = timed_post(
        server, "/v1/rerank", {"query": "q " * 500_000, "documents": ["a b c"] * 256}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "query" and "bytes" in r.json()["error"]["message"]
    assert took < 2, took
    # fewer characters than the byte bound (64 tokens x 16), more bytes: counted exactly
    emoji = {"query": "\U0001f600" * 300, "documents": ["b"]}
    r = httpx.post(f"{server.url}/v1/rerank", json=emoji, timeout=60)
    assert r.status_code == 400 and "'query' is 1200 bytes" in r.json()["error"]["message"], r.text
    # a query of more tokens than one pair holds (within the byte bound): 400 naming query
    r = httpx.post(f"{server.url}/v1/rerank", json={"query": "a " * 200, "documents": ["b"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "query", r.text
    server.check_alive()


def test_rerank_top_n_errors_name_top_n(server: Server) -> None:
    docs = ["a", "b c", "d"]
    r = httpx.post(f"{server.url}/v1/rerank", json={"query": "q", "documents": docs, "top_n": 2**40})
    assert r.status_code == 200, r.text  # more than the documents: all of them, best first
    assert sorted(x["index"] for x in r.json()["results"]) == [0, 1, 2]
    for top_n in (0, -1, "2", 1.5):
        r = httpx.post(f"{server.url}/v1/rerank", json={"query": "q", "documents": docs, "top_n": top_n})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "top_n" and "top_k" not in error["message"], error


def test_sigterm_exits_within_seconds_while_heavy_work_runs(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.log")
    try:
        futures = fire(server, "/v1/rerank", big_rerank_bodies(8), timeout=60)
        time.sleep(1.5)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - start
        assert server.proc.poll() is not None and took < 6, (took, server.log.read_text()[-2000:])
        for f in futures:
            f.result(timeout=60)
    finally:
        stop_server(server)


def test_health_answers_while_big_logprobs_answers_are_encoded(server: Server) -> None:
    """/health's latency while answers of n x top_logprobs are built (on the loop they took
    seconds); the answers are checked whole."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 16,
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": 64,
        "ignore_eos": True,
    }
    futures = fire(server, "/v1/chat/completions", [body] * 4, timeout=300)
    worst = 0.0
    while not all(f.done() for f in futures):
        took, r = timed_post_get(server)
        worst = max(worst, took)
        time.sleep(0.02)
    for f in futures:
        r = f.result()
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 16
        assert all(len(c["logprobs"]["content"]) == 64 for c in choices)
        assert all(len(e["top_logprobs"]) == 20 for e in choices[0]["logprobs"]["content"])
    assert worst < 2.0, worst  # generous: the machine is shared (the flood test measures finer)


def timed_post_get(server: Server) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    r = httpx.get(f"{server.url}/health", timeout=30)
    return time.monotonic() - start, r


def test_big_logprob_answers_are_encoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: the log-probabilities of a chat and a completions answer are built in a
    worker thread (the event loop's thread never runs ``chat_logprobs``)."""
    from starlette.testclient import TestClient

    from llamabatch import LLM
    from llamabatch.server import chat, completions, protocol, streaming
    from llamabatch.server.app import create_app
    from llamabatch.server.limits import ServerLimits

    threads: list[str] = []
    for name in ("chat_logprobs", "completion_logprobs"):
        original = getattr(protocol, name)

        def record(*args, _original=original, **kwargs):
            threads.append(threading.current_thread().name)
            return _original(*args, **kwargs)

        for module in (chat, completions, streaming):
            monkeypatch.setattr(module, name, record, raising=False)
    with LLM(str(model_path("tiny")), n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        app = create_app(llm, limits=ServerLimits(allowed_hosts=("testserver",)))
        with TestClient(app) as client:
            for stream in (False, True):
                r = client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "hi"}],
                        "logprobs": True,
                        "top_logprobs": 2,
                        "max_tokens": 3,
                        "n": 2,
                        "stream": stream,
                    },
                )
                assert r.status_code == 200, r.text
                r = client.post(
                    "/v1/completions",
                    json={"prompt": "hi", "logprobs": 2, "max_tokens": 3, "n": 2, "stream": stream},
                )
                assert r.status_code == 200, r.text
    assert len(threads) >= 4
    loop_thread = threading.main_thread().name
    assert all(t.startswith("llamabatch-encode") for t in threads), (threads, loop_thread)


@pytest.mark.parametrize("method", ["rank", "arank", "tokenize_pairs"])
def test_the_query_is_tokenized_once_per_request(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Reranker.rank`` / ``arank`` (which /v1/rerank's pairs come from) tokenize the query once,
    not once per document."""
    import asyncio

    from llamabatch.embed.reranker import Reranker

    with Reranker(reranker_path("f32"), n_threads=1) as reranker:
        calls: list[str] = []
        tokenize = reranker.model.tokenize

        def counting(text, *args, **kwargs):
            calls.append(text)
            return tokenize(text, *args, **kwargs)

        monkeypatch.setattr(reranker.model, "tokenize", counting)
        documents = [f"document {i}" for i in range(8)]
        if method == "rank":
            assert len(reranker.rank("the query", documents)) == 8
        elif method == "arank":
            assert len(asyncio.run(reranker.arank("the query", documents))) == 8
        else:
            pairs = reranker.tokenize_pairs("the query", documents)
            assert [p.tolist() for p in pairs] == [
                list(map(list, zip(*reranker.tokenize("the query", d), strict=True))) for d in documents
            ]
            calls = calls[:9]  # tokenize() above tokenizes the query again, once per pair
        assert calls.count("the query") == 1, calls


def test_work_past_its_budget_is_503_work_timeout(tmp_path: Path) -> None:
    """``--work-timeout-s``: a rerank whose tokenizing takes longer gets 503 ``work_timeout``
    (and the server goes on serving)."""
    if BASELINE:
        pytest.skip("the flag is new")
    server = start_server(tmp_path / "server.log", "--work-timeout-s", "0.1")
    try:
        words = " ".join(f"w{i}x" for i in range(4000))
        took, r = timed_post(server, "/v1/rerank", {"query": "q", "documents": [words] * 256}, timeout=60)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "work_timeout" and "--work-timeout-s" in error["message"], error
        assert took < 5, took
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello"}, timeout=10)
        assert r.status_code == 200, r.text
        server.check_alive()
        assert "budget (--work-timeout-s): abandoned" in server.log.read_text()
    finally:
        stop_server(server)
