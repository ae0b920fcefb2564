"""Admission and preemption policies: the one home of who waits, who starts, who gives way.

The engine core (``core.py``) runs the mechanics: slots, KV room, samplers, the queue. Every
scheduling choice it makes goes through its :class:`AdmissionPolicy`, as the composition of
each batch goes through its ``Strategy`` (``_core/strategies.pyx``):

- the wait order: where a queued request goes (``enqueue``), and, before each admission
  pass, any reordering that depends on the moment (``reorder``);
- whether the next waiting request starts now (``admits``: :class:`Verdict` ``ADMIT``,
  ``PASS`` to go on to the next one, ``STOP`` to admit no more this step);
- each tick's token budget and the time limit plug-ins keep to (``tick_budget``,
  ``tick_limit``), learned from measured decodes (``observe``), and the order in which the
  prompts being computed take its prompt tokens (``prefill_order``; arrival order by default);
- victims: the running request preempted when a decode finds no KV room
  (``room_victim``), and the one a waiting request that cannot start may preempt
  (``blocked_victim``).

Implementations compose: :class:`PriorityAdmission` (first come, first served, with
priorities, aging and client turns, ``priority.py``) is the base; a
:class:`DelegatingAdmission` wraps another policy and changes one concern:
:class:`LatencyAdmission` (the tick budget under ``target_itl_ms``, ``cost_model.py``) and
:class:`GroupedAdmission` (requests grouped by a key, e.g. an adapter: at most
``max_groups`` keys run at once); ``slo.SLOAdmission`` schedules for goodput under SLOs.
``policies.admission_for`` builds an ``EngineConfig``'s policy.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

from llamabatch._core.slots import SlotState, SlotTable
from llamabatch.generate.cost_model import DecodeCostModel, LatencyBudget, TickFeatures
from llamabatch.generate.priority import ClientSlots, ClientTurns, enqueue, priority_victim, share_victim
from llamabatch.generate.request import Request

__all__ = [
    "AdmissionPolicy",
    "DelegatingAdmission",
    "GroupedAdmission",
    "LatencyAdmission",
    "Prefilling",
    "PriorityAdmission",
    "TickLimit",
    "Verdict",
    "order_prefill",
]

#: the running requests, as ``(slot, request)`` pairs (``SlotMap.busy()``)
Running = Iterable[tuple[int, Request]]


class Prefilling(NamedTuple):
    """A request whose prompt is being computed: its slot and the prompt tokens left."""

    slot: int
    request: Request
    n_pending: int


class Verdict(enum.Enum):
    """What admission does with the waiting request it looks at."""

    #: start it now (when its prompt fits the KV cache)
    ADMIT = "admit"
    #: leave it waiting, and look at the next one
    PASS = "pass"
    #: leave it and every request behind it waiting until the next step
    STOP = "stop"


class TickLimit(NamedTuple):
    """The decode time a tick's plan keeps under (seconds), as ``model`` predicts it."""

    model: DecodeCostModel
    seconds: float


