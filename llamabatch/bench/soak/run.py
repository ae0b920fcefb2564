"""``llamabatch bench-soak``: many mixed requests from many threads, with random
cancellations, ``close()``/reopen cycles and injected decode faults, checking that no
request is lost, none ends twice, and nothing is left behind.

This is a soak benchmark, not a unit test. ``N`` requests (prompts) go through one
:class:`llamabatch.LLM` at a time from ``T`` client threads: ``T - 1`` blocking threads
(``submit`` + ``result``, iterating a handle, ``generate`` of one to three prompts,
``stream``) and one thread running an asyncio loop (``agenerate``, ``astream``). Requests
mix prompt lengths, ``max_tokens``, greedy and sampled decoding, seeds, ``n > 1``, stop
strings, grammars, log-probabilities and penalties. Some are cancelled: ``handle.cancel()``,
a stream closed early, an asyncio task cancelled.

Every ``close_every`` requests the LLM is closed and a new one opened, alternating the two
KV layouts: ``kv_unified=True`` with a tight ``n_ctx`` (admission control and preemption
at work) and ``kv_unified=False`` (one stream per sequence). Half of the closes are abrupt
(requests in flight end ``"cancelled"``; submissions racing the close get ``EngineClosed``
and count as refused, not lost); the others are *drained*: the clients pause, every
request ends, one probe request must still complete normally (the engine serves after its
faults), then the prefix cache is cleared and the KV cache must be empty
(``stats().kv_cells_used == 0`` and ``seq_pos_max(seq) == -1`` for every sequence). The
last LLM's life is always drained.

A fault injector calls ``llm.context.abort()`` at random moments: the running (or next)
``llama_decode`` returns 2, and the engine must end that batch's requests with
``finish_reason="error"`` and keep serving. One fault is pending at a time, so each is
accounted for: consumed by a failed batch, or absorbed by a close.

Accounting: a ``RequestEvent`` listener on every LLM counts the ends of every completion
(request id, index); the callers record what they got. Every completion whose id a caller
learnt must end exactly once, with the finish reason the caller saw; the completions no
caller could name (a task cancelled before its first delta) must match, in number, the
ends nobody claimed. Waits have timeouts: a request that never ends is reported, never
waited for forever.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import math
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamabatch.bench import options
from llamabatch.bench.memory import current_rss
from llamabatch.bench.report import Column, Report
from llamabatch.errors import EngineClosed, QueueFull

__all__ = ["SoakConfig", "SoakResult", "add_arguments", "main", "run_soak", "soak_report"]

#: The longest prompt + ``max_tokens`` a soak request holds (tokens).
MAX_SEQ_TOKENS = 128
_MAX_PROMPT = 96
_MAX_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24)
_LONG_MAX_TOKENS = (32, 48, 64, 96)
_REASONS = ("stop", "length", "cancelled", "error")
_GRAMMAR = 'root ::= [a-z]+ (" " [a-z]+)*'
_MB = 1024 * 1024

Key = tuple[Any, int]  # (request id, completion index)


@dataclass(frozen=True)
class SoakConfig:
    """What a soak run does (the ``llamabatch bench-soak`` options)."""

    #: a GGUF path or a test-model preset name
    model: str = "tiny"
    #: prompts to submit in all
    requests: int = 10_000
    #: client threads (one of them runs an asyncio loop when there are two or more)
    threads: int = 8
    #: concurrent tasks in the asyncio thread
    async_tasks: int = 4
    #: requests per LLM life: a close()/reopen every this many
    close_every: int = 500
    #: share of requests cancelled (by their caller, in one of the ways above)
    cancel_rate: float = 0.15
    #: injected decode faults per request (0: none): 0.02 is one fault every 50 requests
    fault_rate: float = 0.02
    #: slots per LLM
    n_parallel: int = 8
    #: cells of the unified KV cache (tight: preemption happens); the split layout gets
    #: ``n_parallel * MAX_SEQ_TOKENS``
    unified_n_ctx: int = 2 * MAX_SEQ_TOKENS
    #: llama.cpp CPU threads (None: all cores); the tiny model's decodes are too small to
    #: split, and on a busy machine a second thread mostly waits at llama.cpp's barriers
    n_threads: int | None = 1
    #: seconds a request, a drain, a close or any progress may take before it is a failure
    timeout: float = 60.0
    #: fail when RSS grows more than this share between warm-up and the end (None: report only)
    max_rss_growth: float | None = None
    seed: int = 0
    #: a tqdm bar on stderr (on a terminal)
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("requests", "threads", "async_tasks", "close_every", "n_parallel", "unified_n_ctx"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SoakConfig.{name} must be an int >= 1, got {value!r}")
        if not 0.0 <= self.cancel_rate <= 1.0:
            raise ValueError(f"SoakConfig.cancel_rate must be in [0, 1], got {self.cancel_rate!r}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"SoakConfig.fault_rate must be in [0, 1], got {self.fault_rate!r}")
        if not self.timeout > 0:
            raise ValueError(f"SoakConfig.timeout must be > 0, got {self.timeout!r}")
        if self.unified_n_ctx < MAX_SEQ_TOKENS:
            raise ValueError(
                f"SoakConfig.unified_n_ctx must be >= {MAX_SEQ_TOKENS}, got {self.unified_n_ctx}"
            )


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
            found.append(f"{len(twice)} completions ended more than once, e.g. {_sample(twice)}")
        if never:
            found.append(f"{len(never)} completions had not ended by {where}, e.g. {never[:5]}")
        if mismatch:
            found.append(
                f"{len(mismatch)} callers got another finish reason than the engine's "
                f"(caller, engine), e.g. {_sample(mismatch)}"
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


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class Workload:
    """Prompts (text and token ids, mixed lengths) and sampling parameters, drawn at random."""

    def __init__(self, model_path: str) -> None:
        from llamabatch import Model
        from llamabatch.gguf.testing import english_sentences

        model = Model(model_path)
        try:
            sentences = english_sentences(400)
            #: (text, its token count), short enough to be a prompt
            self.texts: list[tuple[str, int]] = []
            self.tokens: list[int] = []
            for text in sentences:
                ids = model.tokenize(text, add_special=True, parse_special=True)
                if len(ids) <= _MAX_PROMPT:
                    self.texts.append((text, len(ids)))
                self.tokens += model.tokenize(" " + text, add_special=False)
            self.bos = model.bos
        finally:
            model.close()
        if not self.texts or len(self.tokens) < 4 * _MAX_PROMPT:
            raise ValueError(f"{model_path}: its vocabulary gives too few prompt tokens for a soak")

    def prompt(self, rng: random.Random, max_tokens: int) -> Any:
        """A text or token-id prompt that leaves room for ``max_tokens`` in ``MAX_SEQ_TOKENS``."""
        room = min(_MAX_PROMPT, MAX_SEQ_TOKENS - max_tokens)
        if rng.random() < 0.4:
            text, n = rng.choice(self.texts)
            if n <= room:
                return text
        r = rng.random()
        length = rng.randint(1, 16) if r < 0.7 else rng.randint(17, 48) if r < 0.95 else rng.randint(49, 95)
        length = min(length, room - 1)  # + BOS
        start = rng.randrange(len(self.tokens) - length)
        return [self.bos, *self.tokens[start : start + length]]

    @staticmethod
    def params(rng: random.Random) -> Any:
        from llamabatch import SamplingParams

        kw: dict[str, Any] = {
            # a few long generations fill a tight unified KV cache: preemption
            "max_tokens": rng.choice(_MAX_TOKENS) if rng.random() < 0.9 else rng.choice(_LONG_MAX_TOKENS),
            "ignore_eos": rng.random() < 0.5,
        }
        if rng.random() < 0.4:
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=rng.uniform(0.5, 1.2), top_k=rng.choice([0, 20, 40]), top_p=0.95)
            if rng.random() < 0.6:
                kw["seed"] = rng.randrange(2**31)
        r = rng.random()
        if r < 0.06:
            kw["n"] = 3
        elif r < 0.15:
            kw["n"] = 2
        if rng.random() < 0.1:
            kw["stop"] = [rng.choice(["e", "th", "s ", "\n", "a"])]
        if rng.random() < 0.04:
            kw["grammar"] = _GRAMMAR
        if rng.random() < 0.05:
            kw["logprobs"] = 2
        if rng.random() < 0.05:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        if rng.random() < 0.1:
            kw["repeat_penalty"] = 1.1
        return SamplingParams(**kw)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    """What a soak run found; :attr:`violations` is empty when every invariant held."""

    config: SoakConfig
    model: str
    lives: list[Life]
    ledger: Ledger
    wall_s: float
    prompts_attempted: int
    rss_start: int | None
    rss_end: int | None
    rss_peak: int
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def total(self) -> dict[str, Any]:
        """The whole run as one flat, JSON-ready dict."""
        ledger = self.ledger
        reasons: Counter[str] = Counter()
        for life in self.lives:
            reasons.update(life.ended)
        once = sum(life.ended_once for life in self.lives)
        prompts = sum(life.prompts for life in self.lives)
        refused = sum(life.refused for life in self.lives)
        completions = sum(life.completions for life in self.lives)
        final = self.lives[-1] if self.lives else None
        growth = None if self.rss_start is None or self.rss_end is None else self.rss_end - self.rss_start
        closes = [life.rss_after_close for life in self.lives if life.rss_after_close]
        row: dict[str, Any] = {
            "layout": "all",
            "lives": len(self.lives),
            "closes": sum(1 for life in self.lives if life.closing),
            "drained_closes": sum(1 for life in self.lives if life.closing and life.drained),
            "prompts_attempted": self.prompts_attempted,
            "prompts_submitted": prompts,
            "refused": refused,
            "refused_queue_full": self.ledger.refused_queue_full,
            "completions_submitted": completions,
            "probes": sum(life.probes for life in self.lives),
            "completions_ended": ledger.n_ends,
            **{f"ended_{r}": reasons.get(r, 0) for r in _REASONS},
            "ended_exactly_once": once,
            "ended_more_than_once": ledger.n_twice,
            "never_ended": ledger.n_never,
            "finish_reason_mismatches": ledger.n_mismatch,
            "exactly_once_violations": completions - once,
            "anonymous_completions": ledger.n_anonymous,
            "preemptions": sum(life.preemptions for life in self.lives),
            "evictions": sum(life.evictions for life in self.lives),
            "decode_retries": sum(life.decode_retries for life in self.lives),
            "faults_injected": sum(life.faults_injected for life in self.lives),
            "faults_consumed": sum(life.faults_consumed for life in self.lives),
            "faults_absorbed_by_close": sum(life.faults_absorbed for life in self.lives),
            "unexplained_errors": sum(life.unexplained_errors for life in self.lives),
            "kv_cells_used_end": final.kv_cells_used if final is not None else None,
            "seq_pos_max_end": max(final.seq_pos_max) if final is not None and final.seq_pos_max else None,
            "rss_start_mb": None if self.rss_start is None else self.rss_start / _MB,
            "rss_end_mb": None if self.rss_end is None else self.rss_end / _MB,
            "rss_peak_mb": self.rss_peak / _MB,
            "rss_after_each_close_mb": [round(r / _MB, 1) for r in closes],
            # a leak grows on; allocator warm-up levels off: the second half tells them apart
            "rss_growth_second_half_mb": (closes[-1] - closes[len(closes) // 2]) / _MB
            if len(closes) >= 4
            else None,
            "rss_growth_mb": None if growth is None else growth / _MB,
            "rss_growth_pct": None if growth is None else 100.0 * growth / max(self.rss_start or 1, 1),
            "wall_s": self.wall_s,
            "requests_per_s": self.prompts_attempted / self.wall_s if self.wall_s > 0 else math.nan,
            "completions_per_s": completions / self.wall_s if self.wall_s > 0 else math.nan,
            "modes": dict(sorted(self.ledger.modes.items())),
            "violations": len(self.violations),
        }
        return row

    def layout_rows(self) -> list[dict[str, Any]]:
        """One row per KV layout."""
        rows = []
        for unified in (True, False):
            lives = [life for life in self.lives if life.unified == unified]
            if not lives:
                continue
            reasons: Counter[str] = Counter()
            for life in lives:
                reasons.update(life.ended)
            n_ctx = lives[0].n_ctx
            rows.append(
                {
                    "layout": f"{lives[0].layout} (n_ctx {n_ctx})",
                    "lives": len(lives),
                    "prompts_submitted": sum(life.prompts for life in lives),
                    "refused": sum(life.refused for life in lives),
                    "completions_submitted": sum(life.completions for life in lives),
                    **{f"ended_{r}": reasons.get(r, 0) for r in _REASONS},
                    "ended_exactly_once": sum(life.ended_once for life in lives),
                    "preemptions": sum(life.preemptions for life in lives),
                    "faults_injected": sum(life.faults_injected for life in lives),
                    "faults_consumed": sum(life.faults_consumed for life in lives),
                }
            )
        return rows


def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak described by ``config`` and check its invariants (see the module doc)."""
    from llamabatch.bench.workloads import resolve_model

    path = str(resolve_model(config.model))
    return _Soak(config, path).run()


