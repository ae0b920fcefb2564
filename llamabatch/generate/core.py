"""The generation engine core: one context, one ``llama_decode`` per ``step()``.

``EngineCore`` is single-threaded: whoever drives it (``LLMEngine`` on the caller's
thread, or ``LLM``'s engine thread) calls ``add``, ``abort`` and ``step`` from one thread.
Each step:

  1. end aborted requests, then admit waiting requests into idle slots in the order and
     under the rules of the engine's ``AdmissionPolicy`` (``admission.py``), while their
     uncomputed prompt tokens fit the free KV cells (less a watermark
     kept for running sequences' next tokens), evicting idle cached prefixes (LRU) to make
     room, and reusing a cached prompt prefix where one matches (``kv_cache.py``);
  2. the Cython core builds the batch under the token budget (``SlotTable.fill``);
  3. decode once; if llama.cpp finds no room in the KV cache, evict cached prefixes, then
     preempt a running request (the policy's ``room_victim``: its cells are freed and it
     goes back to the front of the queue, to be recomputed with the tokens it generated appended to its
     prompt), then halve the batch; only a request that cannot proceed even alone fails;
  4. sample every output at its batch index with the request's own sampler chain;
  5. detokenize incrementally, check stop conditions, record deltas and finish requests.

What the step produced is returned as ``CoreOutput`` records (the request, its new text
and tokens, its end), for the driver to deliver. A request's state is its
``RequestStatus``, changed only through ``Request.transition``. The slot table is the one
record of what every sequence holds in the KV cache; ``SlotMap`` is the one record of which
request runs in which slot; ``requests`` holds every unfinished request by its key.

``engine_build.build_engine`` makes the context and the core of an ``EngineConfig``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from llamabatch._core.batch import BatchPool
from llamabatch._core.slots import SlotState, SlotTable
from llamabatch._core.strategies import DecodeMaximal, get_strategy
from llamabatch._ffi.context import Context, DecodeCode
from llamabatch._ffi.model import Model
from llamabatch._ffi.sampler import SamplingError
from llamabatch.config import EngineConfig
from llamabatch.errors import QueueFull
from llamabatch.generate import prompt_logprobs
from llamabatch.generate.admission import TickLimit, Verdict, order_prefill
from llamabatch.generate.compaction import compact
from llamabatch.generate.decode_costs import fit_decode_costs
from llamabatch.generate.draft_cuts import first_end
from llamabatch.generate.kv_cache import kv_cache_for
from llamabatch.generate.kv_memory import draft_rows_below, ubatch_cost_cells
from llamabatch.generate.lora_schedule import install_lora
from llamabatch.generate.policies import admission_for
from llamabatch.generate.request import CoreOutput, Request, RequestKind, RequestStatus, cells_to_compute
from llamabatch.generate.request_memory import SamplerBuilder
from llamabatch.generate.sample_rows import request_event, row_logprobs, sample_without
from llamabatch.generate.slot_count import resolved_slots
from llamabatch.generate.slot_map import SlotMap
from llamabatch.generate.speculative import speculator_for
from llamabatch.outputs import FinishReason
from llamabatch.runtime.telemetry import GenerationCounters, Telemetry, TickEvent
from llamabatch.runtime.worker import halve_and_retry

logger = logging.getLogger("llamabatch")

_RUNNING = RequestStatus.RUNNING


def check_queue_room(n_queued: int, n_new: int, max_queue: int) -> None:
    """``QueueFull`` unless ``n_new`` more requests fit a queue of ``max_queue`` holding
    ``n_queued`` (the one rule, for the core and for ``LLM``'s inbox)."""
    if n_queued + n_new > max_queue:
        raise QueueFull(f"the request queue is full ({n_queued} waiting, max_queue={max_queue})")


class EngineCore:
    """Continuous batching over ``n_parallel`` slots of one context (seq_id = slot)."""

    def __init__(self, model: Model, context: Context, config: EngineConfig, telemetry: Telemetry) -> None:
        self.model = model
        self.context = context
        self.config = config
        n_parallel = self.n_parallel = resolved_slots(config)
        #: llama.cpp caps n_batch at n_ctx (a bigger batch aborts): the context's is the one
        self.n_batch = context.n_batch
        self.n_ctx_seq = context.n_ctx_seq
        self.max_queue = config.max_queue
        self.telemetry = telemetry
        self.strategy = get_strategy(config.strategy)
        self._fallback_strategy = DecodeMaximal()
        self._empty_plan_logged = False
        unified = context.kv_unified
        self.table = SlotTable(
            n_parallel,
            self.n_ctx_seq,
            config.chunk_size,
            n_pinned=config.n_prefixes,
            kv_unified=unified,
            kv_size=context.n_ctx if unified else 0,
        )
        if not unified:  # a long stream gets a ubatch of its own when that is cheaper
            self.table.ubatch_cost_cells = ubatch_cost_cells(model)
        self.table.draft_rows_below = draft_rows_below(config, context)  # answers as without drafts
        self.kv = kv_cache_for(model, context, self.table, config)
        #: cells kept free at admission for running sequences' next tokens (unified KV only)
        self.watermark = min(n_parallel, max(1, self.table.cells_total // 8)) if unified else 0
        self.spec = speculator_for(
            config.speculative_config,
            model,
            n_seq=n_parallel,
            n_ctx=context.n_ctx,
            n_batch=self.n_batch,
            n_threads=config.n_threads,
        )
        #: builds each completion's sampler chain at its admission (``request_memory.py``)
        self.samplers = SamplerBuilder(model, self.n_ctx_seq, config.grammar_cache_mb)
        self.vision: Any = None  # computes a prompt's image positions at admission (``vision.py``)
        self.pool = BatchPool(self.n_batch, 1)
        self.batch = self.pool.acquire()
        self._batch_released = False
        self.slots = SlotMap(n_parallel)
        self.waiting: deque[Request] = deque()
        #: every unfinished request (waiting or running), by its key (``Request.arrival``)
        self.requests: dict[int, Request] = {}
        self.counters = GenerationCounters()
        self._aborts: list[tuple[Request, str | None]] = []
        self._n_admissions = 0
        self._events: list[CoreOutput] = []
        #: set by a closing driver (with ``Context.abort()``): an aborted decode is no error
        self.stopping = False
        #: the clock decodes are timed with (seconds; tests inject a scripted one)
        self.clock: Callable[[], float] = time.perf_counter
        #: the wait order, admissions, each tick's budget and the victims of preemption
        self.admission = admission_for(config, self.n_batch)
        self.lora = install_lora(self)  # one LoRA adapter set per tick (``lora_schedule.py``)
        # the current tick, as its plug-ins see it (``tick_context.TickContext``)
        self.budget = self.n_batch
        self.tick_limit: TickLimit | None = None
        self._decode_time = 0.0
        self._tick_preemptions = 0
        self._last_fill: tuple[int, int] = (0, 0)
        self._failed_slots: list[int] = []
        self._n_vocab = model.n_vocab
        # Per-token lookups, filled once: end-of-generation flags and ids, piece bytes.
        self._eog = model.eog_flags()
        self._eog_ids = np.flatnonzero(np.frombuffer(bytes(self._eog), dtype=np.uint8)).tolist()
        self._pieces: list[bytes | None] = [None] * model.n_vocab
        self._pieces_special: list[bytes | None] = [None] * model.n_vocab

    # -- requests -------------------------------------------------------------------------

    def add(self, requests: list[Request], *, check_room: bool = True) -> None:
        """Queue requests (all or none); ``QueueFull`` beyond ``max_queue`` waiting."""
        if check_room:
            check_queue_room(self.n_queued, len(requests), self.max_queue)
        for request in requests:
            if request.status is not RequestStatus.WAITING or request.arrival in self.requests:
                raise ValueError(f"request {request.request_id!r} was queued before")
        self.admission.enqueue(self.waiting, requests, self._n_admissions)
        for request in requests:
            self.requests[request.arrival] = request

    @property
    def running(self) -> list[Request | None]:
        """Slot -> the request running there (read only: ``slots`` owns it)."""
        return self.slots.requests

    @property
    def n_queued(self) -> int:
        """Waiting requests that count against ``max_queue``: preempted ones, waiting to be
        recomputed, were admitted once and do not."""
        preempted = RequestStatus.PREEMPTED
        return len(self.waiting) - sum(1 for r in self.waiting if r.status is preempted)

    def abort(self, request: Request, error: str | None = None) -> None:
        """End ``request`` at the start of the next step: ``"cancelled"``, or ``"error"`` with
        the message ``error`` when one is given."""
        if not request.done:
            self._aborts.append((request, error))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self._aborts or self.table.busy_slots)

    @property
    def busy_slots(self) -> int:
        return self.table.busy_slots

    @property
    def kv_cells_free(self) -> int:
        """The slot table's free KV cells, less those M-RoPE images hold beyond its positions."""
        vision = self.vision
        return self.table.cells_free - (vision.extra_cells(self, None, 0) if vision else 0)

    def step(self) -> list[CoreOutput]:
        """One scheduling step: aborts, admission, one decode, sampling. Returns what the
        step produced, per completion."""
        events: list[CoreOutput] = []
        self._events = events
        self._tick_preemptions = 0  # priority preemptions at admission count in this tick
        if self._aborts:
            self._end_aborted()
        if self.waiting:
            self._admit()
        if self.table.busy_slots:
            compact(self)  # a gap among busy KV streams costs every tick a forward pass
            self._tick()
        if not self.has_unfinished():
            self.samplers.when_idle()
        return events

    def fail_all(self, reason: FinishReason, error: str | None = None) -> list[CoreOutput]:
        """End every running and waiting request (closing, or a crash)."""
        events: list[CoreOutput] = []
        self._events = events
        for slot, _ in self.slots.busy():
            self.finish(slot, reason, error)
        while self.waiting:
            self._end(self.waiting.popleft(), reason, error)
        self._aborts.clear()
        return events

    def close(self) -> None:
        """Return the batch buffer (after ``fail_all``); the RAM tier goes to
        ``prefix_cache_dir`` when both are on."""
        if not self._batch_released:
            self._batch_released = True
            self.kv.persist()
            self.pool.release(self.batch)
            if self.spec is not None:  # a draft model's context and weights
                self.spec.close()

    # -- admission ------------------------------------------------------------------------

    def _end_aborted(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request, error in aborts:
            if request.done:
                continue
            slot = self.slots.slot_of(request)
            if slot >= 0:
                self.finish(slot, "cancelled" if error is None else "error", error)
            elif request in self.waiting:
                self.waiting.remove(request)
                self._end(request, "cancelled" if error is None else "error", error)

    def _admit(self) -> None:
        """Admit waiting requests into idle slots, in the admission policy's order, while they
        fit and the policy admits them; a request that cannot start may preempt a running
        one (the policy's ``blocked_victim``), then admission goes on.

        A parallel-sampling follower waits until its leader's prompt is computed, and a
        request sharing a prefix with a prompt being computed waits for that part (both
        are passed over, not blocking the queue); a request whose prompt does not fit the
        free cells blocks the queue until running requests free some, and so does one that
        the policy stops at (``Verdict.STOP``)."""
        table = self.table
        waiting = self.waiting
        policy = self.admission
        policy.reorder(waiting, time.perf_counter())
        n_idle = self.n_parallel - table.busy_slots
        admitting: list[list[int]] = []
        i = 0
        blocked: Request | None = None
        while n_idle and i < len(waiting):
            request = waiting[i]
            tokens = request.tokens_to_compute()
            if (request.kind is RequestKind.FOLLOWER and request.follower_waits) or (
                self.kv.should_wait(tokens, admitting, request.params.lora)
            ):
                i += 1
                continue
            if not self._make_room(tokens, request.params.lora, request.media):
                blocked = request
                break
            n_cells = cells_to_compute(request, len(tokens))  # an M-RoPE image: its cells
            verdict = policy.admits(request, n_cells, table, [s for s, _ in self.slots.busy()])
            if verdict is not Verdict.ADMIT:
                if verdict is Verdict.STOP:
                    break
                i += 1
                continue
            del waiting[i]
            if self._launch(request, tokens):
                admitting.append(tokens)
                n_idle -= 1
        if not policy.preempts_for_waiting:
            return
        while blocked is None and not n_idle and i < len(waiting):
            request = waiting[i]
            if request.kind is RequestKind.FOLLOWER and request.follower_waits:
                i += 1
                continue
            blocked = request
        if blocked is None:
            return
        slot, takes_it = policy.blocked_victim(list(self.slots.busy()), blocked)
        if slot < 0:
            return
        self._preempt(slot)
        self._tick_preemptions += 1
        if not takes_it:  # admission again (it ends: see priority.py)
            self._admit()
        else:  # the blocked request takes the freed slot itself
            tokens = blocked.tokens_to_compute()
            if self._make_room(tokens, blocked.params.lora, blocked.media):
                waiting.remove(blocked)
                self._launch(blocked, tokens)

    def _launch(self, request: Request, tokens: list[int]) -> bool:
        """Start an admitted request (out of the queue) in an idle slot; a sampler that
        cannot be built ends its request instead, not the engine."""
        error = self.samplers.attach(request)
        if error is not None:
            self._end(request, "error", error)
            return False
        self._start(request, tokens)
        return True

    def _make_room(self, tokens: list[int], tag: Hashable = (), media: Any = None) -> bool:
        """Whether ``tokens`` (under the adapter set ``tag``; with images: ``media``) can
        start now: with a unified KV cache its uncached tokens must fit the free cells (plus
        the watermark; M-RoPE images count their cells, see ``vision.extra_cells``); idle
        cached prefixes are evicted (least recently used first) to make room. A request
        always starts when nothing runs."""
        table = self.table
        if not table.kv_unified or not table.busy_slots:
            return True
        source, n_cached = self.kv.best_prefix(tokens, tag) if self.kv.reuse else (-1, 0)
        kept = min(n_cached, len(tokens) - 1)
        need = len(tokens) - kept + self.watermark
        # Prompts admitted but not computed yet (this step's too) will take cells as well.
        need += sum(table.n_pending(s) for s in range(self.n_parallel))
        vision = self.vision
        while table.cells_free < need + (vision.extra_cells(self, media, kept) if vision else 0):
            if not self.kv.evict_one(keep=source):
                return False
            self.counters.evictions += 1
        return True

    def _start(self, request: Request, tokens: list[int]) -> None:
        leader = request.leader
        leader_slot = self.slots.slot_of(leader) if leader is not None else -1
        placement = self.kv.place(tokens, leader_slot, request.params.lora, request.client)
        slot = placement.slot
        reused = placement.reused_tokens
        if self.vision:  # an image the reused prefix ends inside may be computed again
            reused = self.vision.prefill(self, slot, request, reused)
        chunk = prompt_logprobs.score_chunk(request, self._n_vocab)
        if chunk and reused:  # a reused token has no logits: score the prompt from its start
            self.kv.trim(slot, 0)
            reused = 0
        self.table.start(slot, tokens, reused, chunk)
        self.slots.assign(slot, request)
        request.transition(RequestStatus.RUNNING)
        self.admission.admitted(request)
        request.admitted_order = self._n_admissions
        self._n_admissions += 1
        if request.n_preemptions:
            self.counters.recomputed_tokens += len(tokens) - reused
        else:
            request.reused_tokens = reused
            request.shared_tokens = min(placement.shared_tokens, reused)
            request.t_admitted = time.perf_counter()

    # -- the tick -------------------------------------------------------------------------

    def _fill(self, budget: int) -> int:
        table = self.table
        queue_depth = len(self.waiting)
        try:
            n = table.fill(self.batch, self.strategy, budget, queue_depth)
        except Exception:
            logger.exception("batching strategy %r failed; using decode_maximal for this tick", self.strategy)
            return table.fill(self.batch, self._fallback_strategy, budget, queue_depth)
        if n == 0 and (table.count(SlotState.DECODE) or table.count(SlotState.PREFILL)):
            if not self._empty_plan_logged:
                self._empty_plan_logged = True
                logger.warning(
                    "batching strategy %r planned nothing while work is pending; "
                    "using decode_maximal for such ticks",
                    self.strategy,
                )
            n = table.fill(self.batch, self._fallback_strategy, budget, queue_depth)
        return n

    def _tick(self) -> None:
        t_tick = time.perf_counter()
        self._decode_time = 0.0
        self._last_fill = (0, 0)
        retries = 0
        decoded = False
        policy = self.admission
        budget = self.budget = policy.tick_budget(self.table, [s for s, _ in self.slots.busy()], self.n_batch)
        self.tick_limit = policy.tick_limit()
        order_prefill(policy, self.table, self.slots.requests)
        budget = self.budget = self.vision.tick(self, budget) if self.vision else budget  # images' slice
        if self.spec is not None:
            self.spec.prepare(self)
        while True:
            outcome = halve_and_retry(self._try_decode, budget, relieve=self._relieve)
            retries += outcome.retries
            if outcome.used == 0:
                break
            if outcome.ok:
                decoded = True
                break
            if outcome.code is DecodeCode.ABORTED and self.stopping:
                return  # the driver is closing: it ends every request next
            self.context.clear_abort()
            error = str(outcome.code.error("llama_decode", outcome.raw))
            # Alone and still no room, or a decode error: fail the requests of that batch,
            # free their KV, keep serving the others.
            for slot in self._failed_slots:
                self.finish(slot, "error", error=error)
            retries += 1
            if not self.table.busy_slots:
                break
        if decoded:
            self._sample_outputs()
        if decoded or retries:
            self._record_tick(decoded, retries, time.perf_counter() - t_tick)

    def _record_tick(self, decoded: bool, retries: int, tick_time: float) -> None:
        """Counters and the ``TickEvent`` of a tick (also of one whose decodes all failed:
        its retries and preemptions count)."""
        n_decode, n_prefill = self._last_fill
        n_tokens = n_decode + n_prefill
        busy = self.table.busy_slots
        counters = self.counters
        if decoded:
            counters.ticks += 1
            counters.batch_tokens += n_tokens
            counters.decode_tokens += n_decode
            counters.prefill_tokens += n_prefill
            counters.busy_slot_ticks += busy
        counters.decode_time += self._decode_time
        counters.tick_time += tick_time
        counters.decode_retries += retries
        if self.telemetry.has_listeners:
            table = self.table
            self.telemetry.emit(
                TickEvent(
                    tick=counters.ticks,
                    batch_tokens=n_tokens,
                    decode_tokens=n_decode,
                    prefill_tokens=n_prefill,
                    busy_slots=busy,
                    queue_depth=len(self.waiting),
                    decode_time=self._decode_time,
                    tick_time=tick_time,
                    decode_retries=retries,
                    preemptions=self._tick_preemptions,
                    kv_cells_used=table.cells_used,
                    kv_cells_total=table.cells_total,
                    token_budget=self.budget,
                    predicted_time=self.admission.predicted(),
                )
            )

    def _try_decode(self, budget: int) -> tuple[int, int]:
        """Fill a batch of at most ``budget`` tokens and decode it: ``(code, n_tokens)``.
        A failed decode leaves no trace (the fill is rolled back, partial KV writes removed)."""
        n_tokens = self._fill(budget)
        if n_tokens == 0:
            return 0, 0
        clock = self.clock
        t0 = clock()
        code = self.context.decode_address(self.batch.address)
        elapsed = clock() - t0
        self._decode_time += elapsed
        if code == 0:
            fit_decode_costs(self.table, self.slots, (self.admission, self.spec), elapsed)
            self._last_fill = self.table.last_fill_stats
            self.table.commit()
            return 0, n_tokens
        self._failed_slots = self._slots_in_batch()
        self.table.rollback()
        for slot in self._failed_slots:  # drop what a partly processed batch left behind
            self.kv.drop_uncommitted(slot)
        return code, n_tokens

    def _relieve(self) -> bool:
        """Free KV cells after a decode found no room: cached prefixes go first, then the
        admission policy's ``room_victim`` is preempted (recomputed later)."""
        if self.kv.evict_one():
            self.counters.evictions += 1
            return True
        if self._preempt_one():
            self._tick_preemptions += 1
            return True
        return False

    def _slots_in_batch(self) -> list[int]:
        table = self.table
        return [s for s, _ in self.slots.busy() if table.tokens_in_batch(s)]

    def _preempt_one(self) -> bool:
        """Preempt the admission policy's ``room_victim``; False when it names none."""
        slot = self.admission.room_victim(list(self.slots.busy()))
        if slot < 0:
            return False
        self._preempt(slot)
        return True

    def _preempt(self, slot: int) -> None:
        """Free the cells of the request running in ``slot`` and put it back in the queue
        (preempted requests go before new ones of their priority, oldest first, so none
        can starve), to be recomputed later."""
        self.kv.release(slot, keep=False)
        request = self.slots.release(slot)
        assert request is not None
        self.admission.released(request)
        if self.spec is not None:
            self.spec.release(request, done=False)
        request.transition(RequestStatus.PREEMPTED)
        request.n_preemptions += 1
        self.counters.preemptions += 1
        self.admission.enqueue(self.waiting, [request], self._n_admissions)
        logger.debug(
            "preempted request %s (%d tokens generated)", request.request_id, len(request.output_tokens)
        )

    # -- sampling -------------------------------------------------------------------------

    def _sample_outputs(self) -> None:
        """Sample every output of the tick: plain greedy requests take the argmax of their
        logits row (numpy, no copy), the others run their own llama.cpp sampler chain."""
        if self.table.n_score_rows:
            prompt_logprobs.record(self)
        if self.table.n_draft_tokens and self.spec is not None:
            return self.spec.sample_tick(self)
        outputs = self.table.outputs()  # [(slot, batch index)], in batch order
        running: list[Any] = self.slots.requests  # every slot of ``outputs`` is busy
        # Output rows are stored in batch order, which is the order of ``outputs``.
        greedy_rows = [row for row, (slot, _) in enumerate(outputs) if running[slot].fast_greedy]
        greedy: dict[int, int] = {}
        if greedy_rows:
            logits = prompt_logprobs.output_logits(self.context, self.table, outputs)
            if len(greedy_rows) < len(outputs):
                logits = logits[greedy_rows]
            greedy = dict(zip(greedy_rows, logits.argmax(axis=1).tolist(), strict=True))
        now = time.perf_counter()
        pin_kind = RequestKind.PIN
        for row, (slot, idx) in enumerate(outputs):
            request = running[slot]
            if request.kind is pin_kind:  # a prefix to pin: computed, nothing to sample
                self.kv.pin(request.pin, slot)
                self.finish(slot, "stop")
                continue
            if request.fast_greedy:
                token = greedy[row]
                logprobs = request.state.logprobs
                if logprobs is not None:
                    logprobs.append(self.logprobs(idx, token, request.params.logprobs))
            else:
                sampled = self.sample_row(slot, request, idx, None, row)
                if sampled is None:
                    continue
                token = sampled
            self.emit_token(slot, request, token, now)

    def sample_row(
        self, slot: int, request: Request, idx: int, logits: Any, row: int, n_before: int = -1
    ) -> int | None:
        """The token sampled at batch index ``idx`` (output ``row``; ``logits``: the tick's
        rows when a fast greedy request is in it) with the request's own sampler, its
        logprobs recorded; None when sampling failed (the request is ended). ``n_before``:
        tokens sampled before this one in the tick and not yet emitted (speculation: the
        caller records the logprobs of the tokens it emits)."""
        if request.fast_greedy:
            token = int(logits[row].argmax())
        else:
            sampler = request.sampler
            assert sampler is not None  # never the fast greedy path
            try:
                if len(request.output_tokens) + max(n_before, 0) < request.params.min_tokens:
                    banned = list(request.stop_ids) + ([] if request.params.ignore_eos else self._eog_ids)
                    token = sample_without(self.context, sampler, idx, banned)
                else:
                    token = sampler.sample(self.context, idx)
            except SamplingError as exc:  # a grammar at a dead end: end this request only
                if n_before >= 0:
                    raise  # (speculation emits the tokens sampled before it first)
                self.finish(slot, "error", error=exc)
                return None
        logprobs = request.state.logprobs
        if logprobs is not None and n_before < 0:
            logprobs.append(self.logprobs(idx, token, request.params.logprobs or 0))
        return token

    def emit_token(
        self, slot: int, request: Request, token: int, now: float, n_past: int = -1, last: bool = True
    ) -> bool:
        """Emit ``token``; whether the request goes on (``n_past``/``last``: speculation's
        emission of several tokens of one tick, only the last one decoded next)."""
        params = request.params
        if request.t_first_token is None:
            request.t_first_token = now
        request.token_times.append(now)
        request.output_tokens.append(token)
        if (self._eog[token] and not params.ignore_eos) or token in request.stop_ids:
            self._emit(request, "", token)
            self.finish(slot, "stop", stop_reason=token)
            return False
        text, matched = request.state.feed(self._piece(token, not params.skip_special_tokens))
        if matched is not None:
            self._emit(request, text, token)
            self.finish(slot, "stop", stop_reason=matched)
            return False
        self._emit(request, text, token)
        if n_past < 0:
            n_past = self.table.n_past(slot)
        if len(request.output_tokens) >= params.max_tokens or n_past + 1 >= self.n_ctx_seq:
            self.finish(slot, "length")
            return False
        if last:
            self.table.accept(slot, token)
        return True

    def _emit(self, request: Request, text: str, token: int) -> None:
        state = request.state
        if text:
            state.text_parts.append(text)
        if state.streaming:
            self._events.append(CoreOutput(request, text, [token], _RUNNING))

    def _piece(self, token: int, special: bool) -> bytes:
        cache = self._pieces_special if special else self._pieces
        piece = cache[token]
        if piece is None:
            piece = cache[token] = self.model.token_to_piece(token, special=special)
        return piece

    def logprobs(self, idx: int, token: int, n: int) -> dict[int, float]:
        return row_logprobs(self.context, idx, token, n, self._n_vocab)

    def draft_end(self, request: Request, tokens: list[int]) -> int:
        return first_end(tokens, request, self._eog, self._piece)

    # -- the end of a request -------------------------------------------------------------

    def finish(
        self, slot: int, reason: FinishReason, error: str | Exception | None = None, stop_reason: Any = None
    ) -> None:
        request = self.slots.release(slot)
        if request is None:
            return
        self.admission.released(request)
        # Keep what the KV cache validly holds for reuse, unless the request failed.
        self.kv.release(slot, keep=reason != "error")
        self._end(request, reason, error, stop_reason)

    def _end(
        self,
        request: Request,
        reason: FinishReason,
        error: str | Exception | None = None,
        stop_reason: Any = None,
    ) -> None:
        if self.spec is not None:
            self.spec.release(request)
        rest = request.finish(reason, error, stop_reason)
        if rest is None:
            return
        self.requests.pop(request.arrival, None)
        self._events.append(CoreOutput(request, rest, [], request.status, request.finish_reason))
        out = request.output
        assert out is not None
        counters = self.counters
        counters.requests += 1
        counters.prompt_tokens += out.usage.prompt_tokens
        counters.completion_tokens += out.usage.completion_tokens
        counters.reused_tokens += out.usage.reused_tokens
        counters.finish_reasons[out.finish_reason] = counters.finish_reasons.get(out.finish_reason, 0) + 1
        if out.timings.slo_met is not None:  # goodput: requests with an SLO, and those that met it
            counters.slo_requests += 1
            counters.slo_met += out.timings.slo_met
        if self.telemetry.has_listeners:
            self.telemetry.emit(request_event(request, out))
