"""Request priorities: the order of the waiting queue, and whom a higher priority preempts.

A request's ``priority`` is an int, lower first (as vLLM); the default 0 for all keeps
first come, first served. The queue is ordered by :func:`wait_key`: the aged priority,
then preempted requests before new ones (they were admitted once), then the turn, then
arrival. When a
waiting request cannot start (no idle slot, or with a unified KV cache no room for its
prompt) and a request of a lower priority (a higher number) runs, the most recently
admitted such request is preempted: its KV cells are freed and it goes back to the queue,
to be recomputed later with what it generated so far (invisible to its caller, as a
preemption for KV room).

Turns: clients take turns at one priority. A request is stamped at its first queueing
with its turn (``Request.wait_stamp``): the core's admission count, or for a request with
a ``client`` (``LLM.agenerate(..., client=)``; the server passes the peer's address) one
more than that client's previous turn when that is later (:class:`ClientTurns`). So a
client that queued 100 requests holds the next 100 turns, and another client's request,
stamped with the admission count, runs after at most one of them: round robin among the
clients with requests waiting, instead of first come, first served. Requests without a
client keep the admission count: first come, first served, as before.

Aging: no waiting request starves behind a stream of better priorities. A request's aged
priority is ``priority + wait_stamp // aging`` (``EngineConfig.priority_aging``, 0: no
aging). As every waiting request's stamp is fixed, the order is static (the queue stays
sorted by insertion), and relative to the requests arriving later a waiting request gains
one level per ``aging`` admissions: one that is ``d`` levels behind the best priority
arriving is overtaken only by requests arriving within ``(d + 1) * aging`` admissions
after it. Only whole epochs of ``aging`` admissions count, so requests within one epoch
keep strict priority order. A client's turns far ahead age its requests less: its own
backlog counts against it.

No starvation of a running request: one that was already preempted
``MAX_PRIORITY_PREEMPTIONS`` times (for any reason) is no longer preempted for priority,
so it runs to its end once admitted again; and a request preempts only one of a lower
priority whose aged priority is lower too (:func:`priority_victim`), so a request that
aged its way in is not pushed out by the stream it waited behind.

Slot shares: turns order the queue, but a client whose requests hold every slot (one
request with ``n`` 16, say, or a few clients with long requests) would still keep another
client waiting until one of them ends. So a client that holds no slot goes first:

- its first waiting request that was never admitted goes to the head of the queue before
  each admission pass (:meth:`ClientSlots.newcomer_first`; such requests of several clients
  keep their order), ahead of preempted requests and of other clients' turns, at no better
  priority than the head's;
- when every slot is busy, that request preempts one running request and starts in its
  place (:func:`share_victim`): one of the client holding the most slots, the one with the
  fewest preemptions so far, then the most tokens left to generate, and only if that is more
  than the newcomer may generate in all; never one of a better priority, a pin, or one
  preempted ``MAX_SHARE_PREEMPTIONS`` times already.

So a short request of a client with nothing running starts within one step, however many
long requests other clients keep queued or running; the request it displaced keeps its
tokens and resumes at the next free slot (its prompt and tokens are recomputed), and is
displaced at most ``MAX_SHARE_PREEMPTIONS`` times. Requests without a client take no part.
"""

from __future__ import annotations

import bisect
import functools
from collections import deque
from collections.abc import Hashable, Iterable

from llamabatch.generate.request import Request, RequestKind
from llamabatch.status import RequestStatus

__all__ = [
    "MAX_PRIORITY_PREEMPTIONS",
    "MAX_SHARE_PREEMPTIONS",
    "ClientSlots",
    "ClientTurns",
    "aged_priority",
    "check_priority",
    "enqueue",
    "priority_victim",
    "share_victim",
    "wait_key",
    "work_left",
]

#: how often one request may be preempted (for any reason) and still be preempted for priority
MAX_PRIORITY_PREEMPTIONS = 2
#: how often one request may be preempted (for any reason) and still give its slot to a client
#: holding none (``share_victim``): it keeps its tokens, so each time costs a recompute only
MAX_SHARE_PREEMPTIONS = 4


def check_priority(priority: object) -> int:
    """``priority`` as an int; ``ValueError`` for anything else (a bool included)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int (lower runs first), got {priority!r}")
    if not -(2**31) <= priority < 2**31:
        raise ValueError(f"priority must fit 32 bits, got {priority!r}")
    return priority


def aged_priority(request: Request, aging: int) -> int:
    """``request``'s rank among priorities: its priority plus one level per ``aging``
    admissions made before it was first queued, so that it gains a level on the requests
    queued after it per ``aging`` admissions (``aging`` 0: the priority itself)."""
    if not aging:
        return request.priority
    return request.priority + max(request.wait_stamp, 0) // aging


class ClientTurns:
    """Each client's last turn (see the module): a request of a client gets the later of
    the admission count and one past the client's previous turn."""

    #: clients remembered before the ones whose turns are past are forgotten
    PRUNE_AT = 4096

    def __init__(self) -> None:
        self.last: dict[Hashable, int] = {}

    def turn(self, client: Hashable | None, n_admitted: int) -> int:
        """The next turn of ``client`` (``None``: no client, the admission count)."""
        if client is None:
            return n_admitted
        last = self.last
        turn = max(n_admitted, last.get(client, -1) + 1)
        last[client] = turn
        if len(last) > self.PRUNE_AT:  # a client whose turn is past is as one never seen
            for key in [key for key, value in last.items() if value < n_admitted]:
                del last[key]
        return turn


