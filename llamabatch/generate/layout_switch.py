"""A KV layout that follows the workload: the engine watches what it serves and, when another
layout / flash-attention choice is predicted measurably faster, rebuilds its context with it
at a quiet moment (nothing running or waiting), carrying the cached prefixes over.

llama.cpp cannot change a live context's layout, so a switch is a rebuild: every idle slot's
cached tokens and every host-RAM state are saved (``llama_state_seq_get_data``), the context
is freed and built again with the other layout, and the states are rewritten for it
(``kv_state_format.py``) and loaded back. A switch loses no cached work; it costs the
rebuild (``layout_switch_time_s``: tens of milliseconds for a small model, mostly llama.cpp
allocating and reserving the new context's buffers, plus a copy of each carried state).

What is watched (:class:`WorkloadWatcher`, a telemetry listener): over the last
:data:`WINDOW` requests, the share of their prompt tokens taken from a cached prefix that
another sequence held too (``RequestEvent.shared_tokens``: a request reusing only its own
earlier prompt, a conversation's next turn or the same prompt again, shares nothing), their
prompt lengths, and the mean number of busy slots per tick. What is predicted
(:func:`preferred_layout`), from the measurements in the README ("Memory"):

- a shared prefix (at least :data:`SHARED_SHARE` of the prompt tokens held by other
  sequences too, two or more requests at a time): one unified buffer without flash attention
  (one copy of the prefix, attended by matrix products);
- a long prompt among short ones (one of at least :data:`LONG_PROMPT` tokens, no shared
  prefix): one unified buffer with flash attention (its tiled prompt kernel skips the cells
  a chunk does not see);
- otherwise (independent requests): the load-time default (``kv_memory.choose_layout``).

Hysteresis (:class:`LayoutSwitcher`): the same preference must hold at
:data:`CONFIRM` quiet moments in a row, at least :data:`MIN_REQUESTS_BETWEEN` requests must
have been served since the last switch, and the predicted gain (:data:`PREDICTED_GAIN`)
over the time served since then must exceed the measured cost of a switch
:data:`COST_MARGIN` times over. So a workload alternating faster than that never moves it.

``kv_unified`` or ``flash_attn`` given explicitly pin that choice; nothing switches with
layers on a GPU, ``batch_invariant``, speculative decoding (its draft context), an image
encoder (``mmproj``: bound to its context), LoRA adapters (set on the context), pinned
prefixes (their own sequences) or ``prefix_cache_dir`` (files are written per layout).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llamabatch._core.slots import SlotState
from llamabatch.generate.engine_build import build_engine
from llamabatch.generate.kv_memory import KVPlan, plan_config
from llamabatch.generate.kv_state_format import convert_seq_state
from llamabatch.runtime.telemetry import RequestEvent, TickEvent

if TYPE_CHECKING:
    from llamabatch._ffi.context import Context
    from llamabatch._ffi.model import Model
    from llamabatch.config import EngineConfig
    from llamabatch.generate.core import EngineCore
    from llamabatch.runtime.telemetry import Telemetry

__all__ = [
    "COLLECTED",
    "CONFIRM",
    "EngineHostLike",
    "Layout",
    "LayoutFollower",
    "LayoutSwitcher",
    "SwitchStats",
    "WorkloadSummary",
    "WorkloadWatcher",
    "carry_states",
    "layouts_allowed",
    "preferred_layout",
    "restore_states",
]

logger = logging.getLogger("llamabatch")

#: requests a workload summary covers
WINDOW = 16
#: requests a summary needs before any switch is considered
COLLECTED = 8
#: the share of prompt tokens reused from prefixes other sequences held too that makes a
#: workload "shared"
SHARED_SHARE = 0.5
#: a prompt this long (tokens) among short ones wants flash attention
LONG_PROMPT = 2048
#: quiet moments in a row the same preference must hold
CONFIRM = 2
#: requests served between two switches, at least
MIN_REQUESTS_BETWEEN = 32
#: the predicted speed-up of the preferred layout (README, "Memory": the defaults ran
#: 0.81-0.91x of the best layout on the shared and long-prompt workloads)
PREDICTED_GAIN = 0.10
#: the predicted saving must exceed the measured cost of a switch this many times
COST_MARGIN = 4.0
#: the cost assumed for a switch before one was measured (seconds)
DEFAULT_SWITCH_COST = 0.5


@dataclass(frozen=True)
class Layout:
    """A KV layout: one unified buffer or a stream per sequence, flash attention on or off."""

    kv_unified: bool
    flash_attn: bool

    def __str__(self) -> str:
        layout = "unified" if self.kv_unified else "per-stream"
        return f"{layout}, flash attention {'on' if self.flash_attn else 'off'}"


@dataclass(frozen=True)
class WorkloadSummary:
    """What the last requests looked like (see the module doc)."""

    requests: int
    shared_share: float
    longest_prompt: int
    median_prompt: int
    mean_busy: float


def preferred_layout(
    summary: WorkloadSummary, default: Layout, allowed: frozenset[Layout]
) -> tuple[Layout, str]:
    """The layout predicted fastest for ``summary`` among ``allowed``, and why; ``default``
    when no rule applies or the rule's layout is not allowed."""
    if summary.shared_share >= SHARED_SHARE and summary.mean_busy >= 2:
        choice, reason = Layout(True, False), "shared_prefix"
    elif summary.longest_prompt >= LONG_PROMPT and summary.median_prompt * 4 <= summary.longest_prompt:
        choice, reason = Layout(True, True), "long_prompt"
    else:
        choice, reason = default, "independent"
    if choice not in allowed:
        return default, "independent"
    return choice, reason


