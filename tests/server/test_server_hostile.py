"""A hostile client against the real ``llamabatch serve``, in a subprocess (issue 26).

The server runs as its own process, so a request that crashes it (a segfault, an abort) fails
the test that sent it instead of taking the test run down, and its log can be read for
tracebacks. Every test ends by checking that the process lives and ``/health`` answers.

- Regression tests for the HTTP half of issue 26: deep JSON (defect 5), requests that can
  never fit (6), slow or idle clients (7), Content-Type / Host / CORS (8), NaN / Infinity and
  error fields (11), ``X-Forwarded-For`` (12), and the event loop and body limits (4).
- A hypothesis run of generated bodies, content types and hosts against every POST endpoint:
  each answer is a 2xx or a 4xx, never a 5xx, and the server keeps answering. ``--runslow``
  runs a larger budget.

``HOSTILE_BASELINE=1`` starts the server without the flags this suite's tests set (to run the
suite against an older llamabatch on ``PYTHONPATH``, where these tests fail).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import free_port, serve_command, wait_until_healthy

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

#: the server's limits here (small, so the tests are quick)
TIMEOUT_S = 2.0
MAX_BODY_MB = 1
MAX_QUEUE = 16
N_CTX, N_PARALLEL = 4096, 2  # 2048 tokens per request
BASELINE = os.environ.get("HOSTILE_BASELINE") == "1"


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path
    log_start: int = 0  # where the current test's part of the log starts

    def log_text(self) -> str:
        """The log since the current test started."""
        return self.log.read_text(errors="replace")[self.log_start :]

    def check_alive(self) -> None:
        """The process lives, ``/health`` answers 200, and the log holds no traceback."""
        assert self.proc.poll() is None, (
            f"the server died ({self.proc.returncode}):\n{self.log_text()[-3000:]}"
        )
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        assert "Traceback" not in self.log_text(), self.log_text()[-3000:]


@pytest.fixture
def server(running_server: Server) -> Server:
    """The module's server, its log read from this test's start."""
    running_server.log_start = len(running_server.log.read_text(errors="replace"))
    return running_server


@pytest.fixture(scope="module")
def running_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    command = serve_command(
        port,
        *("-np", str(N_PARALLEL), "-c", str(N_CTX), "-t", "1", "--max-queue", str(MAX_QUEUE)),
        *("--log-level", "info"),  # the access log: the client address it shows is checked
    )
    if not BASELINE:
        command += ["--timeout", str(TIMEOUT_S), "--max-body-mb", str(MAX_BODY_MB)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    srv = Server(proc, f"http://127.0.0.1:{port}", port, log)
    try:
        wait_until_healthy(proc, srv.url, srv.log_text)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hang is a failure too
            proc.kill()
            proc.wait()
            raise


def post(server: Server, path: str, content: bytes | str, **kw) -> httpx.Response:
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kw)


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


# -- defects 1-3 through the server: grammars and penalties that crashed or exhausted it ---------

_REPRODUCTIONS = {
    "maxLength": {"prompt": "Hi", "max_tokens": 4, "json_schema": {"type": "string", "maxLength": 50000}},
    "maxItems": {"prompt": "Hi", "max_tokens": 4, "json_schema": {"type": "array", "maxItems": 100000}},
    "pattern-repeat": {
        "prompt": "Hi",
        "max_tokens": 4,
        "json_schema": {"type": "string", "pattern": "^a{0,20000}$"},
    },
    "nested-groups": {
        "prompt": "Hi",
        "max_tokens": 4,
        "grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000,
    },
    "inverted-range": {"prompt": "Hi", "max_tokens": 4, "grammar": "root ::= [b-a]"},
    "inverted-pattern": {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^[b-a]$"}},
        },
    },
    "repeat_last_n": {"prompt": "Hi", "max_tokens": 4, "repeat_last_n": 2**31 - 1, "n": 4},
    "remote-ref": {"prompt": "Hi", "max_tokens": 4, "json_schema": {"$ref": "https://127.0.0.1:9/x.json"}},
}


@pytest.mark.parametrize(
    ("name", "path"),
    [
        (name, path)
        for name, body in sorted(_REPRODUCTIONS.items())
        for path in (("/v1/chat/completions",) if "messages" in body else ("/v1/completions", "/completion"))
    ],
)
def test_the_issue_reproductions_get_a_clean_answer(server, name, path):
    """Each of issue 26's crashing or exhausting requests gets a 4xx or a correct 200, and the
    server keeps answering (the grammar and penalty checks are SamplingParams'; here they
    must hold through HTTP, OpenAI's completions and llama-server's ``/completion`` alike)."""
    body = _REPRODUCTIONS[name]
    t0 = time.perf_counter()
    r = post(server, path, json.dumps(body))
    took = time.perf_counter() - t0
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert error_of(r)["param"] in body, r.text[:300]  # the field the request sent
    assert took < 30, f"{name} took {took:.1f} s"
    server.check_alive()


# -- defect 5: JSON that fails to parse is a 400, nesting included --------------------------------


@pytest.mark.parametrize(
    "body",
    ["[" * 5000 + "]" * 5000, '{"prompt": "hi", "x": ' + "[" * 990 + "]" * 990 + "}", '{"prompt": ', "\xff"],
    ids=["deep-array", "deep-field", "truncated", "bad-utf8"],
)
def test_unparsable_bodies_are_400_without_traceback(server, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/completion"):
        r = post(server, path, body.encode("latin-1"))
        assert r.status_code == 400, r.text
        assert error_of(r)["type"] == "invalid_request_error"
    server.check_alive()


# -- defect 11: strict JSON, and errors name the field ------------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_nan_and_infinity_are_refused(server, literal):
    bodies = [
        f'{{"prompt": "hi", "max_tokens": 2, "temperature": {literal}}}',
        f'{{"prompt": "hi", "max_tokens": 2, "json_schema": {{"const": {literal}}}}}',
    ]
    for body in bodies:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400, r.text
    server.check_alive()


def test_a_grammar_error_names_the_field_the_request_sent(server):
    messages = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}
    r = post(server, "/v1/chat/completions", json.dumps({"messages": messages, "response_format": fmt}))
    assert r.status_code == 400 and error_of(r)["param"] == "response_format", r.text
    r = post(server, "/v1/completions", json.dumps({"prompt": "hi", "json_schema": {"enum": []}}))
    assert r.status_code == 400 and error_of(r)["param"] == "json_schema", r.text
    server.check_alive()


# -- defect 6: what can never fit is a 400; 503 + Retry-After only when waiting helps -------------


def test_requests_that_can_never_queue_are_400_not_503(server):
    r = post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "n": MAX_QUEUE + 1}))
    assert r.status_code == 400 and error_of(r)["param"] == "n", r.text
    assert "retry-after" not in r.headers
    messages = [{"role": "user", "content": "hi"}]
    r = post(server, "/v1/chat/completions", json.dumps({"messages": messages, "n": MAX_QUEUE + 1}))
    assert r.status_code == 400 and error_of(r)["param"] == "n", r.text
    r = post(server, "/v1/completions", json.dumps({"prompt": ["hi"] * (MAX_QUEUE + 1), "max_tokens": 2}))
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text
    assert "retry-after" not in r.headers
    # at the limit it is served
    r = post(server, "/v1/completions", json.dumps({"prompt": ["hi"] * MAX_QUEUE, "max_tokens": 1}))
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_QUEUE
    server.check_alive()


# -- defect 7: slow and idle clients time out -----------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[bool, bytes]:
    """Whether the server ends the connection within ``seconds`` (sending ``trickle`` a byte at
    a time meanwhile); returns (closed, what it sent)."""
    deadline = time.monotonic() + seconds
    received = b""
    sock.settimeout(0.25)
    for i in range(10**6):
        if time.monotonic() > deadline:
            return False, received
        try:
            if trickle:
                sock.sendall(trickle[i % len(trickle) : i % len(trickle) + 1])
        except OSError:
            return True, received
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return True, received
        if not chunk:
            return True, received
        received += chunk
    return False, received  # pragma: no cover


def test_idle_and_slowloris_connections_are_closed(server):
    limit = TIMEOUT_S + 4  # generous: CI machines are slow
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        closed, _ = _closed_within(idle, limit)
        assert closed, "an idle connection was kept open"
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed, _ = _closed_within(slow, limit, trickle=b"X-Slow: a\r\n")
        assert closed, "headers sent a byte at a time kept the connection open"
    server.check_alive()


def test_a_huge_request_head_is_refused(server):
    """uvicorn's httptools parser takes headers without limit (190 MB grew the server to
    300 MB): past 64 KiB the connection gets 431 and is closed."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sent = 0
        with pytest.raises(OSError):  # reset or broken pipe once the server closes
            for i in range(20_000):  # 20 MB at most
                sock.sendall(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000))
                sent += 1000
        assert sent < 8 * 2**20, sent
    server.check_alive()


