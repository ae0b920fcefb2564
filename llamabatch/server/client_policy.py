"""Priority is the server's policy, not a client's wish; and one client's share of the queue.

- :class:`ClientPriority` (``--client-priority``): what becomes of the ``priority`` a request
  body sends. ``off`` (the default): ignored, every request runs at 0; ``clamp:LO..HI``: the
  value (0 when absent) clamped into ``[LO, HI]``. Without it any client could send
  ``priority: -2147483648`` and run ahead of everyone.
- :class:`ClientPolicy`: that, and the most completions one client may have queued or
  running at once (``--max-queue-per-client``; default half of ``max_queue`` plus
  ``n_parallel``, so one client fills at most half the queue, and one backend serving many
  users from one address still has room). Past it the request gets 429 with
  ``Retry-After``; a request that alone holds more runs only while its client has nothing
  else in flight.
- :class:`ClientShare`: ASGI middleware that identifies each request's client and frees what
  the request holds when its answer ends (a stream's too). A client is its peer address:
  uvicorn has already put the ``X-Forwarded-For`` address there when, and only when, the
  peer is a proxy of ``--forwarded-allow-ips`` (the trust rule of ``llamabatch serve``); an
  IPv6 client is its /64 network (one host may hold a whole /64). The API key does not tell
  clients apart: the server has one, shared by all.
- :func:`request_priority`: the generation handlers' one call, once the request's
  completions are known: the priority to run at, or the 429.
- :func:`client_key`: the client, passed to the engine (``LLM.agenerate(..., client=)``), in
  whose queue clients take turns at one priority: a client that queued many requests does
  not make another client's request wait behind all of them (``generate/priority.py``), and
  by whose share of the host-RAM prompt cache its saved states count (``RamCache``).

The engine ages waiting requests (``EngineConfig.priority_aging``), so within what the
policy allows no request waits forever behind better priorities either.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from llamabatch.server.protocol import APIError, Body

__all__ = [
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "ClientPolicy",
    "ClientPriority",
    "ClientShare",
    "client_key",
    "client_of",
    "request_priority",
]

logger = logging.getLogger("llamabatch.server")

#: the range a request body's ``priority`` must lie in (32 bits, as the engine checks)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
#: seconds a refused client is told to wait (``Retry-After``): a slot frees within a tick or so
RETRY_AFTER_S = 1
#: where ``ClientShare`` puts a request's ticket in the ASGI scope
_SCOPE_KEY = "llamabatch.client_ticket"
_CLAMP = re.compile(r"clamp:(-?\d+)\.\.(-?\d+)")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class ClientPriority:
    """What becomes of a request body's ``priority``: ``None`` bounds (``off``): ignored
    (0); else clamped into ``[low, high]``."""

    low: int | None = None
    high: int | None = None

    def __post_init__(self) -> None:
        if (self.low is None) != (self.high is None):
            raise ValueError("give both bounds of a client priority range, or neither (off)")
        if self.low is not None and self.high is not None:
            for bound in (self.low, self.high):
                if isinstance(bound, bool) or not isinstance(bound, int):
                    raise ValueError(f"client priority bounds must be ints, got {bound!r}")
                if not PRIORITY_MIN <= bound <= PRIORITY_MAX:
                    raise ValueError(f"client priority bound {bound} does not fit 32 bits")
            if self.low > self.high:
                raise ValueError(f"client priority range {self.low}..{self.high} is empty")

    @classmethod
    def parse(cls, text: str) -> ClientPriority:
        """``"off"`` or ``"clamp:LO..HI"`` (``--client-priority``); ``ValueError`` otherwise."""
        text = text.strip()
        if text == "off":
            return cls()
        match = _CLAMP.fullmatch(text)
        if match is None:
            raise ValueError(
                f"--client-priority must be 'off' or 'clamp:LO..HI' (e.g. clamp:-10..10), got {text!r}"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def apply(self, sent: int | None) -> int:
        """The priority a request that sent ``sent`` (``None``: none) runs at."""
        if self.low is None or self.high is None:
            return 0
        return min(max(sent or 0, self.low), self.high)

    def __str__(self) -> str:
        return "off" if self.low is None else f"clamp:{self.low}..{self.high}"


@dataclass(frozen=True)
class ClientPolicy:
    """The server's policy for client priorities and shares (see the module).

    Args:
        priority: what becomes of a body's ``priority`` (default: ignored).
        max_per_client: the most completions (prompts x ``n``) one client may have queued
            or running; ``None``: :meth:`resolved` picks the default from the engine.
    """

    priority: ClientPriority = field(default_factory=ClientPriority)
    max_per_client: int | None = None

    def __post_init__(self) -> None:
        cap = self.max_per_client
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_per_client must be a positive int or None, got {cap!r}")

    def resolved(self, max_queue: int, n_parallel: int) -> ClientPolicy:
        """This policy with the default share filled in (half of ``max_queue`` plus
        ``n_parallel``), logged once."""
        cap = self.max_per_client or max(1, max_queue // 2) + n_parallel
        logger.info(
            "client priorities: %s; at most %d completions queued or running per client",
            self.priority,
            cap,
        )
        return ClientPolicy(self.priority, cap)


def client_of(scope: Scope) -> str:
    """The client a request comes from: its peer address (after uvicorn's trusted-proxy
    rule), an IPv6 address as its /64 network; ``""`` when the server has none."""
    peer = scope.get("client")
    host = str(peer[0]) if peer else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Ticket:
    """What one HTTP request holds of its client's share."""

    __slots__ = ("client", "held", "share")

    def __init__(self, share: ClientShare, client: str) -> None:
        self.share, self.client, self.held = share, client, 0