def layouts_allowed(asked: EngineConfig, default: Layout, pinned_prefixes: bool = False) -> frozenset[Layout]:
    """The layouts a switch may choose for the user's config ``asked`` (before the load
    resolved it); only ``default`` when something pins the layout (see the module doc)."""
    if (
        asked.n_gpu_layers != 0
        or asked.batch_invariant
        or asked.speculative_config
        or asked.prefix_cache_dir is not None
        or asked.mmproj is not None
        or asked.n_loras
        or not asked.prefix_cache
        or pinned_prefixes
        or asked.type_v not in ("f16", "bf16", "f32")
    ):
        return frozenset({default})
    unified = [asked.kv_unified] if asked.kv_unified is not None else [True, False]
    flash = [asked.flash_attn] if isinstance(asked.flash_attn, bool) else [False, True]
    allowed = {Layout(u, f) for u in unified for f in flash}
    allowed.add(default)
    return frozenset(allowed)


class WorkloadWatcher:
    """A telemetry listener summarising the last :data:`WINDOW` requests."""

    def __init__(self, window: int = WINDOW) -> None:
        self._requests: deque[tuple[int, int]] = deque(maxlen=window)
        self._busy: deque[float] = deque(maxlen=window)
        self._tick_busy = 0
        self._ticks = 0
        #: requests seen since the engine started
        self.total = 0

    def __call__(self, event: object) -> None:
        if isinstance(event, TickEvent):
            self._tick_busy += event.busy_slots
            self._ticks += 1
        elif isinstance(event, RequestEvent):
            self.total += 1
            self._requests.append((event.prompt_tokens, event.shared_tokens))
            if self._ticks:
                self._busy.append(self._tick_busy / self._ticks)
                self._tick_busy = self._ticks = 0

    def summary(self) -> WorkloadSummary:
        requests = list(self._requests)
        prompts = sorted(p for p, _ in requests)
        total = sum(prompts)
        return WorkloadSummary(
            requests=len(requests),
            shared_share=sum(r for _, r in requests) / total if total else 0.0,
            longest_prompt=prompts[-1] if prompts else 0,
            median_prompt=prompts[len(prompts) // 2] if prompts else 0,
            mean_busy=sum(self._busy) / len(self._busy) if self._busy else 0.0,
        )


@dataclass
class SwitchStats:
    """Layout switches so far (``GenerationStats.layout_*``)."""

    switches: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    time_s: float = 0.0
    carried_tokens: int = 0
    lost_tokens: int = 0


class LayoutSwitcher:
    """The hysteresis over :func:`preferred_layout` (see the module doc); ``decide`` is called
    at quiet moments and returns the layout to switch to, with the reason, or None."""

    def __init__(self, current: Layout, default: Layout, allowed: frozenset[Layout]) -> None:
        self.current = current
        self.default = default
        self.allowed = allowed
        self.stats = SwitchStats()
        self._streak: tuple[Layout, int] = (current, 0)
        self._last_switch_request = 0
        self._last_switch_time = time.monotonic()

    def decide(
        self, summary: WorkloadSummary, served: int, now: float | None = None
    ) -> tuple[Layout, str] | None:
        """``served``: requests finished since the engine started."""
        if len(self.allowed) < 2 or summary.requests < COLLECTED:
            return None
        choice, reason = preferred_layout(summary, self.default, self.allowed)
        if choice == self.current:
            self._streak = (choice, 0)
            return None
        streak = self._streak[1] + 1 if self._streak[0] == choice else 1
        self._streak = (choice, streak)
        if streak < CONFIRM or served - self._last_switch_request < MIN_REQUESTS_BETWEEN:
            return None
        now = time.monotonic() if now is None else now
        cost = self.stats.time_s / self.stats.switches if self.stats.switches else DEFAULT_SWITCH_COST
        if PREDICTED_GAIN * (now - self._last_switch_time) < COST_MARGIN * cost:
            return None
        return choice, reason

    def switched(
        self, layout: Layout, reason: str, seconds: float, served: int, now: float | None = None
    ) -> None:
        """Record a switch made (or attempted: ``layout`` is what the context has now)."""
        self.current = layout
        self._streak = (layout, 0)
        self._last_switch_request = served
        self._last_switch_time = time.monotonic() if now is None else now
        stats = self.stats
        stats.switches += 1
        stats.reasons[reason] = stats.reasons.get(reason, 0) + 1
        stats.time_s += seconds


#: a carried state: its tokens, its bytes, whether an idle slot held it (else the RAM tier),
#: and the client it is kept for (``RamEntry.owner``, ``KVCache.owners``)
Carried = tuple[list[int], bytes | bytearray, bool, Hashable]


def carry_states(core: EngineCore) -> list[Carried]:
    """The host-RAM tier's states (least recently used first), then the idle slots' cached
    tokens (least recently used first: the order they are loaded back in)."""
    table, context = core.table, core.context
    carried: list[Carried] = []
    ram = core.kv.ram
    if ram is not None:
        # the base model's only (an engine with adapters never switches; a carried state names
        # no adapter set)
        base = (entry for entry in ram.entries() if entry.tag == ())
        carried.extend((entry.tokens.tolist(), entry.data, False, entry.owner) for entry in base)
    slots = [s for s in range(table.n_parallel) if table.state(s) == SlotState.IDLE and table.seq_len(s)]
    for slot in slots:
        data = context.state_seq_get(slot)
        if data:
            carried.append((table.seq_tokens(slot).tolist(), data, True, core.kv.owners[slot]))
    return carried


def restore_states(core: EngineCore, carried: list[Carried], n_layer: int) -> tuple[int, int]:
    """Load ``carried`` into the new core, each where it was: the slots' states into idle
    slots (the most recent first; one that does not fit goes to the RAM tier), the RAM
    tier's back to it, in their order (so its least recently used go first again). A RAM
    state is not put in a slot the new context has to spare: an idle slot's cells are
    attended by every tick of one unified buffer. Returns ``(tokens carried, tokens lost)``
    (a state that does not convert, fit or load is lost: computed again when asked)."""
    table, context, ram = core.table, core.context, core.kv.ram
    n_stream = 1 if context.kv_unified else context.n_seq_max
    v_trans = not core.config.flash_attn
    carried_tokens = lost = 0
    free_slots = list(range(table.n_parallel))
    overflow: list[tuple[list[int], bytes | None, Hashable]] = []  # slots' states that fit no slot
    for tokens, data, _, owner in reversed([c for c in carried if c[2]]):
        state = convert_seq_state(data, n_stream, v_trans, n_layer)
        fits = len(tokens) <= table.n_ctx_seq and (not table.kv_unified or table.cells_free >= len(tokens))
        if state is not None and free_slots and fits:
            slot = free_slots.pop(0)
            if core.kv.load_state(slot, np.asarray(tokens, dtype=np.int32), state)[0]:
                table.record_cached(slot, tokens)
                table.touch(slot)
                core.kv.owners[slot] = owner
                carried_tokens += len(tokens)
                continue
        overflow.append((tokens, state, owner))
    # converted one at a time, as saved: the RAM tier's states are not held twice at once
    ram_states = (
        (t, convert_seq_state(d, n_stream, v_trans, n_layer), owner)
        for t, d, in_slot, owner in carried
        if not in_slot
    )
    for tokens, state, owner in itertools.chain(ram_states, reversed(overflow)):
        if (
            state is not None
            and ram is not None
            and ram.save(np.asarray(tokens, dtype=np.int32), state, owner=owner)
        ):
            carried_tokens += len(tokens)
        else:
            lost += len(tokens)
    return carried_tokens, lost


class EngineHostLike(Protocol):
    """What a switch reads and replaces of its owner (``llm_engine.EngineHost``)."""

    model: Model
    telemetry: Telemetry
    kv_plan: KVPlan
    config: EngineConfig
    context: Context
    core: EngineCore

    @property
    def n_ctx_seq(self) -> int: ...


class LayoutFollower:
    """What ``EngineHost`` owns for the switch: the watcher (a telemetry listener), the
    hysteresis, and the rebuild at a quiet moment (:meth:`at_quiet`)."""

    def __init__(self, asked: EngineConfig, plan: KVPlan) -> None:
        #: the user's config, before the load resolved what it left open
        self.asked = asked
        default = Layout(plan.kv_unified, bool(plan.flash_attn))
        self.switcher = LayoutSwitcher(default, default, layouts_allowed(asked, default))
        self.watcher = WorkloadWatcher()

    @property
    def enabled(self) -> bool:
        """Whether more than one layout is allowed (else nothing is watched)."""
        return len(self.switcher.allowed) > 1

    def at_quiet(self, host: EngineHostLike) -> bool:
        """Switch ``host``'s context to the preferred layout when the hysteresis allows it
        (call only with nothing running or waiting); True when it switched."""
        if not self.enabled or host.core.has_unfinished() or host.core.kv.pinned:
            return False
        decision = self.switcher.decide(self.watcher.summary(), self.watcher.total)
        if decision is None:
            return False
        layout, reason = decision
        # streams of a given n_ctx are the default's choice (kv_unified=False would divide it)
        kv_unified = None if self.asked.n_ctx is not None and not layout.kv_unified else layout.kv_unified
        config = self.asked.replace(kv_unified=kv_unified, flash_attn=layout.flash_attn)
        plan, config = plan_config(host.model, config)
        streams = 1 if plan.kv_unified else config.n_seq_max
        # requests accepted for the old layout must fit; the default may not give the layout
        if plan.n_ctx // streams < host.n_ctx_seq or plan.kv_unified != layout.kv_unified:
            self.switcher.allowed = self.switcher.allowed - {layout}
            return False
        plan = dataclasses.replace(plan, layout_reason=f"switched for the workload: {reason}")
        self.rebuild(host, plan, config, layout, reason)
        return True

    def rebuild(
        self, host: EngineHostLike, plan: KVPlan, config: EngineConfig, layout: Layout, reason: str
    ) -> None:
        """Save the cached states, free the context, build it with ``config``, load the states
        back (the old config again if the new context cannot be built)."""
        start = time.perf_counter()
        old_core, old_context = host.core, host.context
        carried = carry_states(old_core)
        counters = old_core.counters
        old_core.close()
        old_context.close()
        try:
            context, core = build_engine(host.model, config, host.telemetry)
        except Exception:
            logger.exception("llamabatch: the %s context could not be built; keeping the layout", layout)
            plan, config, layout = host.kv_plan, host.config, self.switcher.current
            context, core = build_engine(host.model, config, host.telemetry)
        core.counters = counters
        host.kv_plan, host.config, host.context, host.core = plan, config, context, core
        kept, lost = restore_states(core, carried, host.model.n_layer)
        seconds = time.perf_counter() - start
        self.switcher.switched(layout, reason, seconds, self.watcher.total)
        self.switcher.stats.carried_tokens += kept
        self.switcher.stats.lost_tokens += lost
        logger.info(
            "llamabatch: KV layout switched to %s (%s) in %.3f s; %d cached tokens carried, %d lost",
            layout,
            reason,
            seconds,
            kept,
            lost,
        )

    def stats(self) -> dict[str, Any]:
        """``GenerationStats``' ``layout_*`` fields."""
        stats = self.switcher.stats
        return {
            "layout_switches": stats.switches,
            "layout_switch_reasons": dict(stats.reasons),
            "layout_switch_time_s": stats.time_s,
            "layout_carried_tokens": stats.carried_tokens,
            "layout_lost_tokens": stats.lost_tokens,
        }
