"""LoRA adapters: which are loaded, and which adapter set each tick decodes.

llama.cpp applies adapters to a whole context (``llama_set_adapters_lora``), not per sequence,
and a change makes it plan its compute graph again on the next decode. So every tick decodes
the slots of ONE adapter set (a request's set is ``SamplingParams.lora``: ``((name, scale),
...)``, ``()`` for the base model):

- :class:`LoraRegistry` holds the adapters by name (each file checked against the model when
  registered, ``gguf/check_lora.py``) and loads them into llama.cpp on demand, at most
  ``max_loras`` at once, least recently used unloaded first, never one a running request uses.
- :class:`LoraAdmission` (an ``AdmissionPolicy`` around the engine's own) loads a request's
  adapters when it is admitted, passes over a request whose set cannot be loaded next to the
  running requests' sets (``max_loras``), and fits the switch cost from measured decodes.
- :class:`AdapterSetStrategy` (a ``Strategy`` around the engine's own) groups the runnable slots
  by set, chooses the set of this tick (:meth:`LoraScheduler.choose`), applies it to the context
  and lets the inner strategy plan that set's slots only.
- :class:`LoraScheduler` chooses by waiting work, age and priority, and the switch cost: a set
  scores ``work * weight(priority) * (1 + age / horizon) / (tick + switch)``, where ``age`` is
  how long its runnable slots have waited since it last ran, ``tick`` the expected decode time
  and ``switch`` the measured extra time of a tick after a change (0 for the set applied now).
  The age term grows without bound, so every set runs again: no request starves. ``work``
  counts each runnable request as ``1 / n``, ``n`` the sets its client (``Request.client``)
  has runnable: a client that spreads its requests over many sets (a scale of its own in
  each, say) gets no more ticks than one that keeps them in one set; with one client (an app
  that names none) every set's work is scaled alike and the choice is unchanged.

KV computed under one set is never given to a request of another: the KV cache keys prefix
reuse and the host-RAM tier on (set, tokens) (``KVCache``'s ``tag``); only the base model's KV
goes to the prefix files.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llamabatch._ffi.lora import LoraAdapter, set_adapters
from llamabatch._ffi.model import Model
from llamabatch.config_checks import parse_lora_arg
from llamabatch.errors import LoraLoadError
from llamabatch.generate.admission import AdmissionPolicy, DelegatingAdmission, Verdict
from llamabatch.generate.cost_model import DecodeCostModel, TickFeatures
from llamabatch.generate.request import Request
from llamabatch.gguf.check_lora import check_lora
from llamabatch.param_values import LORA_NAME_MAX
from llamabatch.params import SamplingParams
from llamabatch.strategies import SubsetView

logger = logging.getLogger("llamabatch")

__all__ = [
    "AdapterSet",
    "AdapterSetStrategy",
    "LoraAdmission",
    "LoraRegistry",
    "LoraScheduler",
    "SwitchCost",
    "install_lora",
    "lora_params",
    "lora_stats",
    "parse_lora_arg",
    "unload_adapter",
]

#: a request's adapter set, as ``SamplingParams.lora`` holds it; ``()``: the base model
AdapterSet = tuple[tuple[str, float], ...]
BASE: AdapterSet = ()
#: the most adapter sets counted apart in ``GenerationStats.lora_requests``
MAX_COUNTED_SETS = 64


class LoraRegistry:
    """The adapters an engine knows by name, and those loaded into llama.cpp (LRU, at most
    ``max_loras``). ``register``/``unregister`` may run on any thread; loading runs on the
    engine's thread."""

    def __init__(self, model: Model, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras!r}")
        self.model = model
        self.max_loras = max_loras
        self._lock = threading.Lock()
        self._paths: dict[str, Path] = {}
        #: loaded adapters, least recently used first
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        #: name -> running requests using it (never unloaded while above 0)
        self.in_use: dict[str, int] = {}
        self.loads = 0
        self.unloads = 0

    def register(self, name: str, path: str | os.PathLike[str]) -> None:
        """Know ``path`` as ``name`` (checked against the model first: ``LoraLoadError`` names
        a wrong file). Registering a name again with another file replaces it for new loads."""
        if not isinstance(name, str) or not 0 < len(name) <= LORA_NAME_MAX or "\0" in name:
            raise ValueError(f"a LoRA adapter's name must be 1 to {LORA_NAME_MAX} characters, got {name!r}")
        resolved = Path(path)
        check_lora(resolved, self.model.path)
        with self._lock:
            self._paths[name] = resolved

    def unregister(self, name: str) -> None:
        """Forget ``name`` (its loaded adapter is freed when no running request uses it)."""
        with self._lock:
            if name not in self._paths:
                raise KeyError(f"no LoRA adapter named {name!r}")
            del self._paths[name]

    def names(self) -> dict[str, Path]:
        """The registered adapters: ``{name: file}``."""
        with self._lock:
            return dict(self._paths)

    def check_set(self, lora: AdapterSet) -> None:
        """``ValueError`` naming an adapter of ``lora`` that is not registered, or a set larger
        than ``max_loras``."""
        known = self.names()
        for name, _ in lora:
            if name not in known:
                listed = ", ".join(sorted(known)) or "none"
                raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {listed})")
        if len(lora) > self.max_loras:
            raise ValueError(
                f"{len(lora)} LoRA adapters in one request, more than max_loras={self.max_loras}"
            )

    def can_load(self, names: Iterable[str]) -> bool:
        """Whether ``names`` fit among the loaded adapters running requests use."""
        needed = set(names)
        busy = {n for n, c in self.in_use.items() if c > 0}
        return len(busy | needed) <= self.max_loras

    def acquire(self, names: Sequence[str]) -> list[LoraAdapter]:
        """The loaded adapters of ``names`` (loading them, unloading the least recently used
        idle ones beyond ``max_loras``). Raises ``LoraLoadError`` or ``KeyError``."""
        out: list[LoraAdapter] = []
        for name in names:
            adapter = self.loaded.get(name)
            if adapter is None or adapter.closed:
                path = self.names().get(name)
                if path is None:
                    raise KeyError(f"no LoRA adapter named {name!r}")
                self._make_room(set(names))
                adapter = LoraAdapter(self.model, path)
                self.loaded[name] = adapter
                self.loads += 1
            self.loaded.move_to_end(name)
            out.append(adapter)
        return out

    def _make_room(self, keep: set[str]) -> None:
        for name in list(self.loaded):
            if len(self.loaded) < self.max_loras:
                return
            if name in keep or self.in_use.get(name, 0) > 0:
                continue
            self.loaded.pop(name).close()
            self.unloads += 1

    def use(self, lora: AdapterSet, delta: int) -> None:
        """Count a running request of ``lora`` in (``+1``) or out (``-1``)."""
        for name, _ in lora:
            n = self.in_use.get(name, 0) + delta
            if n > 0:
                self.in_use[name] = n
            else:
                self.in_use.pop(name, None)

    def release_unregistered(self) -> None:
        """Free loaded adapters no longer registered and unused."""
        known = self.names()
        for name in list(self.loaded):
            if name not in known and self.in_use.get(name, 0) <= 0:
                self.loaded.pop(name).close()
                self.unloads += 1

    def close(self) -> None:
        for adapter in self.loaded.values():
            adapter.close()
        self.loaded.clear()