class ClientShare:
    """ASGI middleware: counts each client's completions in flight under a
    :class:`ClientPolicy` (see the module); a request's count is freed when its answer ends."""

    def __init__(self, app: ASGIApp, policy: ClientPolicy) -> None:
        self.app = app
        self.policy = policy
        self.in_flight: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ticket = scope[_SCOPE_KEY] = _Ticket(self, client_of(scope))
        try:
            await self.app(scope, receive, send)
        finally:
            self._release(ticket)

    def take(self, ticket: _Ticket, n: int) -> None:
        """Count ``n`` more completions for ``ticket``'s client; 429 (with ``Retry-After``)
        when they would pass the share with the client's requests in flight. A request over the
        share alone is served when the client has nothing else in flight (``--max-queue``
        bounds it), so a batch that fits the queue always runs, one at a time."""
        cap = self.policy.max_per_client
        if cap is None:
            return
        held = self.in_flight.get(ticket.client, 0)
        if held and held + n > cap:
            raise APIError(
                429,
                f"this client has {held} completions queued or running; at most {cap} at once "
                f"(--max-queue-per-client): retry when some have finished",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.in_flight[ticket.client] = held + n
        ticket.held += n

    def _release(self, ticket: _Ticket) -> None:
        if not ticket.held:
            return
        left = self.in_flight.get(ticket.client, 0) - ticket.held
        ticket.held = 0
        if left > 0:
            self.in_flight[ticket.client] = left
        else:
            self.in_flight.pop(ticket.client, None)


def request_priority(request: Any, body: Body, n_completions: int) -> int:
    """The priority a generation request runs at under the server's policy (the body's
    ``priority`` checked, then ignored or clamped), after counting its ``n_completions``
    against its client's share (429 past it). ``request``: the Starlette request."""
    sent = body.get("priority", "int", minimum=PRIORITY_MIN, maximum=PRIORITY_MAX)  # lower first (vLLM)
    ticket = request.scope.get(_SCOPE_KEY)
    if not isinstance(ticket, _Ticket):  # not behind ClientShare: no share, priorities off
        return 0
    ticket.share.take(ticket, n_completions)
    priority = ticket.share.policy.priority.apply(sent)
    if sent is not None and sent != priority:
        logger.debug(
            "client %s sent priority %d; it runs at %d (--client-priority)", ticket.client, sent, priority
        )
    return priority


def client_key(request: Any) -> str:
    """The client a Starlette request comes from (:func:`client_of`, as ``ClientShare``
    counts it): the engine gives clients turns by it."""
    ticket = request.scope.get(_SCOPE_KEY)
    return ticket.client if isinstance(ticket, _Ticket) else client_of(request.scope)
