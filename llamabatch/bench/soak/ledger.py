"""The soak's accounting: one ``Life`` per LLM opened, the ``Ledger`` of every completion's end, and
the small synchronisation helpers of the clients (``Holder``, ``Gate``, ``Dispenser``)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamabatch.bench.soak.config import Key

# ---------------------------------------------------------------------------------------------
# Bookkeeping
# ---------------------------------------------------------------------------------------------


@dataclass
class Life:
    """One LLM, from open to close, and what happened to it."""

    index: int
    unified: bool
    drained: bool
    llm: Any = None  # dropped once closed, so that RSS shows what a closed LLM leaves behind
    n_ctx: int | None = None
    closing: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: completions ended (listener) in this life, by finish reason
    ended: Counter[str] = field(default_factory=Counter)
    #: prompts submitted by the clients, and completions (``n`` each; the probes' included)
    prompts: int = 0
    completions: int = 0
    probes: int = 0
    refused: int = 0
    preemptions: int = 0
    evictions: int = 0
    decode_retries: int = 0
    faults_injected: int = 0
    faults_consumed: int = 0
    faults_absorbed: int = 0
    fault_pending: bool = False
    last_fault_end: float = 0.0
    #: an injected fault failed a batch in the current tick (its other requests' errors)
    tick_fault: bool = False
    unexplained_errors: int = 0
    #: completions that ended (first end) in this life exactly once / more than once
    ended_once: int = 0
    ended_more: int = 0
    #: drained lives: the probe after the faults, the KV check, the engine's own count
    probe_ok: bool | None = None
    kv_cells_used: int | None = None
    kv_cells_total: int | None = None
    seq_pos_max: list[int] | None = None
    busy_slots: int | None = None
    engine_requests: int | None = None
    #: the process's RSS once this LLM was closed and dropped
    rss_after_close: int | None = None

    @property
    def layout(self) -> str:
        return "unified" if self.unified else "split"


class Ledger:
    """Every completion's ends (from the listeners) and what callers know of it.

    At a drained close every completion submitted so far must have ended, so :meth:`settle`
    checks the records then and folds them into counts: memory stays bounded by the
    requests of one checkpoint, and the RSS measured is the engine's, not the ledger's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: key -> finish reasons, one per end the listener saw (exactly one expected)
        self.ends: dict[Key, list[str]] = {}
        #: key -> the LLM life it ended in (the first end)
        self.life_of: dict[Key, int] = {}
        #: key -> the finish reason the caller got (None: the caller stopped listening)
        self.known: dict[Key, str | None] = {}
        #: completions submitted whose ids no caller learnt (a task cancelled early)
        self.anonymous = 0
        # what settle() folded so far
        self.n_ends = 0
        self.n_known = 0
        self.n_anonymous = 0
        self.n_twice = 0
        self.n_never = 0
        self.n_mismatch = 0
        self.refused_queue_full = 0
        self.violations: list[str] = []
        self.modes: Counter[str] = Counter()
        #: operation id -> (thread, mode, life, start time, request id or None): in flight
        self.in_flight: dict[int, list[Any]] = {}
        self._op_ids = itertools.count()

    def end(self, key: Key, reason: str, life: int) -> None:
        with self.lock:
            self.ends.setdefault(key, []).append(reason)
            self.life_of.setdefault(key, life)
            self.n_ends += 1

    def settle(self, lives: Sequence[Life], where: str) -> None:
        """Check every record so far (all must have ended) and fold it into counts."""
        with self.lock:
            ends, known, life_of, anonymous = self.ends, self.known, self.life_of, self.anonymous
            self.ends, self.known, self.life_of, self.anonymous = {}, {}, {}, 0
        by_index = {life.index: life for life in lives}
        twice = {k: v for k, v in ends.items() if len(v) > 1}
        for key, reasons in ends.items():
            life = by_index.get(life_of[key])
            if life is not None:
                if len(reasons) == 1:
                    life.ended_once += 1
                else:
                    life.ended_more += 1
        never = [k for k in known if k not in ends]
        mismatch = {
            k: (r, ends[k][0]) for k, r in known.items() if r is not None and k in ends and ends[k][0] != r
        }
        unclaimed = len(ends) - (len(known) - len(never))
        found = []
        if twice:
            found.append(f"{len(twice)} completions ended more than once, e.g. {sample(twice)}")
        if never:
            found.append(f"{len(never)} completions had not ended by {where}, e.g. {never[:5]}")
        if mismatch:
            found.append(
                f"{len(mismatch)} callers got another finish reason than the engine's "
                f"(caller, engine), e.g. {sample(mismatch)}"
            )
        if unclaimed != anonymous:
            found.append(
                f"by {where}: {anonymous} completions were submitted with ids no caller learnt, "
                f"but {unclaimed} ends were claimed by no caller"
            )
        with self.lock:
            self.n_known += len(known)
            self.n_anonymous += anonymous
            self.n_twice += len(twice)
            self.n_never += len(never)
            self.n_mismatch += len(mismatch)
            self.violations += found

    def learn(self, key: Key, reason: str | None) -> None:
        with self.lock:
            previous = self.known.get(key)
            if key in self.known and previous is not None and reason is not None and previous != reason:
                self.violations.append(f"completion {key} reported twice: {previous!r} then {reason!r}")
            if previous is None:
                self.known[key] = reason

    def violation(self, message: str) -> None:
        with self.lock:
            self.violations.append(message)

    def begin(self, mode: str, life: Life) -> int:
        op = next(self._op_ids)
        with self.lock:
            self.modes[mode] += 1
            self.in_flight[op] = [threading.current_thread().name, mode, life.index, time.monotonic(), None]
        return op

    def note_id(self, op: int, request_id: Any) -> None:
        with self.lock:
            if op in self.in_flight:
                self.in_flight[op][4] = request_id

    def finish(self, op: int) -> None:
        with self.lock:
            self.in_flight.pop(op, None)

    def stuck(self) -> list[str]:
        """The operations still in flight, for a hang report."""
        now = time.monotonic()
        with self.lock:
            return [
                f"{thread}: {mode} on LLM #{life}, request {rid}, {now - t0:.1f} s"
                for thread, mode, life, t0, rid in self.in_flight.values()
            ]