class _Soak:
    def __init__(self, config: SoakConfig, path: str) -> None:
        self.config = config
        self.path = path
        self.workload = Workload(path)
        self.ledger = Ledger()
        self.holder = Holder()
        self.gate = Gate()
        self.dispenser = Dispenser(config.requests)
        self.lives: list[Life] = []
        self.stop = threading.Event()
        self.rss_peak = 0

    # -- the controller (the calling thread) -------------------------------------------------

    def run(self) -> SoakResult:
        cfg = self.config
        n_lives = max(1, math.ceil(cfg.requests / cfg.close_every))
        bar = _bar(cfg.requests, cfg.progress)
        if bar is not None:
            self.dispenser.on_take = bar.update
        clients = self._start_clients()
        injector = threading.Thread(target=self._inject_faults, name="soak-faults", daemon=True)
        if cfg.fault_rate > 0:
            injector.start()
        rss_start: int | None = None
        t0 = time.perf_counter()
        try:
            for index in range(n_lives):
                last = index == n_lives - 1
                # unified / split alternate; abrupt and drained closes cover both layouts
                life = Life(index, unified=index % 2 == 0, drained=last or index % 4 in (1, 2))
                if not self._open(life):
                    break
                self.lives.append(life)
                self.holder.publish(life)
                self.gate.resume()
                if last:
                    ok = self._join(clients)
                elif not self._wait_taken(min(cfg.requests, (index + 1) * cfg.close_every)):
                    ok = False
                elif life.drained:
                    self.gate.pause()
                    ok = self.gate.wait_idle(cfg.timeout)
                    if not ok:
                        self._hang(f"requests did not end within {cfg.timeout} s of a drain")
                else:
                    ok = True
                if ok and life.drained:
                    self.gate.pause()  # no new requests, no new faults
                    self._probe_and_check(life)
                    # every request so far has ended (earlier LLMs are closed, this one drained)
                    self.ledger.settle(self.lives, f"the drained close of LLM #{index}")
                self._close(life)
                if not ok:
                    break
                if index == 0 and n_lives > 1:
                    gc.collect()
                    rss_start = current_rss()
        finally:
            wall = time.perf_counter() - t0
            self.stop.set()
            self.gate.stop()
            self.holder.stop()
            self.dispenser.exhaust()
            for life in self.lives:
                if not life.closing:
                    self._close(life)
            if bar is not None:
                bar.close()
        if cfg.fault_rate > 0:
            injector.join(5.0)
        for thread in clients:
            thread.join(min(5.0, cfg.timeout))
        self.ledger.settle(self.lives, "the end")
        gc.collect()
        rss_end = current_rss()
        self.rss_peak = max(self.rss_peak, rss_end)
        result = SoakResult(
            cfg,
            self.path,
            self.lives,
            self.ledger,
            wall,
            self.dispenser.taken,
            rss_start,
            rss_end if rss_start is not None else None,
            self.rss_peak,
            [],
        )
        result.violations = _check(result)
        return result

    def _open(self, life: Life) -> bool:
        from llamabatch import LLM

        cfg = self.config
        n_ctx = cfg.unified_n_ctx if life.unified else cfg.n_parallel * MAX_SEQ_TOKENS
        try:
            life.llm = LLM(
                self.path,
                n_ctx=n_ctx,
                n_parallel=cfg.n_parallel,
                n_batch=512,
                n_threads=cfg.n_threads,
                kv_unified=life.unified,
            )
        except Exception as exc:
            self.ledger.violation(f"LLM #{life.index} ({life.layout}) did not open: {exc!r}")
            return False
        life.n_ctx = life.llm.n_ctx
        life.llm.add_listener(self._listener(life))
        return True

    def _listener(self, life: Life) -> Callable[[Any], None]:
        from llamabatch import RequestEvent, TickEvent

        ledger = self.ledger

        def listener(event: Any) -> None:
            if isinstance(event, RequestEvent):
                ledger.end((event.request_id, event.index), event.finish_reason, life.index)
                with life.lock:
                    life.ended[event.finish_reason] += 1
                    if event.finish_reason == "error":
                        if life.fault_pending:
                            life.fault_pending = False
                            life.faults_consumed += 1
                            life.tick_fault = True
                            life.last_fault_end = time.monotonic()
                        elif not life.tick_fault:
                            life.unexplained_errors += 1
            elif isinstance(event, TickEvent):
                with life.lock:
                    life.preemptions += event.preemptions
                    life.tick_fault = False

        return listener

    def _wait_taken(self, boundary: int) -> bool:
        """Wait until ``boundary`` requests were handed out; False (a hang) when none is
        handed out for ``timeout`` seconds."""
        last, since = self.dispenser.taken, time.monotonic()
        while self.dispenser.taken < boundary:
            time.sleep(0.005)
            taken = self.dispenser.taken
            if taken != last:
                last, since = taken, time.monotonic()
            elif time.monotonic() - since > self.config.timeout:
                self._hang(f"no request was submitted for {self.config.timeout} s")
                return False
        return True

    def _join(self, clients: list[threading.Thread]) -> bool:
        """Wait for the clients to run out of requests (the last life)."""
        deadline = time.monotonic() + self.config.timeout
        last = self.dispenser.taken
        for thread in clients:
            while thread.is_alive():
                thread.join(0.05)
                if self.dispenser.taken != last:  # still progressing: extend the deadline
                    last = self.dispenser.taken
                    deadline = time.monotonic() + self.config.timeout
                if time.monotonic() > deadline:
                    self._hang(f"clients did not finish within {self.config.timeout} s of the last request")
                    return False
        return True

    def _hang(self, what: str) -> None:
        stuck = self.ledger.stuck()
        self.ledger.violation(f"hang: {what}; in flight: {stuck or 'nothing'}")

    def _probe_and_check(self, life: Life) -> None:
        """After a drain: one request must still complete normally (the engine serves after
        its faults; a pending fault may fail the first try), then the KV cache must be empty."""
        from llamabatch import SamplingParams

        cfg = self.config
        llm = life.llm
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        life.probe_ok = False
        for _ in range(3):
            try:
                out = llm.submit([self.workload.bos, 5, 6, 7], params).result(cfg.timeout).outputs[0]
            except Exception as exc:
                self.ledger.violation(f"LLM #{life.index}: the probe request failed: {exc!r}")
                return
            self.ledger.learn((out.request_id, out.index), out.finish_reason)
            with life.lock:
                life.probes += 1
                life.completions += 1
            if out.finish_reason == "length":
                life.probe_ok = True
                break
            if out.finish_reason != "error":
                break
        try:
            llm.clear_prefix_cache()
            stats = llm.stats()
            context = llm.context
            life.seq_pos_max = llm.call(
                lambda: [context.seq_pos_max(s) for s in range(context.n_seq_max)], cfg.timeout
            )
        except Exception as exc:
            self.ledger.violation(f"LLM #{life.index}: the KV check failed: {exc!r}")
            return
        life.kv_cells_used = stats.kv_cells_used
        life.kv_cells_total = stats.kv_cells_total
        life.busy_slots = stats.busy_slots
        life.engine_requests = stats.requests

    def _close(self, life: Life) -> None:
        llm = life.llm
        with life.lock:
            life.closing = True
        if llm is None:
            return
        try:
            stats = llm.stats()
            life.evictions, life.decode_retries = stats.evictions, stats.decode_retries
        except Exception:
            pass
        t0 = time.monotonic()
        try:
            llm.close(timeout=self.config.timeout)
        except Exception as exc:
            self.ledger.violation(f"LLM #{life.index}: close() raised {exc!r}")
        if llm._thread.is_alive():
            self.ledger.violation(
                f"LLM #{life.index}: close() did not finish within {time.monotonic() - t0:.1f} s"
            )
        with life.lock:
            if life.fault_pending:
                life.fault_pending = False
                life.faults_absorbed += 1
            life.llm = None  # a client still holding this life finds it closed (EngineClosed)
        del llm
        gc.collect()
        life.rss_after_close = current_rss()
        self.rss_peak = max(self.rss_peak, life.rss_after_close)

    # -- the fault injector ------------------------------------------------------------------

    def _inject_faults(self) -> None:
        """Keep the faults injected at ``fault_rate`` per request handed out, each at a random
        moment (a decode running or not), one pending at a time."""
        rng = random.Random(self.config.seed * 7919 + 1)
        injected = 0
        while not self.stop.wait(rng.uniform(0.001, 0.02)):
            life = self.holder.current()
            if life is None or self.gate.paused or injected >= self.dispenser.taken * self.config.fault_rate:
                continue
            with life.lock:
                # one fault at a time, and not among the last one's error events
                llm = life.llm
                if (
                    llm is None
                    or life.closing
                    or life.fault_pending
                    or time.monotonic() - life.last_fault_end < 0.02
                ):
                    continue
                life.fault_pending = True
                life.faults_injected += 1
            injected += 1
            llm.context.abort()  # the running or next llama_decode returns 2

    # -- the clients ---------------------------------------------------------------------------

    def _start_clients(self) -> list[threading.Thread]:
        cfg = self.config
        n_sync = cfg.threads - 1 if cfg.threads > 1 else 1
        threads = [
            threading.Thread(target=self._client, args=(i,), name=f"soak-client-{i}", daemon=True)
            for i in range(n_sync)
        ]
        if cfg.threads > 1:
            threads.append(threading.Thread(target=self._async_client, name="soak-asyncio", daemon=True))
        for thread in threads:
            thread.start()
        return threads

    def _client(self, worker: int) -> None:
        rng = random.Random(self.config.seed * 1000 + worker)
        timeout = self.config.timeout
        while not self.stop.is_set():
            life = self.holder.wait_open(timeout)
            if life is None:
                if not self.stop.is_set() and not self.holder.stopped:
                    continue
                return
            if not self.gate.enter(timeout):
                if self.gate.stopped:
                    return
                continue
            try:
                mode = rng.choice(("submit", "submit", "iterate", "generate", "stream"))
                k = self.dispenser.take(rng.randint(1, 3) if mode == "generate" else 1)
                if not k:
                    return
                op = self.ledger.begin(mode, life)
                try:
                    self._run_sync(mode, k, life, rng, op)
                except EngineClosed:
                    with life.lock:
                        life.refused += k
                except QueueFull:
                    with self.ledger.lock:
                        self.ledger.refused_queue_full += k
                except Exception as exc:
                    self.ledger.violation(
                        f"{mode} on LLM #{life.index} raised {exc!r}\n{traceback.format_exc(limit=6)}"
                    )
                finally:
                    self.ledger.finish(op)
            finally:
                self.gate.leave()

    def _submitted(self, life: Life, prompts: int, completions: int) -> None:
        with life.lock:
            life.prompts += prompts
            life.completions += completions

    def _run_sync(self, mode: str, k: int, life: Life, rng: random.Random, op: int) -> None:
        llm = life.llm
        if llm is None:
            raise EngineClosed("the LLM was closed and dropped")
        cfg = self.config
        ledger = self.ledger
        cancel = rng.random() < cfg.cancel_rate
        if mode == "generate":
            one = rng.random() < 0.5  # one SamplingParams for all prompts, or one each
            per = [self.workload.params(rng)] * k if one else [self.workload.params(rng) for _ in range(k)]
            params = per[0] if one else per
            prompts = [self.workload.prompt(rng, p.max_tokens) for p in per]
            outs = llm.generate(prompts, params, use_tqdm=False)
            self._submitted(life, k, sum(p.n for p in per))
            for out in outs:
                for o in out.outputs:
                    ledger.learn((o.request_id, o.index), o.finish_reason)
            return
        params = self.workload.params(rng)
        prompt = self.workload.prompt(rng, params.max_tokens)
        if mode == "stream":
            gen = llm.stream(prompt, params)
            rid, finals, seen = None, {}, 0
            stop_after = rng.randint(0, 3) if cancel else -1
            try:
                for delta in gen:
                    if rid is None:
                        rid = delta.request_id
                        self._submitted(life, 1, params.n)
                        ledger.note_id(op, rid)
                    if delta.finish_reason is not None:
                        finals[delta.index] = delta.finish_reason
                    seen += 1
                    if seen > stop_after >= 0:
                        break  # closing the stream early cancels the request
            finally:
                gen.close()
            if rid is None:
                raise AssertionError("a stream ended without any delta")
            for i in range(params.n):
                ledger.learn((rid, i), finals.get(i))
            return
        handle = llm.submit(prompt, params)
        self._submitted(life, 1, params.n)
        rid = handle.request_id
        ledger.note_id(op, rid)
        if mode == "iterate":
            finals = {}
            stop_after = rng.randint(0, 4) if cancel else -1
            if stop_after == 0:
                handle.cancel()
            seen = 0
            for delta in handle:  # reads on after a cancel: the ends arrive as "cancelled"
                seen += 1
                if seen == stop_after:
                    handle.cancel()
                if delta.finish_reason is not None:
                    finals[delta.index] = delta.finish_reason
            for i in range(params.n):
                ledger.learn((rid, i), finals.get(i))
            return
        if cancel:
            time.sleep(rng.uniform(0.0, 0.01))
            handle.cancel()
        try:
            out = handle.result(cfg.timeout)
        except TimeoutError:
            ledger.violation(f"request {rid} on LLM #{life.index} did not end within {cfg.timeout} s")
            for i in range(params.n):
                ledger.learn((rid, i), None)
            handle.cancel()
            return
        for o in out.outputs:
            ledger.learn((o.request_id, o.index), o.finish_reason)

    # -- the asyncio client ----------------------------------------------------------------------

    def _async_client(self) -> None:
        try:
            asyncio.run(self._async_main())
        except Exception as exc:  # a bug in the soak itself: say so, never hang
            self.ledger.violation(f"the asyncio client crashed: {exc!r}\n{traceback.format_exc(limit=6)}")

    async def _async_main(self) -> None:
        await asyncio.gather(*(self._async_worker(i) for i in range(self.config.async_tasks)))

    async def _async_worker(self, worker: int) -> None:
        rng = random.Random(self.config.seed * 1000 + 500 + worker)
        timeout = self.config.timeout
        while not self.stop.is_set():
            life = self.holder.current()
            if life is None or life.closing:
                if self.holder.stopped:
                    return
                await asyncio.sleep(0.005)
                continue
            entered = self.gate.try_enter()
            if entered is None:
                return
            if not entered:
                await asyncio.sleep(0.005)
                continue
            try:
                if not self.dispenser.take(1):
                    return
                mode = rng.choice(("agenerate", "astream"))
                op = self.ledger.begin(mode, life)
                try:
                    await self._run_async(mode, life, rng, op, timeout)
                except EngineClosed:
                    with life.lock:
                        life.refused += 1
                except QueueFull:
                    with self.ledger.lock:
                        self.ledger.refused_queue_full += 1
                except Exception as exc:
                    self.ledger.violation(
                        f"{mode} on LLM #{life.index} raised {exc!r}\n{traceback.format_exc(limit=6)}"
                    )
                finally:
                    self.ledger.finish(op)
            finally:
                self.gate.leave()

    async def _run_async(self, mode: str, life: Life, rng: random.Random, op: int, timeout: float) -> None:
        llm = life.llm
        if llm is None:
            raise EngineClosed("the LLM was closed and dropped")
        ledger = self.ledger
        params = self.workload.params(rng)
        prompt = self.workload.prompt(rng, params.max_tokens)
        cancel_task = rng.random() < self.config.cancel_rate
        state: dict[str, Any] = {"rid": None, "finals": {}}

        if mode == "agenerate":
            coro: Any = llm.agenerate(prompt, params)
        else:
            break_after = rng.randint(0, 3) if rng.random() < self.config.cancel_rate / 2 else -1

            async def consume() -> None:
                agen = llm.astream(prompt, params)
                seen = 0
                try:
                    async for delta in agen:
                        if state["rid"] is None:
                            state["rid"] = delta.request_id
                            ledger.note_id(op, delta.request_id)
                        if delta.finish_reason is not None:
                            state["finals"][delta.index] = delta.finish_reason
                        seen += 1
                        if seen > break_after >= 0:
                            break
                finally:
                    await agen.aclose()

            coro = consume()
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(0)  # the task's first step submits (or raises EngineClosed)
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        self._submitted(life, 1, params.n)
        cancelled = False
        if cancel_task:
            await asyncio.sleep(rng.uniform(0.0, 0.01))
            if not task.done():
                task.cancel()
                cancelled = True
        try:
            result = await asyncio.wait_for(task, timeout)
        except asyncio.CancelledError:
            if not cancelled:
                raise
            result = None
        except asyncio.TimeoutError:
            ledger.violation(f"{mode} on LLM #{life.index} did not end within {timeout} s")
            result = None
        except (EngineClosed, QueueFull):
            # refused after the first step: the prompt is built in a worker thread, then queued
            self._submitted(life, -1, -params.n)
            raise
        if mode == "agenerate" and result is not None:
            for o in result.outputs:
                ledger.learn((o.request_id, o.index), o.finish_reason)
        elif state["rid"] is not None:
            for i in range(params.n):
                ledger.learn((state["rid"], i), state["finals"].get(i))
        else:
            with ledger.lock:
                ledger.anonymous += params.n


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc="soak", unit="req", disable=None, file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------------


