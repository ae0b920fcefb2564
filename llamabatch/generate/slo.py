"""Scheduling for goodput under service-level objectives (``slo_ttft_ms``, ``slo_itl_ms``).

An SLO says what a user needs: the first token within ``slo_ttft_ms``, no gap between tokens
over ``slo_itl_ms`` (``EngineConfig``, or per request in ``SamplingParams``). Goodput is the
share of requests that meet theirs. :class:`SLOAdmission` spends slack instead of latency:

- **Ticks.** A tick runs its prompt tokens at full speed (the whole ``n_batch``) unless a
  running stream would then wait longer than its ITL SLO for its next token, as the online
  cost model (``cost_model.DecodeCostModel``) predicts the tick; only then is the prefill
  sliced, to the most prompt tokens whose tick stays under the tightest running ITL SLO
  (``LatencyBudget.budget``, aiming under the SLO by the model's largest recent error: an
  SLO bounds every gap, not most of them; and 5% more, ``SLO_HEADROOM``). A prompt always
  moves by one token a tick at least: when the decodes alone break the SLO, no choice could
  meet it. Only the requests that met their TTFT SLO or still can (as predicted) bound the
  ticks: a late one cannot count as goodput, and runs on as a request without an SLO.
- **Order.** Before each admission pass the waiting requests are ranked, within each
  priority (aging orders the priorities, each by its longest-waiting request:
  :func:`priority_levels`; preempted requests first, as ``priority.py``): first those that
  can still meet their TTFT SLO, shortest prompt first (each one's predicted prefill time,
  added to that of the requests before it, must fit the time its SLO leaves), then those
  that cannot, in arrival order. A late request does not take the place of one that can still be served
  in time; a request without a TTFT SLO counts as one that can. No request waits forever:
  one that ``patience`` admissions passed while it waited (``DEFAULT_PATIENCE``) is overdue,
  and the overdue go first, in arrival order, so a long or late prompt is served within
  about ``patience`` admissions however many short ones keep arriving. The prompts being
  computed take each tick's prompt tokens in the same order (``prefill_order``), so a
  short prompt admitted behind a long one does not wait for all of it.
- **Admission.** A request starts unless its stream would push every decode tick over the
  tightest ITL SLO (``LatencyBudget.admits``), as under ``target_itl_ms``. From
  ``RESERVE_FROM`` slots, a request predicted late for its TTFT SLO does not take the last
  free slot (unless overdue): that one waits for a request that can still be served in time.
- **Refusal** (``slo_reject``, off by default). At submit, :func:`check_slo` refuses with
  ``SLOUnmet`` a request that, ranked among the waiting ones, is predicted late for its TTFT
  SLO (:meth:`SLOAdmission.refusal`; the running prompts are not counted, so only the
  requests the queue already makes late are refused).

Each request's attainment is in its ``metrics`` (``Timings.slo_met``), and the engine's
``stats()`` and ``/metrics`` count requests with an SLO and those that met it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from llamabatch._core.slots import SlotTable
from llamabatch.errors import SLOUnmet
from llamabatch.generate.admission import AdmissionPolicy, DelegatingAdmission, Prefilling, TickLimit, Verdict
from llamabatch.generate.cost_model import LatencyBudget, TickFeatures
from llamabatch.generate.priority import aged_priority
from llamabatch.generate.request import Request
from llamabatch.status import RequestStatus

__all__ = ["DEFAULT_PATIENCE", "RESERVE_FROM", "SLO_HEADROOM", "SLOAdmission", "check_slo"]

#: a waiting request's rank: aged priority, preempted first, tier (0 overdue, 1 in time,
#: 2 late), its prefill time or arrival, arrival
_Key = tuple[int, int, int, float, int]

#: admissions a waiting request lets pass before it is served in arrival order
DEFAULT_PATIENCE = 16

#: how far under the largest recent error an SLO's ticks aim (``LatencyBudget.headroom``)
SLO_HEADROOM = 1.05

#: from this many slots, the last free one is kept from requests predicted late
#: (``SLOAdmission._keeps_the_last_slot``)
RESERVE_FROM = 4

#: the ITL target of a budget no running stream constrains (never read: no stream has one)
_NO_TARGET = 1e9


class SLOAdmission(DelegatingAdmission):
    """``inner``'s policy, scheduled for goodput under SLOs (see the module): ``ttft`` and
    ``itl`` (seconds, None: none) are the engine's SLOs, a request's own override them;
    ``aging`` is the queue's priority aging (``priority_aging``); ``patience``: the admissions
    a waiting request lets pass before it goes first (see the module); ``reject``: refuse a
    request predicted late at submit (``slo_reject``)."""

    def __init__(
        self,
        inner: AdmissionPolicy,
        *,
        ttft: float | None,
        itl: float | None,
        n_batch: int,
        aging: int = 0,
        latency: LatencyBudget | None = None,
        patience: int = DEFAULT_PATIENCE,
        reject: bool = False,
    ) -> None:
        super().__init__(inner)
        #: refuse at submit a request predicted late (``slo_reject``, :func:`check_slo`)
        self.reject = reject
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience!r}")
        self.patience = patience
        #: admissions so far, and each waiting request's count when first seen waiting
        self._n_admitted = 0
        self._stamps: dict[int, int] = {}
        self.ttft = ttft
        self.itl = itl
        self.n_batch = n_batch
        self.aging = aging
        #: the tick budget under the tightest running ITL SLO, and its cost model (aiming under
        #: the SLO by the largest error of the last minute or so, and 5% more: an SLO bounds
        #: every gap, not most of them, and a tick over the largest recent error, about one in
        #: 257, breaks it for every stream in it: at 0.5 req/s 3 of 908 ticks took 251-256 ms
        #: and cost 7 chats their 250 ms SLO)
        if latency is None:
            latency = LatencyBudget(
                itl or _NO_TARGET,
                n_batch,
                margin_quantile=1.0,
                error_window=256,
                first_margin=1.5,
                headroom=SLO_HEADROOM,
            )
        self.latency = latency
        #: whether a request with an SLO was ever queued (until then: ``inner`` alone)
        self.active = ttft is not None or itl is not None
        #: the running requests with an ITL SLO that met their TTFT SLO or still can, by id
        self._running: dict[int, Request] = {}
        #: those left out while their prompt was predicted late (``prefill_order``), until
        #: their first token tells: in time after all (a prompt ranked ahead was cancelled,
        #: say), they bound the ticks again
        self._predicted_late: dict[int, Request] = {}
        #: the tightest of them for the tick being planned (None: none)
        self._limit: float | None = None

    @property
    def learns_costs(self) -> bool:
        return self.active or self.inner.learns_costs

    def enqueue(self, waiting: deque[Request], requests: Iterable[Request], n_admitted: int) -> None:
        requests = list(requests)
        for request in requests:
            ttft, itl = request.slo
            request.slo = (self.ttft if ttft is None else ttft, self.itl if itl is None else itl)
            if request.slo != (None, None):
                self.active = True
        self.inner.enqueue(waiting, requests, n_admitted)

    # -- order ----------------------------------------------------------------------------

    def prefill_seconds(self) -> Callable[[int], float]:
        """The predicted time to compute ``n`` prompt tokens at full speed (in ``n_batch``
        chunks, each attending the ones before it), as the cost model stands now."""
        model = self.latency.model
        # the model is linear: its coefficients once, then arithmetic
        c0 = model.predict(TickFeatures(0, 0, 0.0))
        c_token = model.predict(TickFeatures(1, 0, 0.0)) - c0
        c_output = model.predict(TickFeatures(0, 1, 0.0)) - c0
        c_cell = model.predict(TickFeatures(0, 0, 1.0)) - c0
        n_batch = self.n_batch

        def seconds(n: int) -> float:
            total = 0.0
            done = 0
            while done < n:
                chunk = min(n_batch, n - done)
                attended = chunk * (done + (chunk + 1) / 2)
                total += max(0.0, c0 + c_token * chunk + c_output + c_cell * attended)
                done += chunk
            return total

        return seconds

    def reorder(self, waiting: deque[Request], now: float) -> None:
        self.inner.reorder(waiting, now)
        if not self.active:
            return
        # stamps of the requests waiting now only: the ones admitted or cancelled drop out
        n_admitted, stamps = self._n_admitted, self._stamps
        self._stamps = {r.arrival: stamps.get(r.arrival, n_admitted) for r in waiting}
        if len(waiting) < 2:
            return
        ranked = self._ranked(list(waiting), now)
        waiting.clear()
        waiting.extend(request for _, request, _ in ranked)

    def _ranked(self, waiting: list[Request], now: float) -> list[tuple[_Key, Request, float]]:
        """``waiting`` in the order of the module, each with its key and predicted prefill
        time; the key's third member is 2 for a request predicted late."""
        levels = priority_levels(waiting, self.aging)
        ranked: list[tuple[_Key, Request, float]] = []
        spans = [(len(r.prompt_tokens) + len(r.output_tokens), r) for r in waiting]
        seconds = self.prefill_seconds()
        estimates = {r.arrival: seconds(n) for n, r in spans}
        overdue = {r.arrival for r in waiting if self._overdue(r)}
        # the overdue go first; then the requests that can meet their TTFT SLO, shortest
        # first, each behind the ones before it; then the late, in arrival order
        queued = sum(estimates[a] for a in overdue)
        for _, request in sorted(spans, key=lambda x: (x[0], x[1].arrival)):
            estimate = estimates[request.arrival]
            if request.arrival in overdue:
                tier = 0
            elif self._late(request, now + queued + estimate):
                tier = 2
            else:
                tier = 1
                queued += estimate
            key = (
                levels[request.priority],
                0 if request.status is RequestStatus.PREEMPTED else 1,
                tier,
                estimate if tier == 1 else float(request.arrival),
                request.arrival,
            )
            ranked.append((key, request, estimate))
        ranked.sort(key=lambda x: x[0])
        return ranked

    def _overdue(self, request: Request) -> bool:
        """Whether ``patience`` admissions passed ``request`` while it waited."""
        return self._n_admitted - self._stamps.get(request.arrival, self._n_admitted) >= self.patience

    def _late(self, request: Request, first_token: float) -> bool:
        """Whether ``request`` misses its TTFT SLO with its first token at ``first_token``
        (or when it came, if it has come)."""
        slo = request.slo[0] if request.slo[0] is not None else self.ttft
        if slo is None:
            return False
        first = request.t_first_token
        return (first_token if first is None else first) - request.t_submitted > slo

    def prefill_order(self, prefilling: Sequence[Prefilling], now: float) -> list[int] | None:
        """The prompts being computed in the order of the waiting ones (see the module): the
        ones that can still meet their TTFT SLO first, fewest tokens left first, then the
        late, in arrival order; each priority apart. A short prompt admitted behind a long
        one no longer waits for all of it. A prompt predicted late in this order no longer
        bounds the ticks with its ITL SLO (see ``_tightest``)."""
        inner = self.inner.prefill_order(prefilling, now)
        if not self.active or inner is not None:
            return inner
        seconds = self.prefill_seconds()
        levels = priority_levels([p.request for p in prefilling], self.aging)
        queued = 0.0
        keyed: list[tuple[tuple[int, int, float, int], int]] = []
        for slot, request, n_pending in sorted(prefilling, key=lambda p: (p.n_pending, p.request.arrival)):
            estimate = seconds(n_pending)
            late = self._late(request, now + queued + estimate)
            if late:  # predicted to miss its TTFT SLO: its ITL no longer bounds the ticks
                if self._running.pop(id(request), None) is not None:
                    self._predicted_late[id(request)] = request
            else:
                queued += estimate
            rank = float(request.arrival) if late else estimate
            keyed.append(((levels[request.priority], int(late), rank, request.arrival), slot))
        keyed.sort()
        return [slot for _, slot in keyed]

    def refusal(self, request: Request, waiting: Iterable[Request], now: float) -> float | None:
        """Whether ``request``, queued now behind ``waiting``, is predicted late for its TTFT
        SLO (``slo_reject``): None if not (or without one), else the seconds the requests
        ranked ahead of it are predicted to take (a ``Retry-After``). The prediction counts
        the waiting prompts and the cost model, not the running ones: it refuses only the
        requests the queue already makes late."""
        if request.slo[0] is None and self.ttft is None:
            return None
        ranked = self._ranked([*waiting, request], now)
        ahead = 0.0
        for key, other, estimate in ranked:
            if other is request:
                return ahead if key[2] == 2 else None
            ahead += estimate
        return None

    # -- admission and the tick -----------------------------------------------------------

    def _tightest(self, extra: float | None = None) -> float | None:
        """The tightest ITL SLO of the running requests that met their TTFT SLO or still can
        (and ``extra``). One that missed it no longer counts as goodput and runs on as a request
        without an SLO, so its ITL no longer slices the others' prefill: under overload late
        1,200-token documents kept every tick under 250 ms for nothing. (A gap over the ITL SLO
        does not drop a request: one tick just over the bound breaks every stream in it, and
        dropping them all then let the next ticks stall the chats for seconds.)"""
        now = time.perf_counter()
        for key, request in list(self._predicted_late.items()):
            if request.t_first_token is not None:  # the prediction is settled
                del self._predicted_late[key]
                if not self._late(request, now):
                    self._running[key] = request
        for key, request in list(self._running.items()):
            if self._late(request, now):
                del self._running[key]
        limits = [r.slo[1] for r in self._running.values() if r.slo[1] is not None]
        if extra is not None:
            limits.append(extra)
        return min(limits) if limits else None

    def _aim_at(self, limit: float) -> None:
        """Set the budget's target to ``limit``, keeping its error margin (aim / target)."""
        latency = self.latency
        ratio = latency.aim / latency.target
        latency.target = limit
        latency.aim = limit * ratio

    def admits(self, request: Request, n_prompt: int, table: SlotTable, busy: list[int]) -> Verdict:
        limit = self._tightest(request.slo[1]) if self.active else None
        if limit is not None and busy:
            self._aim_at(limit)
            if not self.latency.admits(table, busy, n_prompt):
                return Verdict.STOP  # one more stream would break the running streams' ITL SLO
        if self.active and self._keeps_the_last_slot(request, table, len(busy)):
            return Verdict.PASS
        return self.inner.admits(request, n_prompt, table, busy)

    def _keeps_the_last_slot(self, request: Request, table: SlotTable, n_busy: int) -> bool:
        """Whether ``request``, predicted late for its TTFT SLO, is kept out of the last free
        slot (``RESERVE_FROM`` slots and more): that one waits for a request that can still
        meet its SLO. Late requests otherwise filled every slot under overload, and a short
        chat arriving then waited 32 s for one to free (0.5 req/s, 1,200-token documents).
        As requests in time take slots, fewer are left to the late ones; an overdue one
        (``patience``) takes the last slot too, so none waits forever."""
        if table.n_parallel < RESERVE_FROM or table.n_parallel - n_busy > 1:
            return False
        if self._overdue(request):
            return False
        n = len(request.prompt_tokens) + len(request.output_tokens)
        return self._late(request, time.perf_counter() + self.prefill_seconds()(n))

    def admitted(self, request: Request) -> None:
        self._n_admitted += 1
        if request.slo[1] is not None:
            self._running[id(request)] = request
        self.inner.admitted(request)

    def released(self, request: Request) -> None:
        self._running.pop(id(request), None)
        self._predicted_late.pop(id(request), None)
        self.inner.released(request)

    def tick_budget(self, table: SlotTable, busy: list[int], n_batch: int) -> int:
        inner = self.inner.tick_budget(table, busy, n_batch)
        self._limit = limit = self._tightest()
        if limit is None:
            return inner
        self._aim_at(limit)
        return min(self.latency.budget(table, busy), inner)

    def tick_limit(self) -> TickLimit | None:
        if self._limit is None:
            return self.inner.tick_limit()
        return TickLimit(self.latency.model, self.latency.aim)

    def predicted(self) -> float | None:
        return self.latency.predicted if self.active else self.inner.predicted()

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        if self.active:
            self.latency.observe(features, elapsed)
        self.inner.observe(features, elapsed)