class SwitchCost:
    """The extra decode time of a tick right after the adapter set changed, fitted online:
    the decodes after no change fit a cost model of the tick (``DecodeCostModel``); a decode
    after a change measures its excess over that model's prediction, bounded (a stalled tick
    says nothing about switches), and the estimate is the median of the last ``window``.
    ``ticks``, fitted on every decode, is what a tick costs as the scheduler sees it (it must
    learn even while every tick switches, or the scheduler would judge ages by a guess)."""

    def __init__(self, window: int = 15, prior: float = 0.002) -> None:
        # measurements are not clipped to the prior's scale: a loaded CPU's ticks are seconds
        self.model = DecodeCostModel(clip=100.0)
        self.ticks = DecodeCostModel(clip=100.0)
        self._excess: deque[float] = deque(maxlen=window)
        #: seconds; the prior until a switch was measured
        self.seconds = prior
        self.n_switches = 0
        self.n_measured = 0

    def observe(self, features: TickFeatures, elapsed: float, switched: bool) -> None:
        if not math.isfinite(elapsed) or elapsed < 0:
            return
        self.ticks.observe(features, elapsed)
        if not switched:
            self.model.observe(features, elapsed)
            return
        if self.model.n_observed < 8:
            return  # no baseline yet
        predicted = self.model.predict(features)
        excess = min(max(0.0, elapsed - predicted), max(2.0 * predicted, 0.05))
        self._excess.append(excess)
        self.n_measured += 1
        self.seconds = statistics.median(self._excess)

    def cost(self) -> float:
        """The switch cost the scheduler weighs: the fitted one once a switch was measured;
        before, at least half a tick, so that sets run for a few ticks each and the ticks
        without a switch, which the measurement needs, occur."""
        if self.n_measured:
            return self.seconds
        return max(self.seconds, 0.5 * self.tick_seconds(1))

    def tick_seconds(self, n_tokens: int) -> float:
        """The expected decode time of ``n_tokens`` tokens (one output each)."""
        return self.ticks.predict(TickFeatures(n_tokens, n_tokens, 0.0))


