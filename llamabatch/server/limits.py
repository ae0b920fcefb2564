"""What the server accepts at its HTTP edge, checked before any endpoint runs.

- :class:`ServerLimits`: the limits and their defaults (``llamabatch serve`` flags).
- :class:`EdgeGuard`: ASGI middleware that refuses a foreign ``Host`` (400, closes DNS
  rebinding), a ``POST`` that is not JSON (415, closes the browser's preflight-free
  cross-site POST), a body over the size limit (413, from ``Content-Length`` or while it
  streams in), and a body that does not arrive in time (408).
- :func:`parse_json`: strict JSON (no ``NaN``/``Infinity``, bounded nesting) whose every
  failure is a 400, never a 500.
- :func:`deadline_protocol`: uvicorn's HTTP protocol with a deadline on each request's head
  (uvicorn has none: an idle connection, or one sending its headers a byte at a time, was
  held forever).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from llamabatch.server.protocol import APIError, bad_request

try:  # the server extra installs it; json parses alone without it
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_MAX_BODY_MB",
    "DEFAULT_TIMEOUT_S",
    "MAX_HEAD_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_JSON_VALUES",
    "EdgeGuard",
    "ServerLimits",
    "deadline_protocol",
    "host_allowed",
    "parse_json",
    "read_json",
]

#: the default request body limit, in MiB: far more text than any context holds (a 128k-token
#: context is about 0.5 MiB of English), small enough that parsing it stays well under a second
DEFAULT_MAX_BODY_MB = 16.0
#: the default ``--timeout``: seconds a client may take to send a request's head, and its body
DEFAULT_TIMEOUT_S = 60.0
#: the deepest nesting of arrays and objects a request body may have
MAX_JSON_DEPTH = 128
#: the most values (``,`` and ``:`` separators) a request body may have: parsing 2^18 values
#: takes tens of milliseconds (a 128k-token prompt as token ids is 2^17)
MAX_JSON_VALUES = 2**18
#: bodies up to this size are parsed on the event loop; bigger ones in a worker thread
_INLINE_PARSE_BYTES = 64 * 1024
#: names that always mean this machine (``*.localhost`` resolves to loopback in browsers)
LOCAL_NAMES = ("localhost",)

logger = logging.getLogger("llamabatch.server")

#: the largest request head (request line and headers); uvicorn's httptools parser has no limit
#: (a client could send gigabytes of headers), h11's is 16 KiB
MAX_HEAD_BYTES = 64 * 1024
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)

#: the rest of a refused body is not read: the connection ends after the answer
_CLOSE = {"Connection": "close"}

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class ServerLimits:
    """The limits :func:`llamabatch.server.create_app` enforces.

    Args:
        max_body_bytes: the largest request body; a bigger one gets 413.
        timeout: seconds a request's body may take to arrive (408 after; the head's deadline is
            :func:`deadline_protocol`'s, set by ``llamabatch serve`` from the same flag).
        allowed_hosts: ``Host`` names accepted besides IP literals and localhost names
            (``("*",)`` accepts any); another host gets 400.
    """

    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 1024 * 1024)
    timeout: float = DEFAULT_TIMEOUT_S
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {self.max_body_bytes!r}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))


def _host_name(host: str) -> str:
    """The name part of a ``Host`` header: no port, IPv6 brackets removed, lower case."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether a request's ``Host`` may be served: an IP literal (DNS rebinding needs a name
    the attacker's DNS answers), ``localhost`` or ``*.localhost``, or a name in ``allowed``
    (``"*"``: any; ``".example.com"``: that domain and its subdomains)."""
    name = _host_name(host)
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name in LOCAL_NAMES or name.endswith(".localhost"):
        return True
    for pattern in allowed:
        if pattern == "*" or name == pattern.rstrip("."):
            return True
        if pattern.startswith(".") and (name.endswith(pattern) or name == pattern[1:]):
            return True
    return False


def _error_response(error: APIError) -> tuple[Message, Message]:
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    start = {"type": "http.response.start", "status": error.status, "headers": headers}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


def _is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class EdgeGuard:
    """ASGI middleware enforcing :class:`ServerLimits` on every HTTP request (see the module)."""

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is not None:
            for message in _error_response(error):
                await send(message)
            return
        try:
            await self.app(scope, self._bounded(receive, send), send)
        finally:
            # The request's state (its parsed body, its work record holding ``receive``) is in
            # a reference cycle with the server's connection object through the scope: dropped
            # here it is freed at once, not at the next full garbage collection (a flood of
            # 1 MB bodies held tens of MB until then).
            scope.pop("state", None)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers: dict[bytes, bytes] = {}
        for key, value in scope["headers"]:
            if key in headers and key in (b"host", b"content-length", b"content-type"):
                return bad_request(f"the request has more than one {key.decode()} header")
            headers[key] = value
        host = headers.get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.limits.allowed_hosts):
            return APIError(
                400,
                f"Host {host!r} is not served here: start the server with --allowed-hosts "
                f"{_host_name(host) or 'NAME'} to accept it",
                code="invalid_host",
            )
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if not _is_json(content_type):
            return APIError(
                415,
                f"the request body must be JSON (Content-Type: application/json), got "
                f"{content_type or 'no Content-Type'!r}",
                code="unsupported_media_type",
            )
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return bad_request(f"Content-Length {length.decode('latin-1')!r} is not a number")
            if int(length) > self.limits.max_body_bytes:
                return self._too_large(int(length))
        return None

    def _too_large(self, size: int | None) -> APIError:
        limit = self.limits.max_body_bytes
        got = f"{size} bytes" if size is not None else "more"
        return APIError(
            413,
            f"the request body is too large ({got}; the limit is {limit} bytes: --max-body-mb "
            f"{limit / 2**20:g})",
            code="request_too_large",
            headers=_CLOSE,
        )

    def _bounded(self, receive: Receive, send: Send) -> Receive:
        """``receive`` that counts the body's bytes (413 past the limit) and waits at most
        ``timeout`` seconds for the whole body (408); after the body it is ``receive``."""
        limits = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.timeout
        received = 0
        body_done = False

        async def bounded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {limits.timeout:g} s (--timeout)",
                    code="request_timeout",
                    headers=_CLOSE,
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limits.max_body_bytes:
                    raise self._too_large(None)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        return bounded_receive


# -- strict JSON --------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a number must be finite)")


def json_depth(value: Any, *, finite: bool = False) -> int:
    """The nesting depth of arrays and objects in ``value`` (a scalar: 0), without recursion;
    ``finite``: raise ``ValueError`` for a float that is not finite (``1e999`` parses as inf)."""
    depth = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            if finite and isinstance(item, float) and not math.isfinite(item):
                raise ValueError("a number overflows a double (a number must be finite)")
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth


def _separators(raw: bytes) -> int:
    """The ``,`` and ``:`` bytes of ``raw``, counted by numpy, which lets go of the GIL over
    big arrays (``bytes.count`` holds it: twice 0.3 ms a MiB, in every request's way)."""
    import numpy as np

    octets = np.frombuffer(raw, dtype=np.uint8)
    return int(np.count_nonzero(octets == ord(","))) + int(np.count_nonzero(octets == ord(":")))


def _may_be_a_big_integer(value: Any) -> bool:
    """Whether ``value`` holds a float of 2^63 or more: orjson reads an integer past 64 bits
    as a float, where ``json`` keeps it whole."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float) and abs(item) >= 2.0**63:
            return True
    return False


def _loads(raw: bytes) -> Any:
    """``raw`` parsed by orjson where it is installed and takes it, else by ``json``: both
    hold the GIL while they run, orjson a fifth as long (0.3 against 1.5 ms a MiB of
    string), so a flood of big bodies leaves the event loop and the engine the GIL. What
    orjson refuses (lone surrogates, a byte-order mark, bad syntax) or may have read
    otherwise (integers past 64 bits) goes to ``json``, whose answer, value or error, stands
    as before."""
    if orjson is not None:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if not _may_be_a_big_integer(value):
                return value
    return json.loads(raw, parse_constant=_no_constant)


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH, max_values: int = MAX_JSON_VALUES) -> Any:
    """``raw`` as strict JSON; ``APIError`` 400 for anything else: bad syntax or UTF-8,
    ``NaN``/``Infinity`` literals, numbers that overflow a double, integers over Python's
    digit limit, nesting deeper than ``max_depth``, and more than about ``max_values`` values
    (counted as ``,`` and ``:`` bytes before parsing: the parser holds the GIL while it
    runs, so its time, proportional to the values, is bounded for every thread)."""
    if len(raw) > max_values and _separators(raw) > max_values:
        raise bad_request(f"the request body holds too many JSON values (the limit is {max_values})")
    try:
        data = _loads(raw)
    except RecursionError:
        raise bad_request(f"the request body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    try:
        depth = json_depth(data, finite=True)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if depth > max_depth:
        raise bad_request(f"the request body is nested deeper than {max_depth} levels")
    return data


async def read_json(request: Any) -> Any:
    """A Starlette request's body (bounded by :class:`EdgeGuard`) through :func:`parse_json`;
    a big body is parsed as one of the request's steps (``offload.run_step``)."""
    from llamabatch.server.offload import PREPARE, run_step

    raw = await request.body()
    if len(raw) <= _INLINE_PARSE_BYTES:
        return parse_json(raw)
    return await run_step(request, PREPARE, parse_json, raw)


# -- the request head's deadline (uvicorn) ----------------------------------------------------


def deadline_protocol(http: str, timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``http``: ``"h11"``, ``"httptools"`` or ``"auto"``) with
    deadlines: a connection must deliver each request's head within ``timeout`` seconds of
    opening, or of the previous response's end, or it is closed (uvicorn's own keep-alive
    timer restarts on every byte received, so a client trickling its headers held the
    connection forever); and a client that stops reading its answer for ``timeout`` seconds
    once the write buffer is full is cut off (its generation is cancelled as for a
    disconnect). The body's deadline is :class:`EdgeGuard`'s."""
    base: Any
    if http == "httptools" or http == "auto":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        except ImportError:
            if http == "httptools":
                raise
            from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class DeadlineProtocol(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # bytes received towards the request head being read

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            reading_head = cycle is None or cycle.response_complete
            if reading_head:
                self._head_bytes += len(data)
            super().data_received(data)
            cycle = self.cycle
            if reading_head and (cycle is None or cycle.response_complete):  # still in the head
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self.transport.write(_HEAD_TOO_LARGE)
                    self.transport.close()

        def pause_writing(self) -> None:  # the transport's buffer is full: the client must read
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(timeout, self._write_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timeout(self) -> None:
            self._write_timer = None
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.warning(
                "%s stopped reading its answer for %g s (--timeout): connection dropped", peer, timeout
            )
            self.transport.abort()  # close() would wait for a buffer that never drains

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._start_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._head_bytes = 0
            if not self.transport.is_closing():
                self._start_head_timer()

        def _start_head_timer(self) -> None:
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(timeout, self._head_timeout)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is being answered: its head came in time
            if not self.transport.is_closing():
                self.transport.close()

    DeadlineProtocol.__name__ = DeadlineProtocol.__qualname__ = f"Deadline{base.__name__}"
    return DeadlineProtocol