class Holder:
    """The LLM clients use now; clients wait here while it is being replaced."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._life: Life | None = None
        self.stopped = False

    def publish(self, life: Life | None) -> None:
        with self._cond:
            self._life = life
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def current(self) -> Life | None:
        return self._life

    def wait_open(self, timeout: float) -> Life | None:
        """The current life once it is open (None: stopped, or none within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.stopped:
                life = self._life
                if life is not None and not life.closing:
                    return life
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
        return None


class Gate:
    """Lets the controller pause the clients between requests and wait until none is in
    the middle of one (a drained close)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.paused = False
        self.stopped = False
        self.active = 0

    def enter(self, timeout: float) -> bool:
        """Block while paused; False when stopped (or paused longer than ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.paused and not self.stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if self.stopped:
                return False
            self.active += 1
            return True

    def try_enter(self) -> bool | None:
        """For asyncio tasks: True when entered, False while paused, None when stopped."""
        with self._cond:
            if self.stopped:
                return None
            if self.paused:
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self.active -= 1
            self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self.paused = True

    def resume(self) -> None:
        with self._cond:
            self.paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


class Dispenser:
    """Hands out request numbers ``0 .. total-1`` to the clients."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.taken = 0
        self._lock = threading.Lock()
        self.on_take: Callable[[int], None] | None = None

    def take(self, k: int = 1) -> int:
        """Up to ``k`` request numbers; how many were granted (0: all handed out)."""
        with self._lock:
            k = min(k, self.total - self.taken)
            self.taken += k
        if k and self.on_take is not None:
            self.on_take(k)
        return k

    def exhaust(self) -> None:
        with self._lock:
            self.taken = self.total


def sample(d: dict[Any, Any], n: int = 3) -> str:
    return ", ".join(f"{k}: {v}" for k, v in itertools.islice(d.items(), n))
