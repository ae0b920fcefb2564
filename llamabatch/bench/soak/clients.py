"""The soak's clients: blocking threads and one asyncio thread submitting, streaming and
cancelling requests, recording what each got."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import traceback
from typing import Any

from llamabatch.bench.soak.config import SoakConfig
from llamabatch.bench.soak.ledger import Dispenser, Gate, Holder, Ledger, Life
from llamabatch.bench.soak.workload import Workload
from llamabatch.errors import EngineClosed, QueueFull


class Clients:
    """The client side of the soak (a part of ``run._Soak``): the state it shares with the
    controller is set up by ``_Soak.__init__``."""

    config: SoakConfig
    workload: Workload
    ledger: Ledger
    holder: Holder
    gate: Gate
    dispenser: Dispenser
    stop: threading.Event

    # -- the clients ---------------------------------------------------------------------------

    def start_clients(self) -> list[threading.Thread]:
        """Start the client threads (and the asyncio client's, with more than one thread)."""
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
