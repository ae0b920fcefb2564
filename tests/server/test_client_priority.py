"""Priority is the server's policy, and one client cannot fill the queue: ``--client-priority``
and ``--max-queue-per-client`` against the real ``llamabatch serve`` (a subprocess, the tiny
random model), plus the policy's pieces (``server/client_policy.py``) as units.

Clients are told apart by peer address; the server trusts ``X-Forwarded-For`` from
127.0.0.1 here (``--forwarded-allow-ips``), so one test process plays several clients.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from serve_process import free_port, serve_command, wait_until_healthy

from llamabatch.server.client_policy import ClientPolicy, ClientPriority, client_of

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

MAX_QUEUE = 16
#: the default share: half the queue plus the one slot
DEFAULT_SHARE = MAX_QUEUE // 2 + 1
LOWEST = -(2**31)


# -- units --------------------------------------------------------------------------------------


def test_client_priority_parses_off_and_clamp():
    assert ClientPriority.parse("off").apply(LOWEST) == 0
    assert ClientPriority.parse("off").apply(None) == 0
    clamp = ClientPriority.parse("clamp:-10..10")
    assert (clamp.apply(LOWEST), clamp.apply(2**31 - 1), clamp.apply(3), clamp.apply(None)) == (-10, 10, 3, 0)
    assert ClientPriority.parse("clamp:1..5").apply(None) == 1  # absent is 0, clamped too
    assert str(clamp) == "clamp:-10..10" and str(ClientPriority()) == "off"
    for bad in ("on", "clamp:", "clamp:5..1", "clamp:-10..x", "clamp:0..99999999999", "clamp:1...2", " "):
        with pytest.raises(ValueError):
            ClientPriority.parse(bad)


def test_serve_flags():
    from llamabatch.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.client_priority == ClientPriority() and args.max_queue_per_client is None
    args = parser.parse_args(["--client-priority", "clamp:-3..3", "--max-queue-per-client", "7"])
    assert args.client_priority == ClientPriority(-3, 3) and args.max_queue_per_client == 7
    for bad in (["--client-priority", "high"], ["--max-queue-per-client", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_default_share_and_client_identity():
    assert ClientPolicy().resolved(max_queue=1024, n_parallel=8).max_per_client == 520
    assert ClientPolicy(max_per_client=3).resolved(1024, 8).max_per_client == 3
    with pytest.raises(ValueError):
        ClientPolicy(max_per_client=0)
    assert client_of({"client": ("10.1.2.3", 5000)}) == "10.1.2.3"
    assert client_of({"client": ("::ffff:10.1.2.3", 5000)}) == "10.1.2.3"
    # one host may hold a whole /64: its addresses are one client
    assert client_of({"client": ("2001:db8::1", 1)}) == client_of({"client": ("2001:db8::ffff:2", 1)})
    assert client_of({"client": ("2001:db8::1", 1)}) != client_of({"client": ("2001:db8:0:1::1", 1)})
    assert client_of({"client": None}) == ""


# -- the real server ----------------------------------------------------------------------------


@contextmanager
def serve(log: Path, *flags: str) -> Iterator[str]:
    port = free_port()
    command = serve_command(
        port,
        *("-np", "1", "-c", "16384", "-t", "1", "--max-queue", str(MAX_QUEUE)),
        *("--forwarded-allow-ips", "127.0.0.1", "--no-access-log", *flags),
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, lambda: log.read_text(errors="replace"))
        yield url
        assert proc.poll() is None, log.read_text(errors="replace")
        assert "Traceback" not in log.read_text(errors="replace")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hang is a failure too
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("policy") / "default.log") as url:
        yield url


@pytest.fixture(scope="module")
def clamp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("policy") / "clamp.log", "--client-priority", "clamp:-10..10") as url:
        yield url


def _as(client: str) -> dict[str, str]:
    return {"x-forwarded-for": client}


def _waiting(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r"^llamabatch:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _finish_order(url: str, path: str, bodies: dict[str, dict]) -> list[str]:
    """Hold the one slot with a long stream, queue ``bodies`` one after the other (from the
    client holding the slot: another client's would take the slot at once, see
    ``priority.share_victim``), then free the slot: the names in the order their answers ended."""
    ended: list[str] = []
    threads = []
    long = {"prompt": "a", "max_tokens": 16000, "ignore_eos": True, "stream": True}  # 30 s or more
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=long, headers=_as("10.9.9.9"), timeout=60
    ) as held:
        lines = held.iter_lines()  # kept: a dropped iterator would close the connection
        next(lines)  # the slot is taken
        for i, (name, body) in enumerate(bodies.items()):

            def send(name: str = name, body: dict = body, client: str = "10.9.9.9") -> None:
                r = httpx.post(f"{url}{path}", json=body, headers=_as(client), timeout=60)
                assert r.status_code == 200, r.text
                ended.append(name)

            thread = threading.Thread(target=send)
            thread.start()
            threads.append(thread)
            _until(lambda i=i: _waiting(url) >= i + 1 or len(ended) > 0, f"{name} to queue")
    for thread in threads:  # the stream was closed: its request is cancelled
        thread.join(60)
    return ended


def _bodies(path: str) -> dict[str, dict]:
    # long enough that the second answer ends well after the first (the client's threads see
    # the ends with some delay of their own)
    if path == "/v1/completions":
        base = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True}
    else:
        base = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 300, "ignore_eos": True}
    return {"first": {**base, "priority": 0}, "jumper": {**base, "priority": LOWEST}}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_priorities_are_ignored_by_default(default_server, path):
    """``priority: -2147483648`` ran ahead of everyone (and preempted the running request);
    by default the server runs every request at 0: first come, first served."""
    assert _finish_order(default_server, path, _bodies(path)) == ["first", "jumper"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_priorities_are_clamped(clamp_server, path):
    """``--client-priority clamp:-10..10``: the lowest priority becomes -10, ahead of 0."""
    assert _finish_order(clamp_server, path, _bodies(path)) == ["jumper", "first"]
    too_big = {**_bodies(path)["first"], "priority": 2**31}
    r = httpx.post(f"{clamp_server}{path}", json=too_big, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_one_client_flooding_gets_429_while_another_is_served(default_server):
    """One client sends twice its share at once: the share (half the queue plus the
    slot) is accepted, the rest get 429 with Retry-After; another client is served meanwhile,
    before the flood's queued requests; and the flooder is served again once its requests
    end."""
    url = default_server
    flood = {"prompt": "a", "max_tokens": 300, "ignore_eos": True}
    statuses: list[int] = []
    retry_after: list[str | None] = []

    def flooder() -> None:
        r = httpx.post(f"{url}/v1/completions", json=flood, headers=_as("10.6.6.6"), timeout=120)
        statuses.append(r.status_code)
        retry_after.append(r.headers.get("retry-after"))

    other_served: list[int] = []  # how many of the flood's requests had ended then

    def other_client() -> None:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 3},
            headers=_as("10.7.7.7"),
            timeout=120,
        )
        assert r.status_code == 200, r.text
        other_served.append(statuses.count(200))

    # the flooder holds the one slot with a stream (one of its share), so no flood request
    # can end (and free its share) before every one of them was answered or queued, however
    # slowly the threads start; nor start: its client holds a slot
    held_body = {"prompt": "a", "max_tokens": 16000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=held_body, headers=_as("10.6.6.6"), timeout=60
    ) as held:
        lines = held.iter_lines()  # kept: a dropped iterator would close the connection
        next(lines)  # the slot is taken
        threads = [threading.Thread(target=flooder) for _ in range(2 * DEFAULT_SHARE - 1)]
        for thread in threads:
            thread.start()
        _until(lambda: statuses.count(429) == DEFAULT_SHARE, "the flood's 429s")
        _until(lambda: _waiting(url) >= DEFAULT_SHARE - 1, "the flood's share to queue")
        other = threading.Thread(target=other_client)
        other.start()
        other.join(120)
    # a client with nothing running takes the slot at once (priority.share_victim): the
    # other client's request ran before any of the flood's queued ones
    assert other_served == [0], statuses  # first come, first served: 8
    for thread in threads:
        thread.join(120)
    assert sorted(statuses) == [200] * (DEFAULT_SHARE - 1) + [429] * DEFAULT_SHARE
    assert {retry_after[i] for i, s in enumerate(statuses) if s == 429} == {"1"}
    # a streamed answer holds its share until it ends (here: its client leaves), then frees it
    long = {**flood, "max_tokens": 16000, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=long, headers=_as("10.6.6.6"), timeout=60
    ) as stream:
        assert stream.status_code == 200
        big = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "a", "max_tokens": 2, "n": DEFAULT_SHARE},
            headers=_as("10.6.6.6"),
            timeout=60,
        )
        assert big.status_code == 429
    # the stream was closed: its request is cancelled and its share freed
    for _ in range(50):  # the stream's end reaches the client a moment before the server frees it
        again = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "a", "max_tokens": 2, "n": DEFAULT_SHARE},
            headers=_as("10.6.6.6"),
            timeout=60,
        )
        if again.status_code != 429:
            break
        time.sleep(0.05)
    assert again.status_code == 200, again.text
    # a request over the share alone runs while its client has nothing else in flight
    alone = {"prompt": ["a", "b"], "max_tokens": 2, "n": DEFAULT_SHARE // 2 + 1}  # within the queue
    r = httpx.post(f"{url}/v1/completions", json=alone, headers=_as("10.6.6.6"), timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2 * (DEFAULT_SHARE // 2 + 1)