class AdmissionPolicy:
    """The scheduling choices of the engine core (see the module). This base admits every
    request in the order it is given, gives every tick the full ``n_batch`` and preempts for
    KV room the latest-arrived running request; subclasses change what they need."""

    @property
    def learns_costs(self) -> bool:
        """Whether ``observe`` learns from measured decodes (the core reads the features only then)."""
        return False

    @property
    def preempts_for_waiting(self) -> bool:
        """Whether a waiting request that cannot start may preempt a running one (else the
        core does not look for a ``blocked_victim``)."""
        return False

    def enqueue(self, waiting: deque[Request], requests: Iterable[Request], n_admitted: int) -> None:
        """Put ``requests`` (new, or preempted ones coming back) into ``waiting``;
        ``n_admitted``: the admissions so far."""
        waiting.extend(requests)

    def reorder(self, waiting: deque[Request], now: float) -> None:
        """Reorder ``waiting`` before an admission pass at time ``now`` (seconds, the
        ``time.perf_counter`` clock requests are stamped with)."""

    def admits(self, request: Request, n_prompt: int, table: SlotTable, busy: list[int]) -> Verdict:
        """Whether ``request`` (``n_prompt`` tokens to compute) starts now, given the busy
        slots ``busy`` (this step's admissions included)."""
        return Verdict.ADMIT

    def admitted(self, request: Request) -> None:
        """``request`` started in a slot."""

    def released(self, request: Request) -> None:
        """``request`` left its slot (it ended, or was preempted)."""

    def tick_budget(self, table: SlotTable, busy: list[int], n_batch: int) -> int:
        """The most tokens of the next tick's batch."""
        return n_batch

    def tick_limit(self) -> TickLimit | None:
        """The time limit of the tick being planned, for plug-ins that add to it (drafts)."""
        return None

    def prefill_order(self, prefilling: Sequence[Prefilling], now: float) -> list[int] | None:
        """The order in which the prompts being computed (``prefilling``, in arrival order)
        take the next tick's prompt tokens, as slots; None keeps arrival order."""
        return None

    def predicted(self) -> float | None:
        """The predicted decode time of the last tick (telemetry), None without a model."""
        return None

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        """A batch of ``features`` decoded in ``elapsed`` seconds (when ``learns_costs``)."""

    def room_victim(self, running: Sequence[tuple[int, Request]]) -> int:
        """The slot to preempt when a decode finds no KV room (-1: none): the running request
        that arrived last, never the only one."""
        if len(running) < 2:
            return -1
        return max((r.arrival, s) for s, r in running)[1]

    def blocked_victim(self, running: Sequence[tuple[int, Request]], blocked: Request) -> tuple[int, bool]:
        """``(slot, takes_it)``: the running request ``blocked`` preempts (slot -1: none),
        and whether ``blocked`` starts in its place at once (else admission runs again)."""
        return -1, False


class PriorityAdmission(AdmissionPolicy):
    """First come, first served, with priorities, aging, client turns and slot shares (see
    ``priority.py``): a request of a better priority preempts one of a worse, and a client
    that holds no slot goes first and takes one from the client holding the most."""

    def __init__(self, aging: int = 0) -> None:
        self.aging = aging
        self.turns = ClientTurns()
        #: whether any request had a priority other than 0 (else no priority preemption)
        self.priorities = False
        #: whether any request had a client (else no slot shares to check)
        self.clients = False
        #: the slots each client holds
        self.slots = ClientSlots()

    @property
    def preempts_for_waiting(self) -> bool:
        return self.priorities or self.clients

    def enqueue(self, waiting: deque[Request], requests: Iterable[Request], n_admitted: int) -> None:
        requests = list(requests)
        enqueue(waiting, requests, self.aging, n_admitted, self.turns)
        for request in requests:
            if request.priority:
                self.priorities = True
            if request.client is not None:
                self.clients = True

    def reorder(self, waiting: deque[Request], now: float) -> None:
        if self.clients:
            self.slots.newcomer_first(waiting)

    def admitted(self, request: Request) -> None:
        self.slots.admitted(request)

    def released(self, request: Request) -> None:
        self.slots.released(request)

    def blocked_victim(self, running: Sequence[tuple[int, Request]], blocked: Request) -> tuple[int, bool]:
        slot = priority_victim(running, blocked, self.aging)
        if slot >= 0:  # one preemption, then admission again (it ends: see priority.py)
            return slot, False
        if self.clients:  # the blocked request takes the freed slot itself
            return share_victim(running, blocked), True
        return -1, False


class DelegatingAdmission(AdmissionPolicy):
    """A policy that does what ``inner`` does, for subclasses to change one concern."""

    def __init__(self, inner: AdmissionPolicy) -> None:
        self.inner = inner

    @property
    def learns_costs(self) -> bool:
        return self.inner.learns_costs

    @property
    def preempts_for_waiting(self) -> bool:
        return self.inner.preempts_for_waiting

    def enqueue(self, waiting: deque[Request], requests: Iterable[Request], n_admitted: int) -> None:
        self.inner.enqueue(waiting, requests, n_admitted)

    def reorder(self, waiting: deque[Request], now: float) -> None:
        self.inner.reorder(waiting, now)

    def admits(self, request: Request, n_prompt: int, table: SlotTable, busy: list[int]) -> Verdict:
        return self.inner.admits(request, n_prompt, table, busy)

    def admitted(self, request: Request) -> None:
        self.inner.admitted(request)

    def released(self, request: Request) -> None:
        self.inner.released(request)

    def tick_budget(self, table: SlotTable, busy: list[int], n_batch: int) -> int:
        return self.inner.tick_budget(table, busy, n_batch)

    def tick_limit(self) -> TickLimit | None:
        return self.inner.tick_limit()

    def prefill_order(self, prefilling: Sequence[Prefilling], now: float) -> list[int] | None:
        return self.inner.prefill_order(prefilling, now)

    def predicted(self) -> float | None:
        return self.inner.predicted()

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        self.inner.observe(features, elapsed)

    def room_victim(self, running: Sequence[tuple[int, Request]]) -> int:
        return self.inner.room_victim(running)

    def blocked_victim(self, running: Sequence[tuple[int, Request]], blocked: Request) -> tuple[int, bool]:
        return self.inner.blocked_victim(running, blocked)


