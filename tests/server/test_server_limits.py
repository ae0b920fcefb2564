"""``llamabatch.server.limits`` on its own: Host names, strict JSON, the flags' wiring, CORS when
asked for (issue 26). The hostile suite (``test_server_hostile.py``) drives the real server."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from llamabatch import LLM  # noqa: E402
from llamabatch.gguf.testing import model_path  # noqa: E402
from llamabatch.server import add_arguments, create_app  # noqa: E402
from llamabatch.server.cli import _http_options, _limits  # noqa: E402
from llamabatch.server.limits import (  # noqa: E402
    MAX_JSON_DEPTH,
    ServerLimits,
    deadline_protocol,
    host_allowed,
    json_depth,
    parse_json,
)
from llamabatch.server.protocol import APIError  # noqa: E402


@pytest.mark.parametrize(
    ("host", "allowed", "ok"),
    [
        ("127.0.0.1:8000", (), True),
        ("[::1]:8000", (), True),
        ("10.0.0.7", (), True),  # any IP literal: DNS rebinding needs a name
        ("localhost", (), True),
        ("LocalHost.:8000", (), True),
        ("app.localhost", (), True),
        ("evil.example", (), False),
        ("localhost.evil.example", (), False),
        ("127.0.0.1.nip.io", (), False),
        ("", (), False),
        ("llm.internal:8000", ("llm.internal",), True),
        ("a.example.com", (".example.com",), True),
        ("example.com", (".example.com",), True),
        ("badexample.com", (".example.com",), False),
        ("anything.at.all", ("*",), True),
    ],
)
def test_host_allowed(host, allowed, ok):
    assert host_allowed(host, allowed) is ok


@pytest.mark.parametrize(
    "raw",
    [
        b"NaN",
        b'{"a": Infinity}',
        b"[-Infinity]",
        b"1e400",
        b"[" * 2000 + b"]" * 2000,
        b"\xff",
        b"{",
        b"1" * 5000,
    ],
)
def test_parse_json_refuses_with_a_400(raw):
    with pytest.raises(APIError) as info:
        parse_json(raw)
    assert info.value.status == 400


def test_parse_json_depth():
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(parse_json(nested.encode())) == MAX_JSON_DEPTH
    with pytest.raises(APIError, match="nested deeper"):
        parse_json(("[" + nested + "]").encode())
    assert parse_json(b'{"a": [1.5, {"b": null}]}') == {"a": [1.5, {"b": None}]}
    assert json_depth(5) == 0 and json_depth({"a": [1]}) == 2


def test_parse_json_counts_values_before_parsing():
    from llamabatch.server.limits import MAX_JSON_VALUES

    assert len(parse_json(json.dumps([0] * MAX_JSON_VALUES).encode())) == MAX_JSON_VALUES  # n-1 commas
    with pytest.raises(APIError, match="too many JSON values"):
        parse_json(json.dumps([{"a": 1}] * (MAX_JSON_VALUES // 2 + 1)).encode())


#: JSON texts where orjson and ``json`` part ways: big integers, lone surrogates, a BOM,
#: exponents past a double, duplicate keys, ``-0``
_EDGE_BODIES = [
    b'{"seed": 123456789012345678901234567890}',
    b'"\\ud800"',
    b"\xef\xbb\xbf{}",
    b"[1e308, 1e-400, -0, -0.0]",
    b'{"a": 1, "a": 2}',
    b'"\\u0000\\n\\t\\u00e9"',
    b"  [ ]  ",
    b"[1,]",
    b"01",
]


def _old_parse(raw: bytes):
    """``parse_json``'s answer with ``json`` alone (no orjson): the reference."""
    from llamabatch.server import limits

    saved = limits.orjson
    limits.orjson = None
    try:
        return ("value", parse_json(raw))
    except APIError as exc:
        return ("error", exc.status)
    finally:
        limits.orjson = saved


