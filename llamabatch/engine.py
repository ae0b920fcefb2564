"""The generation engine: one thread, one context, one ``llama_decode`` per tick.

Each tick (``_tick``):
  1. end cancelled requests, admit queued requests into free slots (FIFO), reusing a
     cached prompt prefix where one matches (``prefix_cache.py``);
  2. the Cython core builds the batch under the token budget (``SlotTable.fill``);
  3. decode once; on code 1 (no KV room) retry with half the budget, as llama.cpp's server
     does, and fail only the request that cannot proceed even alone;
  4. sample every output at its batch index with the request's own sampler chain;
  5. detokenize incrementally, check stop conditions, deliver deltas, free finished slots.

The engine thread is the context's only user; callers talk to it through a queue guarded
by a condition variable, and it sleeps when there is nothing to do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from llamabatch._core.batch import BatchPool
from llamabatch._core.slots import SlotState, SlotTable
from llamabatch._core.strategies import DecodeMaximal, get_strategy
from llamabatch._ffi.context import Context, DecodeCode, decode_error
from llamabatch._ffi.model import Model
from llamabatch.errors import EngineClosed, QueueFull
from llamabatch.prefix_cache import PrefixCache
from llamabatch.request import Request
from llamabatch.telemetry import RequestEvent, Telemetry, TickEvent

logger = logging.getLogger("llamabatch")


class Engine:
    """Continuous batching over ``n_parallel`` slots of one context (seq_id = slot)."""

    def __init__(
        self,
        model: Model,
        context: Context,
        *,
        n_parallel: int,
        n_batch: int,
        chunk_size: int,
        strategy: Any,
        max_queue: int,
        telemetry: Telemetry,
        prefix_cache: bool = True,
        n_pinned_max: int = 0,
    ) -> None:
        self.model = model
        self.context = context
        self.n_parallel = n_parallel
        self.n_batch = n_batch
        self.n_ctx_seq = context.n_ctx_seq
        self.max_queue = max_queue
        self.telemetry = telemetry
        self.strategy = get_strategy(strategy)
        self._fallback_strategy = DecodeMaximal()
        self.table = SlotTable(n_parallel, self.n_ctx_seq, chunk_size)
        self.pool = BatchPool(n_batch, 1)
        self.batch = self.pool.acquire()
        self.slots: list[Request | None] = [None] * n_parallel
        self.n_active = 0
        self.tick_count = 0
        self._queue: deque[Request] = deque()
        self._calls: deque[Any] = deque()  # work that must run on the engine thread
        self._cond = threading.Condition()
        self._cancel_pending = False
        self._closing = False
        self._n_vocab = model.n_vocab
        # Per-token lookups, filled once: end-of-generation flags and piece bytes.
        self._eog = model.eog_flags()
        self._pieces: list[bytes | None] = [None] * model.n_vocab
        self._pieces_special: list[bytes | None] = [None] * model.n_vocab
        supported = not (model.is_recurrent or model.is_hybrid)
        if prefix_cache and not supported:
            logger.warning(
                "llamabatch: prefix reuse switched off: %s has %s memory, its KV cannot be copied in part",
                model.path.name,
                "recurrent" if model.is_recurrent else "hybrid",
            )
        self.prefix_cache = PrefixCache(
            context, self.table, n_parallel, n_pinned_max, prefix_cache, supported
        )
        self._thread = threading.Thread(target=self._run, name="llamabatch-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread) --------------------------------------------------------

    def submit(self, requests: list[Request], block: bool = False, timeout: float | None = None) -> None:
        """Queue requests (all or none). ``QueueFull`` when ``max_queue`` would be exceeded,
        unless ``block``, which waits for room."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closing:
                    raise EngineClosed("the engine is closed")
                if len(self._queue) + len(requests) <= self.max_queue:
                    break
                if not block:
                    raise QueueFull(
                        f"the request queue is full ({len(self._queue)} waiting, max_queue={self.max_queue})"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueFull(f"no room in the queue within {timeout} s (max_queue={self.max_queue})")
                self._cond.wait(left)
            self._queue.extend(requests)
            self._cond.notify_all()

    def cancel(self, request: Request) -> None:
        """Cancel a request: at once when still queued, at the next tick when running."""
        with self._cond:
            if request.done:
                return
            request.cancel_requested = True
            try:
                self._queue.remove(request)
            except ValueError:
                self._cancel_pending = True
                self._cond.notify_all()
                return
            self._cond.notify_all()
        self._end_request(request, "cancelled")

    def call(self, fn: Any, timeout: float | None = None) -> Any:
        """Run ``fn()`` on the engine thread (the context's only user) and return its result."""
        import concurrent.futures

        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise EngineClosed("the engine is closed")
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout)

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def attach_async(self, request: Request, loop: Any, aqueue: Any) -> None:
        """Mirror a (not yet submitted) request's deltas into an asyncio queue."""
        request._loop_queues.append((loop, aqueue))

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine; requests still queued or running end as ``"cancelled"``."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.context.abort()  # stop a long decode early
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closing and not self._thread.is_alive()

    # -- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._queue or self.n_active or self._calls or self._closing):
                        self._cond.wait()
                    if self._closing:
                        break
                    admitted = self._take_admissions()
                    cancels = self._cancel_pending
                    self._cancel_pending = False
                    if admitted:
                        self._cond.notify_all()  # room in the queue for blocked submitters
                if self._calls:
                    self._run_calls()
                if cancels:
                    self._end_cancelled()
                for request in admitted:
                    self._admit(request)
                if self.n_active:
                    self._tick()
        except BaseException:  # pragma: no cover - a bug; never leave callers hanging
            logger.critical("llamabatch engine thread crashed", exc_info=True)
            self._fail_all("error", "the engine thread crashed (see the 'llamabatch' log)")
            with self._cond:
                self._closing = True
            raise
        finally:
            self._shutdown()

    def _take_admissions(self) -> list[Request]:
        """Pop what fits into free slots, FIFO; a parallel-sampling follower waits until its
        leader's prompt is computed, and any request whose prompt shares a prefix with one
        being computed waits for that part, so shared tokens are computed once and copied."""
        free = self.n_parallel - self.n_active
        admitted: list[Request] = []
        skipped: list[Request] = []
        while free > 0 and self._queue:
            request = self._queue.popleft()
            if request.done:  # cancelled while queued
                continue
            leader = request.group
            waits_for_leader = leader is not None and not leader.done and leader.t_first_token is None
            if waits_for_leader or self.prefix_cache.should_wait(
                request.prompt_tokens, [r.prompt_tokens for r in admitted]
            ):
                skipped.append(request)
                continue
            admitted.append(request)
            free -= 1
        self._queue.extendleft(reversed(skipped))
        self.n_active += len(admitted)
        return admitted

    def _admit(self, request: Request) -> None:
        free = [s for s in range(self.n_parallel) if self.slots[s] is None]
        leader = request.group
        leader_slot = leader.slot if leader is not None and not leader.done else -1
        admission = self.prefix_cache.plan(request.prompt_tokens, free, leader_slot)
        self.prefix_cache.apply(admission)
        slot = admission.slot
        request.slot = slot
        request.n_reused = admission.n_reused
        request.t_admitted = time.perf_counter()
        self.slots[slot] = request
        self.table.start(slot, request.prompt_tokens, admission.n_reused)

    def _end_cancelled(self) -> None:
        for slot, request in enumerate(self.slots):
            if request is not None and request.cancel_requested:
                self._finish(slot, "cancelled")

    def _fill(self, budget: int) -> int:
        try:
            return self.table.fill(self.batch, self.strategy, budget, len(self._queue))
        except Exception:
            logger.exception("batching strategy %r failed; using decode_maximal for this tick", self.strategy)
            return self.table.fill(self.batch, self._fallback_strategy, budget, len(self._queue))

    def _tick(self) -> None:
        t_tick = time.perf_counter()
        budget = self.n_batch
        retries = 0
        decode_time = 0.0
        while True:
            n_tokens = self._fill(budget)
            if n_tokens == 0:
                return
            t0 = time.perf_counter()
            code = self.context.decode_address(self.batch.address)
            decode_time += time.perf_counter() - t0
            if code == 0:
                n_decode, n_prefill = self.table.last_fill_stats
                self.table.commit()
                break
            batch_slots = self._slots_in_batch()
            self.table.rollback()
            for slot in batch_slots:  # drop what a partly processed batch left behind
                self.context.seq_rm(slot, self.table.n_past(slot), -1)
            if DecodeCode.of(code).retryable and self.prefix_cache.evict_one():
                retries += 1  # cached prefixes go first, before the batch shrinks
                continue
            if DecodeCode.of(code).retryable and budget > 1:
                budget //= 2
                retries += 1
                continue
            if self._closing:
                return
            self.context.clear_abort()
            error = decode_error(code)
            # Alone and still no room (code 1 at budget 1), or a decode error: fail the
            # requests in this batch, free their KV, keep serving the others.
            for slot in batch_slots:
                self._finish(slot, "error", error=str(error))
            if not self.n_active:
                return
            budget = self.n_batch
            retries += 1
        self.tick_count += 1
        self._sample_outputs()
        tick_time = time.perf_counter() - t_tick
        self.telemetry.add(
            ticks=1,
            batch_tokens=n_tokens,
            decode_tokens=n_decode,
            prefill_tokens=n_prefill,
            busy_slots=self.n_active,
            decode_time=decode_time,
            tick_time=tick_time,
            retries=retries,
        )
        if self.telemetry.has_listeners:
            self.telemetry.emit(
                TickEvent(
                    self.tick_count,
                    n_tokens,
                    n_decode,
                    n_prefill,
                    self.n_active,
                    len(self._queue),
                    decode_time,
                    tick_time,
                    retries,
                )
            )

    def _slots_in_batch(self) -> list[int]:
        table = self.table
        return [
            s for s in range(self.n_parallel) if self.slots[s] is not None and table.tokens_in_batch(s) > 0
        ]

    def _sample_outputs(self) -> None:
        """Sample every output of the tick: plain greedy requests take the argmax of their
        logits row (numpy, no copy), the others run their own llama.cpp sampler chain."""
        table = self.table
        outputs = table.outputs()  # [(slot, batch index)], in batch order
        slots = self.slots
        # Output rows are stored in batch order, which is the order of ``outputs``.
        greedy_rows = [row for row, (slot, _) in enumerate(outputs) if slots[slot].fast_greedy]
        greedy: dict[int, int] = {}
        if greedy_rows:
            logits = self.context.logits_rows(len(outputs))
            if len(greedy_rows) < len(outputs):
                logits = logits[greedy_rows]
            greedy = dict(zip(greedy_rows, logits.argmax(axis=1).tolist(), strict=True))
        now = time.perf_counter()
        context = self.context
        for row, (slot, idx) in enumerate(outputs):
            request = slots[slot]
            if request.pin is not None:  # a prefix to pin: computed, nothing to sample
                self.prefix_cache.pin(request.pin, slot)
                self._finish(slot, "stop")
                continue
            if request.fast_greedy:
                token = greedy[row]
            else:
                token = request.sampler.sample(context, idx)
            if request.logprobs is not None:
                request.logprobs.append(self._logprobs(idx, token, request.params.logprobs))
            self._on_token(slot, request, token, now)

    def _on_token(self, slot: int, request: Request, token: int, now: float) -> None:
        params = request.params
        if request.t_first_token is None:
            request.t_first_token = now
        request.output_tokens.append(token)
        if self._eog[token] and not params.ignore_eos:
            request.push("", [token])
            self._finish(slot, "stop", stop_reason=token)
            return
        text = request.detok.feed(self._piece(token, not params.skip_special_tokens))
        if text:
            text, matched = request.stop_matcher.feed(text)
            if matched is not None:
                request.push(text, [token])
                self._finish(slot, "stop", stop_reason=matched)
                return
        request.push(text, [token])
        if len(request.output_tokens) >= params.max_tokens or self.table.n_past(slot) + 1 >= self.n_ctx_seq:
            self._finish(slot, "length")
            return
        self.table.accept(slot, token)

    def _piece(self, token: int, special: bool) -> bytes:
        cache = self._pieces_special if special else self._pieces
        piece = cache[token]
        if piece is None:
            piece = cache[token] = self.model.token_to_piece(token, special=special)
        return piece

    def _logprobs(self, idx: int, token: int, n: int) -> dict[int, float]:
        logits = self.context.logits_view(idx).astype(np.float64)
        peak = logits.max()
        logsumexp = peak + np.log(np.exp(logits - peak).sum())
        out: dict[int, float] = {}
        if n > 0:
            top = np.argpartition(-logits, n - 1)[:n] if n < self._n_vocab else np.arange(self._n_vocab)
            for t in top[np.argsort(-logits[top], kind="stable")]:
                out[int(t)] = float(logits[t] - logsumexp)
        out[int(token)] = float(logits[token] - logsumexp)
        return out

    def _finish(self, slot: int, reason: str, error: str | None = None, stop_reason: Any = None) -> None:
        request = self.slots[slot]
        if request is None:
            return
        # Keep what the KV cache validly holds for reuse, unless the request failed.
        kept = None
        if reason != "error" and self.prefix_cache.enabled and self.table.n_past(slot):
            kept = self.table.history(slot)[: self.table.n_past(slot)]
        if self.table.state(slot) != SlotState.IDLE:
            self.table.finish(slot)
        self.prefix_cache.release_slot(slot, kept)
        self.slots[slot] = None
        with self._cond:
            self.n_active -= 1
            self._cond.notify_all()
        self._end_request(request, reason, error, stop_reason)

    def _end_request(
        self, request: Request, reason: str, error: str | None = None, stop_reason: Any = None
    ) -> None:
        if request.sampler is not None:
            request.sampler.close()
        if not request.finish(reason, error, stop_reason):  # type: ignore[arg-type]
            return
        out = request.output
        assert out is not None
        self.telemetry.add(
            requests=1,
            prompt_tokens=out.usage.prompt_tokens,
            completion_tokens=out.usage.completion_tokens,
            reused_tokens=out.usage.n_reused_tokens,
            **{f"finish_{out.finish_reason}": 1},
        )
        if self.telemetry.has_listeners:
            ttft = out.timings.time_to_first_token
            gen_time = out.timings.total - ttft if ttft is not None else None
            prefill_time = ttft - out.timings.queue_wait if ttft is not None else None
            self.telemetry.emit(
                RequestEvent(
                    request_id=out.request_id,
                    finish_reason=out.finish_reason,
                    prompt_tokens=out.usage.prompt_tokens,
                    completion_tokens=out.usage.completion_tokens,
                    reused_tokens=out.usage.n_reused_tokens,
                    queue_wait=out.timings.queue_wait,
                    time_to_first_token=ttft,
                    total=out.timings.total,
                    prompt_tokens_per_s=(out.usage.prompt_tokens / prefill_time) if prefill_time else None,
                    generation_tokens_per_s=(
                        (out.usage.completion_tokens - 1) / gen_time
                        if gen_time and out.usage.completion_tokens > 1
                        else None
                    ),
                )
            )

    def _fail_all(self, reason: str, error: str | None = None) -> None:
        for slot in range(self.n_parallel):
            self._finish(slot, reason, error)
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
        for request in queued:
            self._end_request(request, reason, error)

    def _shutdown(self) -> None:
        self._fail_all("cancelled")
        with self._cond:
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            future.set_exception(EngineClosed("the engine is closed"))
        if self.batch is not None:
            self.pool.release(self.batch)
            self.batch = None
        self.context.clear_abort()