def test_a_body_shorter_than_its_content_length_times_out(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt": "hi"'
        )
        _, answer = _closed_within(sock, TIMEOUT_S + 4)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    server.check_alive()


def test_a_client_that_stops_reading_is_cut_off(server):
    """A stream whose client reads nothing: once the kernel's and the transport's buffers are
    full, the server waits ``--timeout`` for the client to read, then drops the connection
    and cancels the generation (it held a connection and its task forever)."""
    body = json.dumps(
        {"prompt": "hi", "max_tokens": 1900, "n": 6, "logprobs": 20, "stream": True, "ignore_eos": True}
    ).encode()  # about 9 MB of events: more than loopback's socket buffers hold
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        deadline = time.monotonic() + 90  # buffers fill, then the server's deadline passes
        while "stopped reading its answer" not in server.log_text():
            assert time.monotonic() < deadline, "the server kept the stalled connection"
            time.sleep(0.2)
        received = b""
        sock.settimeout(10)
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except OSError:  # reset: the server aborted the connection
            pass
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received, len(received)
    deadline = time.monotonic() + 10
    while "llamabatch:num_requests_running{" in (metrics := httpx.get(f"{server.url}/metrics").text):
        if (
            re.search(r"llamabatch:num_requests_running\{[^}]*\} 0\.0", metrics)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert re.search(r"llamabatch:num_requests_running\{[^}]*\} 0\.0", metrics), "the generation kept running"
    server.check_alive()


# -- defect 8: Content-Type, Host, CORS -----------------------------------------------------------


def test_a_cross_site_form_post_is_refused(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ):
        r = post(
            server,
            "/v1/completions",
            body,
            headers={"content-type": content_type, "origin": "https://evil.example"},
        )
        assert r.status_code == 415, (content_type, r.text)
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=10)  # no Content-Type at all
    assert r.status_code == 415
    ok = post(server, "/v1/completions", body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    assert "access-control-allow-origin" not in ok.headers  # CORS is off unless --cors-origins
    preflight = httpx.options(
        f"{server.url}/v1/completions",
        headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
        timeout=10,
    )
    assert "access-control-allow-origin" not in preflight.headers
    server.check_alive()


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""])
def test_a_foreign_host_is_refused(server, host):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    r = post(server, "/v1/completions", body, headers={"host": host})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_host", r.text


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "[::1]:8000", "10.1.2.3:80"])
def test_local_names_and_addresses_are_served(server, host):
    r = httpx.get(f"{server.url}/v1/models", headers={"host": host}, timeout=10)
    assert r.status_code == 200, r.text


