"""Helpers of the scheduler tests over the fake llama.cpp (``fake_llama.py``): requests with
known expected tokens (``greedy``, ``prompt``), a ``Recorder`` that runs a core and checks
every completion against what it would have produced alone, and ``check_core``, the
invariants of a core and its fake context."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

from fake_llama import FakeContext, FakeModel, FakeSampler, make_core

from llamabatch import SamplingParams
from llamabatch._core.slots import SlotState
from llamabatch.generate.core import EngineCore
from llamabatch.generate.request import Request, RequestStatus


def greedy(max_tokens: int = 8, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **options)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` tokens (ids 1..63), different for every seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(n)]


def check_core(core: EngineCore, ctx: FakeContext) -> None:
    """What must hold between steps: the slot table agrees with the fake's real cells,
    position by position and token by token; slots and requests agree."""
    table = core.table
    table.check_invariants()  # includes check_kv: reference counts equal the positions held
    ctx.check()
    assert table.cells_used == ctx.cells_used(), "cells accounted for != cells llama.cpp holds"
    for seq in range(table.n_seq):
        n = table.seq_len(seq)
        assert ctx.seq_positions(seq) == list(range(n)), f"seq {seq}: positions differ from seq_len {n}"
        assert ctx.seq_tokens(seq) == table.seq_tokens(seq).tolist(), f"seq {seq}: tokens differ"
    running = [r for r in core.running if r is not None]
    for slot in range(core.n_parallel):
        request = core.running[slot]
        assert (request is None) == (table.state(slot) == SlotState.IDLE), f"slot {slot}"
        if request is not None:
            assert not request.done
            assert table.history(slot).tolist() == request.prompt_tokens + request.output_tokens
        elif not core.kv.reuse:
            assert table.seq_len(slot) == 0, f"idle slot {slot} holds KV with reuse off"
    assert len({id(r) for r in running}) == len(running), "a request runs in two slots"
    assert not {id(r) for r in running} & {id(r) for r in core.waiting}, "a request both waits and runs"
    assert all(not r.done for r in core.waiting)


class Recorder:
    """Drives a core step by step, recording every event per request, checking the
    invariants after every step."""

    def __init__(self, core: EngineCore, ctx: FakeContext, model: FakeModel) -> None:
        self.core, self.ctx, self.model = core, ctx, model
        self.requests: list[Request] = []
        self.tokens: dict[Request, list[int]] = defaultdict(list)
        self.texts: dict[Request, list[str]] = defaultdict(list)
        self.ends: Counter[Request] = Counter()
        self.samplers: dict[Request, dict] = {}
        self.steps = 0

    def add(self, *requests: Request) -> list[Request]:
        self.core.add(list(requests))
        self.requests += requests
        return list(requests)

    def new(
        self,
        tokens: list[int],
        params: SamplingParams | None = None,
        n: int = 1,
        priority: int = 0,
        client: object = None,
    ) -> list[Request]:
        """Queue ``n`` completions of ``tokens`` (a parallel-sampling group when n > 1) for
        ``client``."""
        params = params or greedy()
        group: list[Request] = []
        for i in range(n):
            r = Request(
                list(tokens),
                params,
                index=i,
                request_id=group[0].request_id if group else None,
                leader=group[0] if i else None,
                priority=priority,
                client=client,
            )
            if not r.fast_greedy:
                seed = None if params.seed is None else params.seed + i
                r.sampler = FakeSampler(self.model, with_seed(params, seed))
            group.append(r)
        return self.add(*group)

    def step(self) -> list:
        events = self.core.step()
        self.steps += 1
        self.record(events)
        return events

    def record(self, events: list) -> None:
        for event in events:
            request, text, token_ids, reason = event.request, event.text, event.token_ids, event.finish_reason
            assert event.status is (request.status if reason is not None else RequestStatus.RUNNING)
            assert self.ends[request] == 0, f"request {request.request_id}: an event after its end"
            self.texts[request].append(text)
            self.tokens[request] += token_ids
            if reason is not None:
                self.ends[request] += 1
                assert request.done and reason == request.finish_reason
        self.check()

    def check(self) -> None:
        check_core(self.core, self.ctx)
        for r in self.requests:
            assert self.ends[r] == (1 if r.done else 0), f"request {r.request_id} ended {self.ends[r]} times"

    def run(self, max_steps: int = 5000) -> int:
        """Step until nothing is left; fails if that takes more than ``max_steps``."""
        start = self.steps
        while self.core.has_unfinished():
            self.step()
            assert self.steps - start < max_steps, "no end in sight: endless preemption or a stuck queue"
        return self.steps - start

    def expected(self, r: Request) -> tuple[list[int], str]:
        sampler = None
        if r.sampler is not None:
            seed = None if r.params.seed is None else r.params.seed + r.index
            sampler = FakeSampler(self.model, with_seed(r.params, seed))
        return self.model.completion(
            r.prompt_tokens, r.params.max_tokens, self.ctx.n_ctx_seq, r.params.ignore_eos, sampler
        )

    def check_done(self, r: Request) -> None:
        """A finished request: its stream equals its output, and its tokens are those it
        would have produced alone (a prefix of them when cancelled or failed)."""
        out = r.output
        assert out is not None and self.ends[r] == 1
        assert self.tokens[r] == out.token_ids, "streamed tokens != final tokens"
        assert "".join(self.texts[r]) == out.text, "streamed text != final text"
        assert out.timings.preemptions == r.n_preemptions
        assert out.usage.prompt_tokens == len(r.prompt_tokens)
        assert out.usage.completion_tokens == len(out.token_ids)
        assert 0 <= out.usage.reused_tokens <= len(r.prompt_tokens) - 1
        if r.pin is not None:
            return
        tokens, reason = self.expected(r)
        if out.finish_reason in ("stop", "length"):
            assert (out.token_ids, out.finish_reason) == (tokens, reason), f"request {r.request_id}"
        else:
            assert out.token_ids == tokens[: len(out.token_ids)], f"request {r.request_id}"


def with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    from dataclasses import replace

    return params if seed is None or seed == params.seed else replace(params, seed=seed % 2**32)


def slot_of(core: EngineCore, request: Request) -> int:
    return core.running.index(request)


def oversubscribed(n_ctx=64, n_parallel=2, **options) -> tuple[EngineCore, Recorder]:
    """A core of ``n_parallel`` slots over ``n_ctx`` cells, to oversubscribe, and its recorder."""
    core, ctx, model = make_core(n_parallel=n_parallel, n_ctx=n_ctx, **options)
    return core, Recorder(core, ctx, model)
