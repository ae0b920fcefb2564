"""The soak's controller: ``run_soak`` opens, drains and closes the LLMs, injects the faults and
checks the KV cache; the clients are in ``clients.py``."""

from __future__ import annotations

import gc
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from llamabatch.bench.memory import current_rss
from llamabatch.bench.soak.clients import Clients
from llamabatch.bench.soak.config import MAX_SEQ_TOKENS, SoakConfig
from llamabatch.bench.soak.ledger import Dispenser, Gate, Holder, Ledger, Life
from llamabatch.bench.soak.result import SoakResult, check_invariants
from llamabatch.bench.soak.workload import Workload


def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak described by ``config`` and check its invariants (see the module doc)."""
    from llamabatch.bench.workloads import resolve_model

    path = str(resolve_model(config.model))
    return _Soak(config, path).run()


class _Soak(Clients):
    """One soak: the controller (this class) and its clients (``Clients``)."""

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
        clients = self.start_clients()
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
                    self._probe_andcheck_invariants(life)
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
        result.violations = check_invariants(result)
        return result

    def _open(self, life: Life) -> bool:
        from llamabatch import LLM, EngineConfig

        cfg = self.config
        n_ctx = cfg.unified_n_ctx if life.unified else cfg.n_parallel * MAX_SEQ_TOKENS
        try:
            config = EngineConfig(
                n_ctx=n_ctx, n_parallel=cfg.n_parallel, n_threads=cfg.n_threads, kv_unified=life.unified
            )
            life.llm = LLM(self.path, config=config)
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

    def _probe_andcheck_invariants(self, life: Life) -> None:
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
            life.seq_pos_max = llm.call_on_engine_thread(
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
        if llm.worker.alive:
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


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc="soak", unit="req", disable=None, file=sys.stderr, dynamic_ncols=True)