def _check(result: SoakResult) -> list[str]:
    """Every invariant that failed, in words (empty: all held)."""
    ledger = result.ledger
    out = list(ledger.violations)
    completions = sum(life.completions for life in result.lives)
    if completions != ledger.n_known + ledger.n_anonymous:
        out.append(
            f"{completions} completions submitted, but callers know {ledger.n_known} and "
            f"{ledger.n_anonymous} more without ids"
        )
    once = sum(life.ended_once for life in result.lives)
    if once != completions:
        out.append(f"{once} of {completions} completions ended exactly once")
    for life in result.lives:
        name = f"LLM #{life.index} ({life.layout})"
        if life.faults_injected != life.faults_consumed + life.faults_absorbed:
            out.append(
                f"{name}: {life.faults_injected} faults injected, {life.faults_consumed} failed a batch, "
                f"{life.faults_absorbed} were absorbed by the close"
            )
        if life.unexplained_errors:
            out.append(f"{name}: {life.unexplained_errors} requests ended 'error' without an injected fault")
        if not life.drained or life.probe_ok is None:
            continue
        if not life.probe_ok:
            out.append(f"{name}: after its faults, a probe request did not complete normally")
        if life.kv_cells_used != 0:
            out.append(f"{name}: {life.kv_cells_used} KV cells in use after every request ended")
        if life.seq_pos_max is None or any(p != -1 for p in life.seq_pos_max):
            out.append(
                f"{name}: sequences still hold KV positions at the end: seq_pos_max {life.seq_pos_max}"
            )
        if life.busy_slots:
            out.append(f"{name}: {life.busy_slots} slots busy after every request ended")
        ended = sum(life.ended.values())
        if life.engine_requests is not None and life.engine_requests != ended:
            out.append(f"{name}: the engine counted {life.engine_requests} ends, the listener {ended}")
    if result.lives and result.lives[-1].kv_cells_used is None and not out:
        out.append("the last LLM was never checked")
    cfg = result.config
    if cfg.max_rss_growth is not None and result.rss_start and result.rss_end is not None:
        growth = result.rss_end / result.rss_start - 1.0
        if growth > cfg.max_rss_growth:
            out.append(f"RSS grew {growth:.1%} from warm-up to the end (limit {cfg.max_rss_growth:.1%})")
    if result.prompts_attempted < cfg.requests and not out:
        out.append(f"only {result.prompts_attempted} of {cfg.requests} requests were attempted")
    return out