class LoraScheduler:
    """The adapter set of each tick (see the module): the one applied to the context, and the
    choice among the sets with runnable slots."""

    def __init__(
        self,
        registry: LoraRegistry,
        context: Callable[[], Any],
        running: Callable[[], Sequence[Request | None]],
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.registry = registry
        #: the engine's context now (a rebuilt context starts with no adapters)
        self.context = context
        self._applied_to: Any = None
        self.running = running
        self.clock = clock
        self.current: AdapterSet = BASE
        self.switch = SwitchCost()
        #: set -> when its runnable slots started waiting for a tick of theirs
        self.waiting_since: dict[AdapterSet, float] = {}
        self.switched = False  # the applied set changed since the last decode
        self._ran: AdapterSet | None = None
        self.n_switches = 0
        #: admitted requests by adapter set label (``set_label``)
        self.requests: dict[str, int] = {}
        #: how a set is put on the context (tests pass a fake)
        self.set_on_context: Callable[[Any, list[Any], list[float]], None] = set_adapters

    def key_of(self, slot: int) -> AdapterSet:
        request = self.running()[slot]
        return request.params.lora if request is not None else BASE

    def choose(self, work: Mapping[AdapterSet, Sequence[int]]) -> AdapterSet:
        """The set to decode next among ``work`` (set -> its runnable slots)."""
        now = self.clock()
        if self._ran is not None:  # the set of the last tick waits from the tick's end
            self.waiting_since[self._ran] = now
            self._ran = None
        for key in list(self.waiting_since):
            if key not in work:
                del self.waiting_since[key]
        best, best_score = BASE, -1.0
        tick = max(self.switch.tick_seconds(1), 1e-4)
        switch = self.switch.cost()
        horizon = max(2.0 * switch, 4.0 * tick, 1e-3)
        limit = self.starvation_limit()
        oldest = min(work, key=lambda k: self.waiting_since.setdefault(k, now))
        if now - self.waiting_since[oldest] > limit and oldest != self.current:
            return oldest  # waited past the limit: it runs now, whatever the scores say
        running = self.running()
        requests = {
            key: [r for r in (running[s] for s in slots) if r is not None] for key, slots in work.items()
        }
        n_sets: dict[Any, int] = {}  # each client's sets with runnable requests
        for rs in requests.values():
            for client in {r.client for r in rs}:
                n_sets[client] = n_sets.get(client, 0) + 1
        for key, slots in work.items():
            since = self.waiting_since.setdefault(key, now)
            age = max(0.0, now - since)
            priority = min((r.priority for r in requests[key]), default=0)
            weight = 2.0 ** max(-2, min(2, -priority))
            cost = self.switch.tick_seconds(len(slots)) + (0.0 if key == self.current else switch)
            work_share = sum(1.0 / n_sets[r.client] for r in requests[key]) or float(len(slots))
            score = work_share * weight * (1.0 + age / horizon) / max(cost, 1e-6)
            if score > best_score or (score == best_score and key == self.current):
                best, best_score = key, score
        return best

    def starvation_limit(self) -> float:
        """The longest a set with runnable slots waits for a tick (seconds): 16 ticks with a
        switch each, at least 50 ms."""
        return max(0.05, 16.0 * (self.switch.tick_seconds(1) + self.switch.cost()))

    def ran(self, key: AdapterSet) -> None:
        """``key``'s slots are in this tick: their wait starts again when it ends."""
        self._ran = key

    def apply(self, key: AdapterSet) -> None:
        """Make ``key`` the context's adapter set (a no-op when it is already)."""
        context = self.context()
        if context is not self._applied_to:  # a new context holds no adapters
            self._applied_to, self.current = context, BASE
        if key == self.current:
            return
        adapters = self.registry.acquire([name for name, _ in key])
        self.set_on_context(context, adapters, [scale for _, scale in key])
        self.current = key
        self.switched = True
        self.n_switches += 1
        self.switch.n_switches += 1

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        self.switch.observe(features, elapsed, self.switched)
        self.switched = False

    def count_admission(self, key: AdapterSet) -> None:
        """Count an admitted request of ``key`` (``GenerationStats.lora_requests``)."""
        label = set_label(key)
        if label not in self.requests and len(self.requests) >= MAX_COUNTED_SETS:
            label = "(other)"  # scales are the client's: the labels stay bounded
        self.requests[label] = self.requests.get(label, 0) + 1

    def stats(self) -> dict[str, Any]:
        """``GenerationStats``' ``lora_*`` fields."""
        reg = self.registry
        return {
            "lora_switches": self.n_switches,
            "lora_switch_seconds": self.switch.seconds,
            "lora_switches_measured": self.switch.n_measured,
            "lora_loaded": tuple(reg.loaded),
            "lora_loads": reg.loads,
            "lora_unloads": reg.unloads,
            "lora_requests": dict(self.requests),
        }


def set_label(key: AdapterSet) -> str:
    """``key`` as a metrics label: ``"a"``, ``"a*0.5+b"``; ``"(base)"`` for no adapter."""
    return "+".join(name if scale == 1.0 else f"{name}*{scale:g}" for name, scale in key) or "(base)"


def lora_stats(scheduler: LoraScheduler | None) -> dict[str, Any]:
    """``GenerationStats``' ``lora_*`` fields of ``scheduler`` (empty without LoRA: the defaults)."""
    return scheduler.stats() if scheduler is not None else {}


class AdapterSetStrategy:
    """``inner``'s plan over the runnable slots of one adapter set per tick (see the module)."""

    def __init__(self, inner: Any, scheduler: LoraScheduler) -> None:
        self.inner = inner
        self.scheduler = scheduler
        self.name = f"{getattr(inner, 'name', type(inner).__name__)}+lora"

    def plan(self, view: Any, budget: int, chunk_size: int, queue_depth: int) -> Iterable[tuple[int, int]]:
        scheduler = self.scheduler
        groups: dict[AdapterSet, tuple[list[int], list[int]]] = {}
        for slot in view.decode_slots:
            groups.setdefault(scheduler.key_of(slot), ([], []))[0].append(slot)
        for slot in view.prefill_slots:
            groups.setdefault(scheduler.key_of(slot), ([], []))[1].append(slot)
        if not groups:
            return []
        if len(groups) == 1:
            (key,) = groups
        else:
            key = scheduler.choose({k: d + p for k, (d, p) in groups.items()})
        scheduler.apply(key)
        scheduler.ran(key)
        if len(groups) == 1:
            return self.inner.plan(view, budget, chunk_size, queue_depth)
        decode, prefill = groups[key]
        plan = list(self.inner.plan(SubsetView(view, decode, prefill), budget, chunk_size, queue_depth))
        if not plan:  # never empty: the engine's fallback would mix the sets
            plan = (
                [(decode[0], 1)]
                if decode
                else [(prefill[0], min(view.n_pending(prefill[0]), chunk_size, budget))]
            )
        return plan


class LoraAdmission(DelegatingAdmission):
    """``inner``'s policy; a request's adapters are loaded when it is admitted (one that fails
    to load ends its request through ``on_error`` with a message naming it). A request whose
    set does not fit ``max_loras`` next to the running sets' is passed over (the requests
    behind it start) at most ``patience`` times; then admission stops at it until running
    requests free adapters, so it never waits forever. The switch cost is fitted from every
    measured decode."""

    def __init__(
        self,
        inner: AdmissionPolicy,
        scheduler: LoraScheduler,
        on_error: Callable[[Request, str], None],
        patience: int = 8,
    ) -> None:
        super().__init__(inner)
        self.scheduler = scheduler
        self.on_error = on_error
        self.patience = patience
        #: request arrival -> times passed over for want of adapter room
        self._passed: dict[int, int] = {}

    @property
    def learns_costs(self) -> bool:
        return True

    def admits(self, request: Request, n_prompt: int, table: Any, busy: list[int]) -> Verdict:
        lora = request.params.lora
        if lora:
            registry = self.scheduler.registry
            names = [name for name, _ in lora]
            if not registry.can_load(names):
                n = self._passed.get(request.arrival, 0)
                if n >= self.patience:
                    return Verdict.STOP  # its adapters load once running requests free room
                if len(self._passed) > 4096:  # requests cancelled while passed over
                    self._passed.clear()
                self._passed[request.arrival] = n + 1
                return Verdict.PASS
            try:
                registry.acquire(names)
            except (LoraLoadError, KeyError, OSError) as exc:
                # acquire loads in order and stops at the failing one: the first not loaded
                failing = next((n for n in names if n not in registry.loaded), names[0])
                message = f"LoRA adapter {failing!r} could not be loaded: {exc}"
                logger.error("llamabatch: request %s: %s", request.request_id, message)
                self.on_error(request, message)
                return Verdict.PASS
        return self.inner.admits(request, n_prompt, table, busy)

    def admitted(self, request: Request) -> None:
        self._passed.pop(request.arrival, None)
        self.scheduler.registry.use(request.params.lora, +1)
        self.scheduler.count_admission(request.params.lora)
        self.inner.admitted(request)

    def released(self, request: Request) -> None:
        self.scheduler.registry.use(request.params.lora, -1)
        self.inner.released(request)

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        self.scheduler.observe(features, elapsed)
        self.inner.observe(features, elapsed)


def install_lora(core: Any) -> LoraScheduler | None:
    """Put LoRA scheduling around ``core``'s strategy and admission policy when its config
    allows adapters (``n_loras`` > 0; each of ``lora_adapters`` checked here); None when off."""
    config = core.config
    if not config.n_loras:
        return None
    if config.batch_invariant:
        # ggml rounds an adapter's F32/F16 matrices differently for one row than for several
        raise ValueError("batch_invariant=True does not hold with LoRA adapters: use one or the other")
    registry = LoraRegistry(core.model, config.n_loras)
    for name, path in config.lora_adapters:
        registry.register(name, path)
    scheduler = LoraScheduler(registry, lambda: core.context, lambda: core.running)
    core.strategy = AdapterSetStrategy(core.strategy, scheduler)
    core.admission = LoraAdmission(core.admission, scheduler, core.abort)
    return scheduler


def lora_params(
    scheduler: LoraScheduler | None, params: SamplingParams, speculative_method: str | None
) -> SamplingParams:
    """``params`` checked for the engine's adapters, on the caller's thread: a
    ``LoRARequest``'s file not loaded yet is registered (checked first); an unknown name, or
    adapters on an engine without LoRA, is a ``ValueError``. A draft model has none of the
    target's adapters, so a request with adapters does not speculate with one."""
    if not params.lora and not params.lora_files:
        return params
    if scheduler is None:
        raise ValueError(
            "SamplingParams.lora: this engine has no LoRA adapters "
            "(start it with lora_adapters= or max_loras=)"
        )
    registry = scheduler.registry
    known = registry.names()
    for name, path in params.lora_files.items():
        if name not in known:
            registry.register(name, path)
    registry.check_set(params.lora)
    if params.lora and params.speculative and speculative_method == "draft_model":
        params = dataclasses.replace(params, speculative=False)
    return params


def unload_adapter(core: Any, name: str) -> None:
    """Forget the adapter ``name`` of ``core`` and free it (on the engine thread, between steps).
    ``ValueError`` while an unfinished request uses it; ``KeyError`` for an unknown name."""
    scheduler: LoraScheduler | None = core.lora
    if scheduler is None:
        raise ValueError("this engine has no LoRA adapters")
    users = sum(1 for r in core.requests.values() if any(n == name for n, _ in r.params.lora))
    if users:
        raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
    scheduler.registry.unregister(name)
    if any(n == name for n, _ in scheduler.current):
        scheduler.apply(BASE)
    scheduler.registry.release_unregistered()
