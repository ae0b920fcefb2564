"""A static batch driven straight through the binding, with no scheduler: the engine's ceiling.

This runner uses llamabatch's binding (``Model``, ``Context``, the batch pool) on purpose:
it measures what llama.cpp alone does with the same batch, so that the engine's overhead
shows as the difference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from llamabatch.bench.report import RunResult, result_from_times
from llamabatch.bench.runners.base import RAW, BenchConfig
from llamabatch.bench.workloads import BenchRequest

__all__ = ["RawRunner"]


class RawRunner:
    """A static batch through the binding, with no scheduler.

    Prefill: every sequence's prompt, packed into batches of up to ``n_batch`` tokens, the
    last prompt token of each sequence requesting logits; the first token of each sequence
    is chosen right after the decode that held its last prompt token. Then ``ntg - 1``
    decode steps of one token per sequence. Greedy: the argmax of each output's logits row
    (``Context.logits_rows``, as the engine does for greedy requests). No detokenization,
    stop checks or delivery. Batched workload only.
    """

    name = RAW

    def __init__(self, config: BenchConfig, n_seq: int, n_ctx: int) -> None:
        from llamabatch._core.batch import BatchPool
        from llamabatch._ffi.context import Context
        from llamabatch._ffi.model import Model

        self.config = config
        self.n_seq = n_seq
        self.model = Model(config.model)
        try:
            self.context = Context(
                self.model,
                n_ctx=n_ctx,
                n_batch=config.n_batch,
                n_ubatch=config.micro_batch,
                n_seq_max=n_seq,
                n_threads=config.threads,
                flash_attn=config.flash_attn,
                kv_unified=config.kv_unified,
            )
        except BaseException:
            self.model.close()
            raise
        self.pool = BatchPool(config.n_batch, 1)
        self.batch = self.pool.acquire()

    def _decode(self) -> float:
        from llamabatch._ffi.context import check_decode

        t0 = time.perf_counter()
        code = self.context.decode_address(self.batch.address)
        elapsed = time.perf_counter() - t0
        check_decode(code)
        return elapsed

    def warmup(self, tokens: Sequence[int]) -> None:
        """Decode a few tokens once, then empty the KV cache."""
        self.batch.clear()
        for i, t in enumerate(tokens[:8]):
            self.batch.add(t, i, 0, i == len(tokens[:8]) - 1)
        self._decode()
        self.context.memory_clear()

    def run(
        self, requests: Sequence[BenchRequest], workload: str, npl: int, rate: float | None = None
    ) -> RunResult:
        """Run the static batch of ``requests`` (all must have the same ``max_tokens``)."""
        n = len(requests)
        if n > self.n_seq:
            raise ValueError(f"{n} sequences but the context has n_seq_max={self.n_seq}")
        ntg = requests[0].max_tokens
        if any(r.max_tokens != ntg for r in requests):
            raise ValueError("the raw runner needs one ntg for every sequence (a static batch)")
        context, batch, capacity = self.context, self.batch, self.config.n_batch
        context.memory_clear()
        decode_time = 0.0
        ticks = 0
        first = [0.0] * n
        current = [0] * n
        step_times: list[float] = []

        start = time.perf_counter()
        # Prefill: sequence s's prompt at positions 0..npp-1, n_batch tokens per decode.
        batch.clear()
        finals: list[tuple[int, int]] = []  # (seq, batch index) of last prompt tokens
        for s, request in enumerate(requests):
            prompt = request.prompt
            last = len(prompt) - 1
            for pos, token in enumerate(prompt):
                if batch.n_tokens == capacity:
                    decode_time += self._decode()
                    ticks += 1
                    self._sample_finals(finals, current, first)
                    finals.clear()
                    batch.clear()
                if pos == last:
                    finals.append((s, batch.n_tokens))
                batch.add(token, pos, s, pos == last)
        decode_time += self._decode()
        ticks += 1
        self._sample_finals(finals, current, first)
        # Generation: ntg - 1 steps of one token per sequence, every one an output.
        positions = [len(r.prompt) for r in requests]
        for _ in range(ntg - 1):
            batch.clear()
            for s in range(n):
                batch.add(current[s], positions[s], s, True)
                positions[s] += 1
            decode_time += self._decode()
            ticks += 1
            current = context.logits_rows(n).argmax(axis=1).tolist()
            step_times.append(time.perf_counter())
        end_time = time.perf_counter()
        context.memory_clear()

        itl: list[float] = []
        if step_times:
            gaps = np.diff([max(first), *step_times]).tolist()
            # Each sequence's first gap runs from its own first token.
            for s in range(n):
                itl.append(step_times[0] - first[s])
                itl.extend(gaps[1:])
        result = result_from_times(
            self.name, workload, requests, first, [end_time] * n, [ntg] * n, itl, start, npl, rate
        )
        result.decode_time = decode_time
        result.ticks = ticks
        result.tick_time = end_time - start
        return result

    def _sample_finals(self, finals: list[tuple[int, int]], current: list[int], first: list[float]) -> None:
        # The batch's outputs are exactly the sequences' last prompt tokens, in batch order.
        tokens = self.context.logits_rows(len(finals)).argmax(axis=1).tolist()
        for (s, _), token in zip(finals, tokens, strict=True):
            current[s] = token
        now = time.perf_counter()
        for s, _ in finals:
            first[s] = now

    def close(self) -> None:
        """Free the batch, the context and the model."""
        self.pool.release(self.batch)
        self.context.close()
        self.model.close()