class LatencyAdmission(DelegatingAdmission):
    """``inner``'s order and victims, with each tick's budget under ``target_itl_ms``
    (``cost_model.LatencyBudget``): a request starts only while the decoding streams' ticks
    stay under the target with it (``LatencyBudget.admits``), else the queue waits."""

    def __init__(self, inner: AdmissionPolicy, latency: LatencyBudget) -> None:
        super().__init__(inner)
        self.latency = latency

    @property
    def learns_costs(self) -> bool:
        return True

    def admits(self, request: Request, n_prompt: int, table: SlotTable, busy: list[int]) -> Verdict:
        if not self.latency.admits(table, busy, n_prompt):
            return Verdict.STOP  # one more stream would push every tick over the target
        return self.inner.admits(request, n_prompt, table, busy)

    def tick_budget(self, table: SlotTable, busy: list[int], n_batch: int) -> int:
        return min(self.latency.budget(table, busy), self.inner.tick_budget(table, busy, n_batch))

    def tick_limit(self) -> TickLimit | None:
        return TickLimit(self.latency.model, self.latency.aim)

    def predicted(self) -> float | None:
        return self.latency.predicted

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        self.latency.observe(features, elapsed)
        self.inner.observe(features, elapsed)


class GroupedAdmission(DelegatingAdmission):
    """``inner``'s policy, with requests grouped by ``key(request)`` (an adapter, say): a
    request starts only while at most ``max_groups`` keys run with it. A request of another
    key is passed over (the ones behind it of running keys start) at most ``patience``
    times; after that admission stops at it until the running groups drain, so no group
    waits forever behind a busy one."""

    def __init__(
        self,
        inner: AdmissionPolicy,
        key: Callable[[Request], Hashable],
        max_groups: int = 1,
        patience: int = 8,
    ) -> None:
        super().__init__(inner)
        if max_groups < 1:
            raise ValueError(f"max_groups must be at least 1, got {max_groups!r}")
        self.key = key
        self.max_groups = max_groups
        self.patience = patience
        #: request arrival -> times passed over
        self._passed: dict[int, int] = {}
        #: key -> requests of it running
        self._running: dict[Hashable, int] = {}

    def admits(self, request: Request, n_prompt: int, table: SlotTable, busy: list[int]) -> Verdict:
        key = self.key(request)
        if busy and key not in self._running and len(self._running) >= self.max_groups:
            n = self._passed.get(request.arrival, 0)
            if n >= self.patience:
                return Verdict.STOP
            if len(self._passed) > 4096:  # requests cancelled while passed over
                self._passed.clear()
            self._passed[request.arrival] = n + 1
            return Verdict.PASS
        return self.inner.admits(request, n_prompt, table, busy)

    def admitted(self, request: Request) -> None:
        self._passed.pop(request.arrival, None)
        key = self.key(request)
        self._running[key] = self._running.get(key, 0) + 1
        self.inner.admitted(request)

    def released(self, request: Request) -> None:
        key = self.key(request)
        n = self._running.get(key, 0) - 1
        if n > 0:
            self._running[key] = n
        else:
            self._running.pop(key, None)
        self.inner.released(request)


def order_prefill(policy: AdmissionPolicy, table: SlotTable, requests: Sequence[Request | None]) -> None:
    """Let ``policy`` order the prompts being computed, before a tick is filled (``requests``:
    the request of each slot); also one alone, whose predicted first token the SLO policy
    weighs (``SLOAdmission.prefill_order``)."""
    if table.count(SlotState.PREFILL) == 0:
        return
    prefilling = []
    for slot in table.view().prefill_slots:
        request = requests[slot]
        if request is None:
            return
        prefilling.append(Prefilling(slot, request, table.n_pending(slot)))
    order = policy.prefill_order(prefilling, time.perf_counter())
    if order is not None:
        table.order_prefill(order)