def wait_key(request: Request, aging: int = 0) -> tuple[int, int, int, int]:
    """A waiting request's place: aged priority, preempted before new, turn, then arrival."""
    preempted = 0 if request.status is RequestStatus.PREEMPTED else 1
    return (aged_priority(request, aging), preempted, request.wait_stamp, request.arrival)


def enqueue(
    waiting: deque[Request],
    requests: Iterable[Request],
    aging: int = 0,
    n_admitted: int = 0,
    turns: ClientTurns | None = None,
) -> None:
    """Put ``requests`` into ``waiting`` at their places (:func:`wait_key` with ``aging``;
    the queue is kept sorted by the same ``aging``). A request queued for the first time is
    stamped with its turn (``turns``; without: ``n_admitted``, the admissions so far); a
    preempted one keeps its stamp."""
    key_of = functools.partial(wait_key, aging=aging)
    for request in requests:
        if request.wait_stamp < 0:
            request.wait_stamp = n_admitted if turns is None else turns.turn(request.client, n_admitted)
        key = key_of(request)
        if not waiting or key_of(waiting[-1]) <= key:
            waiting.append(request)
        else:
            waiting.insert(bisect.bisect_right(waiting, key, key=key_of), request)


def priority_victim(running: Iterable[tuple[int, Request]], blocked: Request, aging: int = 0) -> int:
    """The slot of the most recently admitted running request that ``blocked`` may preempt,
    or -1: one of a lower priority than ``blocked``'s (a higher number), and a lower aged
    priority too, preempted fewer than ``MAX_PRIORITY_PREEMPTIONS`` times, not a pin."""
    priority = blocked.priority
    aged = aged_priority(blocked, aging)
    best_slot, best_order = -1, -1
    for slot, request in running:
        if (
            request.priority > priority
            and request.n_preemptions < MAX_PRIORITY_PREEMPTIONS
            and request.kind is not RequestKind.PIN
            and request.admitted_order > best_order
            and aged_priority(request, aging) > aged
        ):
            best_slot, best_order = slot, request.admitted_order
    return best_slot


def work_left(request: Request) -> int:
    """The tokens ``request`` may still generate (``max_tokens`` less those it has)."""
    return request.params.max_tokens - len(request.output_tokens)


def share_victim(running: Iterable[tuple[int, Request]], blocked: Request) -> int:
    """The slot that ``blocked``, a waiting request of a client holding no slot, takes, or
    -1 (see the module): a request of the client holding the most slots with more tokens
    left than ``blocked`` may generate in all (the one preempted least often, then with the
    most tokens left, then the most recently admitted), of no better priority, preempted
    fewer than ``MAX_SHARE_PREEMPTIONS`` times, not a pin."""
    client = blocked.client
    if client is None:
        return -1
    held: dict[Hashable, list[tuple[int, Request]]] = {}
    for slot, request in running:
        if request.client == client:
            return -1  # it has a slot already: it waits its turn
        if request.client is not None:
            held.setdefault(request.client, []).append((slot, request))
    need = work_left(blocked)
    best_slot, best_key = -1, (0, -MAX_SHARE_PREEMPTIONS, 0, -1)
    for requests in held.values():
        for slot, request in requests:
            left = work_left(request)
            key = (len(requests), -request.n_preemptions, left, request.admitted_order)
            if (
                left > need
                and key > best_key
                and request.priority >= blocked.priority
                and request.n_preemptions < MAX_SHARE_PREEMPTIONS
                and request.kind is not RequestKind.PIN
            ):
                best_slot, best_key = slot, key
    return best_slot


class ClientSlots:
    """How many slots each client holds (the admission policy reports each admission and
    release), and which waiting request goes first because its client holds none."""

    def __init__(self) -> None:
        self.held: dict[Hashable, int] = {}

    def admitted(self, request: Request) -> None:
        """``request`` took a slot."""
        if request.client is not None:
            self.held[request.client] = self.held.get(request.client, 0) + 1

    def released(self, request: Request) -> None:
        """``request`` left its slot (it ended, or was preempted)."""
        client = request.client
        if client is None:
            return
        n = self.held.get(client, 0) - 1
        if n > 0:
            self.held[client] = n
        else:
            self.held.pop(client, None)

    def newcomer_first(self, waiting: deque[Request]) -> None:
        """Move to the head of ``waiting``, in their order, the first request of each client
        that holds no slot, never admitted before, of no worse priority than the head's (see
        the module)."""
        if len(waiting) < 2:
            return
        head_priority = waiting[0].priority
        seen: set[Hashable] = set()
        first: list[Request] = []
        rest: list[Request] = []
        for request in waiting:
            if request.priority <= head_priority and request.client not in seen and self.is_newcomer(request):
                seen.add(request.client)
                first.append(request)
            else:
                rest.append(request)
        if first and any(a is not b for a, b in zip(first, waiting, strict=False)):
            waiting.clear()
            waiting.extend(first)
            waiting.extend(rest)

    def is_newcomer(self, request: Request) -> bool:
        """Whether ``request`` is a client's, never admitted, its client holding no slot, and
        ready to start (not a follower waiting for its leader)."""
        return (
            request.client is not None
            and request.n_preemptions == 0
            and request.client not in self.held
            and not (request.kind is RequestKind.FOLLOWER and request.follower_waits)
        )