# -- defect 12: X-Forwarded-For is not trusted by default -----------------------------------------


def test_forwarded_for_from_localhost_is_not_trusted(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"x-forwarded-for": "6.6.6.6"}, timeout=10)
    assert r.status_code == 200
    time.sleep(0.2)
    log = server.log_text()
    assert "6.6.6.6" not in log
    assert re.search(r"127\.0\.0\.1:\d+ - \"GET /v1/models", log)


# -- defect 4: body limits, prompt bounds, and the event loop --------------------------------------


def test_a_body_over_the_limit_is_413(server):
    big = b'{"prompt": "' + b"a" * (MAX_BODY_MB * 2**20 + 10) + b'"}'
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413, r.text[:300]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_MB * 4 + 1):
            yield b"a" * 2**18
        yield b'"}'

    r = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text[:300]
    server.check_alive()


def test_text_that_cannot_fit_is_refused_before_tokenizing(server):
    n_ctx_seq = N_CTX // N_PARALLEL
    text = "a" * (n_ctx_seq * 64)  # more bytes than n_ctx_seq tokens of any vocabulary here hold
    r = post(server, "/v1/completions", json.dumps({"prompt": text, "max_tokens": 1}))
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    assert "before tokenizing" in error_of(r)["message"]
    messages = [{"role": "user", "content": text}]
    r = post(server, "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": 1}))
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    many = [{"role": "user", "content": "x"}] * 5000
    r = post(server, "/v1/chat/completions", json.dumps({"messages": many}))
    assert r.status_code == 400 and error_of(r)["param"] == "messages", r.text
    server.check_alive()


def _big_legal_grammar(n_rules: int) -> str:
    """A grammar near the size limits that stays legal: ``root`` picks one of many words."""
    rules = [f'w{i} ::= "word{i}x"' for i in range(n_rules)]
    return "root ::= " + " | ".join(f"w{i}" for i in range(n_rules)) + "\n" + "\n".join(rules) + "\n"