def priority_levels(requests: Iterable[Request], aging: int) -> dict[int, int]:
    """Each priority's rank among the others: the aged priority of its longest-waiting
    request. Aging then orders priorities (a low one that waited long passes newer high
    ones), while within one priority the SLO order holds: every request of a priority
    ranks alike, where their own aged priorities would put the later ones a level lower per
    ``aging`` admissions and undo the SLO order (the patience bounds their waits instead)."""
    levels: dict[int, int] = {}
    for request in requests:
        level = aged_priority(request, aging)
        if level < levels.get(request.priority, level + 1):
            levels[request.priority] = level
    return levels


def check_slo(policy: AdmissionPolicy, waiting: Iterable[Request], requests: Sequence[Request]) -> None:
    """``SLOUnmet`` when ``policy`` (or one it wraps) is an :class:`SLOAdmission` that refuses
    late requests (``slo_reject``) and ``requests`` (one prompt's completions), queued behind
    ``waiting``, are predicted to miss their TTFT SLO (:meth:`SLOAdmission.refusal`)."""
    while not isinstance(policy, SLOAdmission):
        if not isinstance(policy, DelegatingAdmission):
            return
        policy = policy.inner
    if not policy.reject or not requests:
        return
    request = requests[0]
    retry_after = policy.refusal(request, waiting, time.perf_counter())
    if retry_after is not None:
        slo = request.slo[0] if request.slo[0] is not None else policy.ttft
        raise SLOUnmet(
            f"the request cannot meet its TTFT SLO of {(slo or 0.0) * 1000:g} ms: the requests ahead "
            f"of it are predicted to take {retry_after * 1000:.0f} ms",
            retry_after,
        )
