"""The llamabatch engine as a runner, through the public API only (``LLM``,
``SamplingParams``, tick events, ``stats()``)."""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from llamabatch import LLM, CompletionOutput, RequestOutput, SamplingParams, TickEvent
from llamabatch.bench.report import RunResult, result_from_times
from llamabatch.bench.runners.base import ENGINE, BenchConfig, wait_until
from llamabatch.bench.workloads import BenchRequest

__all__ = ["EngineRunner", "completion", "engine_counters"]

# Consumer threads kept for the engine's streamed requests of one run.
_MAX_STREAM_THREADS = 1024


def completion(output: RequestOutput) -> CompletionOutput:
    """The (first) completion of what ``LLM.generate`` returns per prompt and
    ``RequestHandle.result()`` returns."""
    return output.outputs[0]


def engine_counters(llm: LLM) -> tuple[float, float, int]:
    """The engine's running totals: seconds inside ``llama_decode``, seconds of whole ticks,
    ticks."""
    stats = llm.stats()
    return stats.decode_time_s, stats.tick_time_s, stats.ticks


class EngineRunner:
    """The llamabatch engine (:class:`llamabatch.LLM`) with ``n_parallel`` slots.

    Inter-token latency comes from the engine's tick events unless ``config.stream``: every
    token sampled for a sequence that already had one (a tick's ``decode_tokens``) is
    counted with the time since the previous tick ended. That is exact when every
    generating sequence decodes every tick (``decode_maximal``, the default, with
    ``n_batch >= n_parallel``) and costs nothing. With ``config.stream`` each request is
    consumed as a stream by a thread of its own that timestamps every delta: the latency a
    streaming client sees, at the price of those threads.
    """

    def __init__(self, config: BenchConfig, n_parallel: int, n_ctx: int, name: str = ENGINE) -> None:
        self.name = name
        self.config = config
        self.n_parallel = n_parallel
        self.llm = LLM(
            config.model,
            n_ctx=n_ctx,
            n_parallel=n_parallel,
            n_batch=config.n_batch,
            n_ubatch=config.micro_batch,
            chunk_size=config.chunk_size,
            strategy=config.strategy,
            n_threads=config.threads,
            flash_attn=config.flash_attn,
            max_queue=1 << 20,
            prefix_cache=config.prefix_cache,
            kv_unified=config.kv_unified,
            type_k=config.type_k,
            type_v=config.type_v,
            target_itl_ms=config.target_itl_ms,
            slo_ttft_ms=config.slo_ttft_ms,  # the engine schedules for the SLO it is measured by
            slo_itl_ms=config.slo_itl_ms,
            cache_ram=config.cache_ram,
            speculative_config=config.speculative_config,
        )
        self._ticks: list[tuple[float, int]] = []
        self.llm.add_listener(self._on_event)

    def _on_event(self, event: Any) -> None:
        if isinstance(event, TickEvent):
            self._ticks.append((time.perf_counter(), event.decode_tokens))

    def warmup(self, tokens: Sequence[int]) -> None:
        """A few tokens through the engine (pages the weights in, builds the graphs)."""
        prompt = list(tokens[:8])
        self.llm.generate(
            [prompt] * min(2, self.n_parallel), SamplingParams(max_tokens=2, temperature=0), use_tqdm=False
        )

    def run(
        self, requests: Sequence[BenchRequest], workload: str, npl: int, rate: float | None = None
    ) -> RunResult:
        """Serve ``requests``, each submitted at its arrival time; wait for all of them.

        Requests that all arrive at 0 (the batched workload) go through one
        ``LLM.generate`` call, so they reach the engine together, unless streaming."""
        params = {
            m: SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
            for m in {r.max_tokens for r in requests}
        }
        stream = self.config.stream and len(requests) <= _MAX_STREAM_THREADS
        self._ticks.clear()
        decode_before, tick_before, ticks_before = engine_counters(self.llm)
        if not stream and all(r.arrival == 0 for r in requests):
            submitted, stamps, outputs, start = self._run_generate(requests, params)
        else:
            submitted, stamps, outputs, start = self._run_submit(requests, params, stream)
        decode_after, tick_after, ticks_after = engine_counters(self.llm)

        first, end, counts, itl = [], [], [], []
        for i, out in enumerate(outputs):
            if out.finish_reason != "length" or len(out.token_ids) != requests[i].max_tokens:
                raise RuntimeError(
                    f"request {i} ended {out.finish_reason!r} after {len(out.token_ids)} tokens "
                    f"(expected {requests[i].max_tokens}): {out.error or ''}"
                )
            ttft = out.timings.time_to_first_token
            assert ttft is not None
            first.append(submitted[i] + ttft)
            end.append(submitted[i] + out.timings.total)
            counts.append(len(out.token_ids))
            if stream:
                itl.extend(np.diff(stamps[i]).tolist())
        series: list[tuple[float, float]] = []
        if not stream:
            for (t_prev, _), (t, n_decode) in itertools.pairwise(list(self._ticks)):
                itl.extend([t - t_prev] * n_decode)
                if n_decode:
                    series.append((t - start, t - t_prev))
        result = result_from_times(
            self.name, workload, requests, first, end, counts, itl, start, npl, rate, stamps=stamps or None
        )
        if not stream:  # each request's largest gap from its output; the series from the ticks
            result.request_itl = [
                math.nan if o.timings.itl_max is None else o.timings.itl_max for o in outputs
            ]
            result.itl_series = series
        result.decode_time = decode_after - decode_before
        result.tick_time = tick_after - tick_before
        result.ticks = ticks_after - ticks_before
        if stream:
            result.notes.append("itl: streamed (a consumer thread per request)")
        drafted = sum(o.timings.spec_draft_tokens for o in outputs)
        if drafted:  # speculative decoding: tick-based ITL counts one token per stream and tick
            accepted = sum(o.timings.spec_accepted_tokens for o in outputs)
            result.notes.append(
                f"speculative: {accepted}/{drafted} draft tokens accepted ({accepted / drafted:.0%})"
            )
        return result

    def _run_generate(
        self, requests: Sequence[BenchRequest], params: dict[int, SamplingParams]
    ) -> tuple[list[float], list[list[float]], list[CompletionOutput], float]:
        prompts = [list(r.prompt) for r in requests]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, [params[r.max_tokens] for r in requests], use_tqdm=False)
        return [start] * len(requests), [], [completion(o) for o in outputs], start

    def _run_submit(
        self, requests: Sequence[BenchRequest], params: dict[int, SamplingParams], stream: bool
    ) -> tuple[list[float], list[list[float]], list[CompletionOutput], float]:
        n = len(requests)
        order = sorted(range(n), key=lambda i: requests[i].arrival)
        submitted = [0.0] * n
        handles: list[Any] = [None] * n
        stamps: list[list[float]] = [[] for _ in range(n)]
        inbox: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()

        def consume() -> None:
            now = time.perf_counter
            while (item := inbox.get()) is not None:
                i, handle = item
                times = stamps[i]
                for delta in handle:
                    if delta.token_ids:
                        t = now()
                        times.extend([t] * len(delta.token_ids))

        threads = [threading.Thread(target=consume, daemon=True) for _ in range(n if stream else 0)]
        for thread in threads:
            thread.start()
        start = time.perf_counter()
        try:
            for i in order:
                wait_until(start + requests[i].arrival)
                submitted[i] = time.perf_counter()
                handles[i] = self.llm.submit(list(requests[i].prompt), params[requests[i].max_tokens])
                if stream:
                    inbox.put((i, handles[i]))
            outputs = [completion(h.result()) for h in handles]
        finally:
            for _ in threads:
                inbox.put(None)
            for thread in threads:
                thread.join()
        return submitted, stamps, outputs, start

    def close(self) -> None:
        """Stop the engine and free the model."""
        self.llm.close()