@pytest.mark.parametrize("raw", _EDGE_BODIES)
def test_parse_json_answers_as_json_alone_does_on_edge_bodies(raw):
    """Issue 41: big bodies parse with orjson (a fifth of ``json``'s time holding the GIL);
    what orjson refuses goes to ``json``, so every answer stays what it was."""
    try:
        got = ("value", parse_json(raw))
    except APIError as exc:
        got = ("error", exc.status)
    assert repr(got) == repr(_old_parse(raw))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(value=json_values, noise=st.binary(max_size=8))
def test_parse_json_answers_as_json_alone_does(value, noise):
    raw = json.dumps(value, ensure_ascii=bool(len(noise) % 2)).encode("utf-8", "surrogatepass")
    for body in (raw, raw + noise, noise + raw):
        try:
            got = ("value", parse_json(body))
        except APIError as exc:
            got = ("error", exc.status)
        assert repr(got) == repr(_old_parse(body))


def test_the_separator_count_is_bytes_count():
    from llamabatch.server.limits import _separators

    raw = json.dumps({"a": [1, 2, {"b": "c:,d"}]}).encode() * 1000
    assert _separators(raw) == raw.count(b",") + raw.count(b":")


def test_server_limits_are_checked():
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServerLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="timeout"):
        ServerLimits(timeout=0)
    assert ServerLimits(allowed_hosts=(" LLM.Internal ",)).allowed_hosts == ("llm.internal",)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["-m", "x.gguf", *argv])


def test_the_flags_reach_uvicorn_and_the_app():
    defaults = _http_options(_args())
    assert defaults["proxy_headers"] is False  # uvicorn's own default trusts 127.0.0.1
    assert defaults["limit_concurrency"] == 1024 and defaults["timeout_keep_alive"] == 5
    assert defaults["http"].__name__.startswith("Deadline") and defaults["ws"] == "none"
    limits = _limits(_args())
    assert limits.max_body_bytes == 16 * 2**20 and limits.timeout == 60
    args = _args(
        "--forwarded-allow-ips", "10.0.0.1, 10.0.0.2", "--max-body-mb", "0.5", "--timeout", "7",
        "--allowed-hosts", "a.example,.b.example", "--host", "myhost", "--max-connections", "8",
    )  # fmt: skip
    options = _http_options(args)
    assert options["proxy_headers"] is True and options["forwarded_allow_ips"] == ["10.0.0.1", "10.0.0.2"]
    assert options["limit_concurrency"] == 8
    limits = _limits(args)
    assert limits.max_body_bytes == 2**19 and limits.timeout == 7
    assert limits.allowed_hosts == ("a.example", ".b.example", "myhost")
    with pytest.raises(SystemExit):
        _args("--max-body-mb", "0")


def test_deadline_protocol_classes():
    for http in ("h11", "auto"):
        cls = deadline_protocol(http, 1.0)
        assert issubclass(cls, asyncio.Protocol) and hasattr(cls, "_head_timeout")


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model_path("tiny"), n_ctx=512, n_parallel=1, n_threads=1) as llm:
        yield llm


def test_cors_only_when_asked_for(llm):
    """Starlette's test client: CORS headers answer an allowed origin only with cors_origins;
    its Host, ``testserver``, must be allowed like any name."""
    from starlette.testclient import TestClient

    origin = {"origin": "https://app.example"}
    preflight = {
        **origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    limits = ServerLimits(allowed_hosts=("testserver",))
    with TestClient(create_app(llm, limits=limits)) as client:
        r = client.get("/v1/models", headers=origin)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert (
            "access-control-allow-origin" not in client.options("/v1/completions", headers=preflight).headers
        )
    with TestClient(create_app(llm, limits=limits, cors_origins=["https://app.example"])) as client:
        r = client.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        body = json.dumps({"prompt": "hi", "max_tokens": 1})
        r = client.post(
            "/v1/completions", content=body, headers={**origin, "content-type": "application/json"}
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        other = client.get("/v1/models", headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with TestClient(create_app(llm)) as client:  # "testserver" is a name: refused by default
        assert client.get("/v1/models").json()["error"]["code"] == "invalid_host"