def _sample(d: dict[Any, Any], n: int = 3) -> str:
    return ", ".join(f"{k}: {v}" for k, v in itertools.islice(d.items(), n))


# ---------------------------------------------------------------------------------------------
# Report and command line
# ---------------------------------------------------------------------------------------------

_COLUMNS = (
    Column("layout", "KV layout"),
    Column("lives", "LLMs", "d"),
    Column("prompts_submitted", "prompts", "d"),
    Column("refused", "refused", "d"),
    Column("completions_submitted", "completions", "d"),
    Column("ended_stop", "stop", "d"),
    Column("ended_length", "length", "d"),
    Column("ended_cancelled", "cancelled", "d"),
    Column("ended_error", "error", "d"),
    Column("ended_exactly_once", "ended once", "d"),
    Column("preemptions", "preempted", "d"),
    Column("faults_injected", "faults", "d"),
    Column("faults_consumed", "faults hit", "d"),
)

_CHECK_COLUMNS = (
    Column("check", "invariant"),
    Column("expected", "expected"),
    Column("got", "got"),
    Column("ok", "ok"),
)


def soak_report(result: SoakResult) -> Report:
    """The shared report of a soak run: one row per KV layout and one for the whole run,
    then a table of the invariants."""
    total = result.total()
    cfg = result.config
    settings = {
        "model": result.model.rsplit("/", 1)[-1],
        "requests": cfg.requests,
        "threads": cfg.threads,
        "close_every": cfg.close_every,
        "n_parallel": cfg.n_parallel,
        "cancel_rate": cfg.cancel_rate,
        "fault_rate": cfg.fault_rate,
        "seed": cfg.seed,
    }
    checks = [
        {
            "check": "completions ended exactly once",
            "expected": f"all {total['completions_submitted']}",
            "got": f"{total['ended_exactly_once']} ({total['exactly_once_violations']} violations)",
            "ok": total["exactly_once_violations"] == 0 and total["never_ended"] == 0,
        },
        {
            "check": "KV cells in use at the end",
            "expected": "0",
            "got": str(total["kv_cells_used_end"]),
            "ok": total["kv_cells_used_end"] == 0,
        },
        {
            "check": "seq_pos_max of every sequence at the end",
            "expected": "-1",
            "got": str(total["seq_pos_max_end"]),
            "ok": total["seq_pos_max_end"] == -1,
        },
        {
            "check": "faults: injected = failed a batch + absorbed by a close",
            "expected": str(total["faults_injected"]),
            "got": f"{total['faults_consumed']} + {total['faults_absorbed_by_close']}",
            "ok": total["faults_injected"] == total["faults_consumed"] + total["faults_absorbed_by_close"],
        },
        {
            "check": "errors without an injected fault",
            "expected": "0",
            "got": str(total["unexplained_errors"]),
            "ok": total["unexplained_errors"] == 0,
        },
        {
            "check": "RSS growth, warm-up to end",
            "expected": "-" if cfg.max_rss_growth is None else f"<= {cfg.max_rss_growth:.0%}",
            "got": "-"
            if total["rss_growth_mb"] is None
            else f"{total['rss_growth_mb']:+.1f} MB ({total['rss_growth_pct']:+.1f}%)",
            "ok": not any(v.startswith("RSS grew") for v in result.violations),
        },
        {
            "check": "all invariants",
            "expected": "0 violations",
            "got": f"{len(result.violations)} violations",
            "ok": result.ok,
        },
    ]
    for row in checks:
        row["runner"] = "check"
    rss = (
        f"RSS {total['rss_start_mb']:.1f} MB after the first LLM (warm-up), {total['rss_end_mb']:.1f} MB "
        f"at the end ({total['rss_growth_mb']:+.1f} MB"
        + (
            ""
            if total["rss_growth_second_half_mb"] is None
            else f", {total['rss_growth_second_half_mb']:+.1f} MB over the second half of the LLMs"
        )
        + f"), peak {total['rss_peak_mb']:.1f} MB"
        if total["rss_growth_mb"] is not None
        else f"RSS peak {total['rss_peak_mb']:.1f} MB (one LLM only: no warm-up to compare with)"
    )
    notes = [
        f"{total['prompts_attempted']} requests in {total['wall_s']:.1f} s "
        f"({total['requests_per_s']:.1f}/s), "
        f"{total['closes']} closes ({total['drained_closes']} drained and checked), "
        f"{total['refused']} refused by a closing LLM, {total['anonymous_completions']} cancelled "
        "before their id was known",
        rss,
        "modes: " + ", ".join(f"{k} {v}" for k, v in total["modes"].items()),
        *(f"VIOLATION: {v}" for v in result.violations),
    ]
    rows = [{**row, "runner": "soak"} for row in result.layout_rows()] + [{**total, "runner": "soak"}]
    return Report(settings, rows, _COLUMNS, notes=notes, extra=[("Invariants", checks, _CHECK_COLUMNS)])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-soak``."""
    p.description = (
        "Soak the engine: many mixed requests from many threads with random cancellations, "
        "close()/reopen cycles (both KV layouts) and injected decode faults; checks that every "
        "request ends exactly once and that no KV cell is left in use (llamabatch.bench.soak). "
        "Exit status 1 when an invariant is violated."
    )
    p.add_argument("-m", "--model", default="tiny", help="GGUF or a test-model preset (default: tiny)")
    p.add_argument("-n", "--requests", type=options.positive_int, default=10_000, help="prompts in all")
    p.add_argument("-T", "--threads", type=options.positive_int, default=8, help="client threads (default 8)")
    p.add_argument("--async-tasks", type=options.positive_int, default=4, help="tasks in the asyncio thread")
    p.add_argument(
        "--close-every", type=options.positive_int, default=500, help="close and reopen every K requests"
    )
    p.add_argument("--cancel-rate", type=float, default=0.15, help="share of requests cancelled (0..1)")
    p.add_argument(
        "--fault-rate",
        type=float,
        default=0.02,
        help="injected decode faults per request (default 0.02: one every 50 requests; 0: none)",
    )
    p.add_argument("--n-parallel", type=options.positive_int, default=8, help="slots per LLM")
    p.add_argument(
        "--unified-n-ctx",
        type=options.positive_int,
        default=2 * MAX_SEQ_TOKENS,
        help=f"KV cells of the unified layout (tight, so requests are preempted; >= {MAX_SEQ_TOKENS})",
    )
    p.add_argument(
        "-t", "--n-threads", type=options.positive_int, default=1, help="llama.cpp CPU threads (default 1)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a wait counts as a hang")
    p.add_argument(
        "--max-rss-growth",
        type=float,
        default=None,
        metavar="PCT",
        help="fail when RSS grows more than PCT percent from warm-up to the end (default: report only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-soak``: run the soak, print the report; 1 when an invariant failed."""
    config = SoakConfig(
        model=args.model,
        requests=args.requests,
        threads=args.threads,
        async_tasks=args.async_tasks,
        close_every=args.close_every,
        cancel_rate=args.cancel_rate,
        fault_rate=args.fault_rate,
        n_parallel=args.n_parallel,
        unified_n_ctx=args.unified_n_ctx,
        n_threads=args.n_threads,
        timeout=args.timeout,
        max_rss_growth=None if args.max_rss_growth is None else args.max_rss_growth / 100.0,
        seed=args.seed,
        progress=not args.no_progress and not args.json,
    )
    result = run_soak(config)
    soak_report(result).print(as_json=args.json)
    return 0 if result.ok else 1