def _worst_health_latency(server: Server, heavy: threading.Thread) -> tuple[float, int]:
    worst, polls = 0.0, 0
    with httpx.Client(timeout=30) as client:
        while heavy.is_alive():
            t0 = time.perf_counter()
            assert client.get(f"{server.url}/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            polls += 1
            time.sleep(0.02)
    return worst, polls


def test_health_answers_while_a_heavy_legal_request_runs(server):
    """Grammar building and tokenizing run off the event loop: /health keeps answering. (The
    bound is loose against CI load; the issue's target, 0.5 s, is measured on a quiet machine.)"""
    grammar = _big_legal_grammar(1000)  # within GrammarLimits.max_stacks (1,024 alternatives)
    statuses: list[int] = []

    def heavy() -> None:
        body = {"prompt": "hi", "max_tokens": 2, "n": 8, "grammar": grammar}
        statuses.append(post(server, "/v1/completions", json.dumps(body)).status_code)

    thread = threading.Thread(target=heavy)
    thread.start()
    worst, polls = _worst_health_latency(server, thread)
    thread.join()
    print(
        f"worst /health latency during a {len(grammar)} byte grammar x n=8: {worst:.3f} s over {polls} polls"
    )
    assert statuses == [200]
    assert worst < 2.0, f"/health took {worst:.2f} s while a heavy request ran"
    server.check_alive()


# -- hypothesis: generated bodies, content types and hosts ---------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)
_FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "response_format",
    "json_schema",
    "grammar",
    "repeat_last_n",
    "repeat_penalty",
    "presence_penalty",
    "min_tokens",
    "stop_token_ids",
    "echo",
    "input",
    "encoding_format",
    "tokens",
    "content",
    "with_pieces",
    "tools",
    "tool_choice",
]
_valid = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/embeddings": {"input": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
_small_values = (
    _json
    | st.integers(-3, 3000)
    | st.sampled_from(["", "\x00", "\ud800", "a" * 5000, "root ::= [b-a]", "NaN"])
)


@st.composite
def _requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    path = draw(st.sampled_from(sorted(_valid)))
    kind = draw(
        st.sampled_from(["mutated", "mutated", "mutated", "random", "raw", "deep", "constant", "huge"])
    )
    if kind in ("mutated", "constant", "huge"):
        body = dict(_valid[path])
        for field in draw(st.lists(st.sampled_from(_FIELDS), max_size=3)):
            body[field] = draw(_small_values)
        if kind == "huge":  # around the 1 MiB body limit
            body[draw(st.sampled_from(_FIELDS))] = "x" * draw(st.integers(2**19, 2**21))
        content = json.dumps(body).encode()
        if kind == "constant":  # a NaN / Infinity literal where a value goes
            field = draw(st.sampled_from(_FIELDS))
            literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400"]))
            content = content[:-1] + f', "{field}": {literal}}}'.encode()
    elif kind == "random":
        content = json.dumps(draw(_json)).encode()
    elif kind == "deep":
        depth = draw(st.integers(100, 3000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        inner = (opener * depth + "1" + closer * depth).encode()
        content = b'{"prompt": "hi", "x": ' + inner + b"}" if draw(st.booleans()) else inner
    else:
        content = draw(st.binary(max_size=64))
    headers = {
        "content-type": draw(
            st.sampled_from(["application/json"] * 4 + ["text/plain", "application/x-json", ""])
        )
    }
    if draw(st.booleans()):
        headers["host"] = draw(st.sampled_from(["127.0.0.1", "localhost", "evil.example", "[::1]"]))
    return path, content, headers


def _fuzz(server: Server, request: tuple[str, bytes, dict[str, str]]) -> None:
    path, content, headers = request
    r = httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)
    assert r.status_code < 500 or (r.status_code == 503 and "queue" in r.text), (
        path,
        content[:200],
        r.status_code,
        r.text[:300],
    )
    assert server.proc.poll() is None, f"the server died on {path} {content[:200]!r}"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=_requests())
def test_generated_requests_never_get_a_5xx(server, request):
    _fuzz(server, request)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=_requests())
def test_generated_requests_never_get_a_5xx_long(server, request):
    _fuzz(server, request)


def test_the_server_is_alive_and_its_log_clean_at_the_end(running_server):
    running_server.log_start = 0
    running_server.check_alive()
