"""Generation benchmarks: the engine against a raw static batch and llama-cpp-python.

Two workloads, each run through up to three *runners* on exactly the same requests:

``batched`` (llama-batched-bench's workload)
    For every ``npl``: ``npl`` requests of ``npp`` prompt tokens and ``ntg`` generated tokens,
    all submitted at once.
``mixed``
    ``n_requests`` requests arriving as a Poisson process at ``rate`` requests/s, with prompt
    and output lengths drawn from a weighted mix (e.g. chat-like, balanced, RAG-like).

Runners:

``llamabatch``
    the engine (:class:`llamabatch.LLM`), ``n_parallel = npl`` for the batched workload.
``raw``
    the same static batch driven straight through the binding (``Context``, ``Batch``,
    ``SamplerChain``) with no scheduler, no detokenization and no delivery: prefill every
    sequence, then ``ntg - 1`` decode steps of ``npl`` tokens with greedy sampling. It is the
    ceiling for the engine (batched workload only).
``llama-cpp-python``
    ``llama_cpp.Llama.create_completion`` serving the same requests one after another (what
    a llama-cpp-python user has), with the same thread count, batch size and flash-attention
    setting.

Every runner generates exactly ``ntg`` tokens per request (greedy, end-of-generation ignored)
from the same prompt token ids, so the work is identical. Metrics per run (see
:meth:`RunResult.row`):

- ``total_tokens_per_s``: (prompt + generated tokens) / wall time;
- ``gen_tokens_per_s``: generated tokens / wall time (the aggregate generation rate);
- ``prompt_tokens_per_s``: prompt tokens / ``t_pp``, the time until every request had its
  first token (the prefill phase; for the sequential runner, the sum of its requests'
  prefill times); batched workload only;
- ``decode_tokens_per_s``: tokens generated after the first / (wall time - ``t_pp``);
  batched workload only;
- time to first token (from each request's arrival) and inter-token latency (gaps between
  consecutive tokens of a request) percentiles, in milliseconds;
- for the engine and the raw loop: the time spent inside ``llama_decode`` and the share of
  wall time outside it.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "RUNNERS",
    "BenchConfig",
    "BenchRequest",
    "EngineRunner",
    "LlamaCppRunner",
    "RawRunner",
    "RunResult",
    "batched_requests",
    "format_ratios",
    "format_table",
    "make_prompts",
    "mixed_requests",
    "parse_mix",
    "plot_results",
    "ratio_rows",
    "resolve_model",
    "run_batched",
    "run_mixed",
]

ENGINE = "llamabatch"
RAW = "raw"
LLAMA_CPP_PYTHON = "llama-cpp-python"
#: The runner names, in the order their rows are printed.
RUNNERS = (ENGINE, RAW, LLAMA_CPP_PYTHON)

#: The default request mix of the mixed workload: (prompt tokens, generated tokens, weight).
DEFAULT_MIX = ((16, 128, 1.0), (128, 64, 1.0), (512, 16, 1.0))

# Consumer threads kept for the engine's streamed requests of one run.
_MAX_STREAM_THREADS = 1024
# Prompts of a workload that get a first token of their own (the check scans the text).
_MAX_DISTINCT_STARTS = 256


# ---------------------------------------------------------------------------------------------
# Configuration and requests
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """Settings shared by every runner of a benchmark.

    Args:
        model: the GGUF file.
        n_threads: CPU threads for llama.cpp (default: all cores); the same for every runner.
        n_ctx: KV cache size; ``None`` sizes it to the workload (every sequence fits).
        n_batch: the most tokens per ``llama_decode`` (the engine's per-tick budget).
        n_ubatch: llama.cpp's physical micro-batch (default ``n_batch``).
        chunk_size: the engine's prefill chunk per sequence and tick.
        strategy: the engine's batching strategy.
        flash_attn: flash attention on or off (llama-cpp-python only takes a bool).
        n_parallel: the engine's slots; ``None``: ``npl`` (batched) or 16 (mixed).
        stream: consume the engine's requests as streams, a thread each, and time every
            delta (see :class:`EngineRunner`); without it the inter-token latency comes from
            the engine's tick events.
        warmup: run a few tokens through each runner before timing it.
        seed: the seed of the prompts and of the mixed workload's arrivals.
        prefix_cache: let the engine reuse cached prompt prefixes (off by default: the raw
            loop recomputes every prompt; the prompts of a workload share no prefix anyway).
        kv_unified: one KV buffer shared by all sequences (llamabatch's default), or a
            stream per sequence, whose attention then spans only its own cells (the engine
            and the raw loop).
    """

    model: Path
    n_threads: int | None = None
    n_ctx: int | None = None
    n_batch: int = 512
    n_ubatch: int | None = None
    chunk_size: int = 512
    strategy: str = "decode_maximal"
    flash_attn: bool = False
    n_parallel: int | None = None
    stream: bool = False
    warmup: bool = True
    seed: int = 0
    prefix_cache: bool = False
    kv_unified: bool = True

    @property
    def threads(self) -> int:
        """The thread count every runner uses."""
        return self.n_threads if self.n_threads is not None else (os.cpu_count() or 1)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: prompt token ids, tokens to generate, arrival time (seconds
    after the workload starts)."""

    prompt: tuple[int, ...]
    max_tokens: int
    arrival: float = 0.0


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF to benchmark: a path, or a test-model preset name (``tiny``, ``small``,
    ``135m``; built and cached on first use); ``None`` is the ``135m`` preset."""
    from llamabatch import testing

    if model is None:
        return testing.model_path("135m")
    path = Path(model)
    if not path.exists() and str(model) in testing.PRESETS:
        return testing.model_path(str(model))
    if not path.is_file():
        raise FileNotFoundError(f"no model file {path} (nor a test-model preset: {sorted(testing.PRESETS)})")
    return path


def _text_token_pool(model: Any, min_tokens: int) -> list[int]:
    """Token ids of English text, at least ``min_tokens`` of them (repeated when needed)."""
    from llamabatch.testing import english_sentences

    sentences = english_sentences(400)
    pool = model.tokenize(" ".join(sentences), add_special=False)
    if not pool:
        raise ValueError("the model tokenizes English text to nothing")
    while len(pool) < min_tokens + 1:
        pool = pool + pool
    return pool


def make_prompts(model: Any, lengths: Sequence[int], seed: int = 0) -> list[tuple[int, ...]]:
    """Prompts of exactly ``lengths[i]`` token ids each, cut from English text at random
    (seeded) offsets. No two prompts start with the same token while the text has unused
    first tokens left (checked for the first 256 prompts), so no runner can reuse a cached
    prefix of another request. ``model``
    is anything with ``tokenize(text, add_special=...)``
    (:class:`llamabatch._ffi.model.Model`)."""
    if not lengths:
        return []
    if min(lengths) < 1:
        raise ValueError("prompt lengths must be >= 1")
    pool = _text_token_pool(model, max(lengths))
    rng = random.Random(seed)
    used: set[int] = set()
    distinct = len(set(pool))
    prompts: list[tuple[int, ...]] = []
    for k, length in enumerate(lengths):
        limit = len(pool) - length
        start = rng.randrange(limit + 1)
        if len(used) < distinct and k < _MAX_DISTINCT_STARTS:
            for _ in range(limit + 1):
                if pool[start] not in used:
                    break
                start = (start + 1) % (limit + 1)
        prompt = tuple(pool[start : start + length])
        used.add(prompt[0])
        prompts.append(prompt)
    return prompts


def batched_requests(model: Any, npp: int, ntg: int, npl: int, seed: int = 0) -> list[BenchRequest]:
    """llama-batched-bench's workload: ``npl`` requests of ``npp`` prompt tokens and ``ntg``
    generated tokens, all arriving at time 0."""
    prompts = make_prompts(model, [npp] * npl, seed=seed * 1_000_003 + npp * 1009 + npl)
    return [BenchRequest(p, ntg, 0.0) for p in prompts]


def _warm_prompt(requests: Sequence[BenchRequest]) -> tuple[int, ...]:
    """An 8-token warm-up prompt that shares no first token with ``requests``."""
    firsts = {r.prompt[0] for r in requests}
    for r in requests:
        for k in range(1, len(r.prompt)):
            if r.prompt[k] not in firsts:
                return tuple(r.prompt[k : k + 8])
    return tuple(requests[0].prompt[-8:])


def parse_mix(text: str) -> tuple[tuple[int, int, float], ...]:
    """Parse a request mix ``"NPP:NTG[:WEIGHT],..."`` (e.g. ``"16:128,512:16:2"``)."""
    mix = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"bad mix entry {item!r}: expected NPP:NTG or NPP:NTG:WEIGHT")
        try:
            npp, ntg = int(parts[0]), int(parts[1])
            weight = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ValueError(f"bad mix entry {item!r}: NPP and NTG must be ints, WEIGHT a number") from None
        if npp < 1 or ntg < 1 or not weight > 0:
            raise ValueError(f"bad mix entry {item!r}: NPP, NTG and WEIGHT must be positive")
        mix.append((npp, ntg, weight))
    if not mix:
        raise ValueError("empty request mix")
    return tuple(mix)


def mixed_requests(
    model: Any,
    n_requests: int,
    rate: float,
    mix: Sequence[tuple[int, int, float]] = DEFAULT_MIX,
    seed: int = 0,
) -> list[BenchRequest]:
    """``n_requests`` requests arriving as a Poisson process of ``rate`` requests/s (the first
    at time 0), each with a (prompt, output) length pair drawn from ``mix`` by weight."""
    if n_requests < 1:
        raise ValueError("n_requests must be >= 1")
    if not rate > 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    kinds = rng.choices(range(len(mix)), weights=[w for _, _, w in mix], k=n_requests)
    arrivals = [0.0]
    for _ in range(n_requests - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    prompts = make_prompts(model, [mix[k][0] for k in kinds], seed=seed + 7)
    return [BenchRequest(p, mix[k][1], t) for p, k, t in zip(prompts, kinds, arrivals, strict=True)]


def _auto_n_ctx(requests: Sequence[BenchRequest], n_parallel: int, unified: bool = True) -> int:
    """A KV cache that holds the ``n_parallel`` longest requests at once (multiple of 256).
    Without a unified KV cache every sequence gets ``n_ctx / n_parallel`` cells of its own,
    so each must hold the longest request."""
    lengths = sorted((len(r.prompt) + r.max_tokens for r in requests), reverse=True)
    if not unified:
        return n_parallel * max(256, -(-lengths[0] // 256) * 256)
    need = sum(lengths[:n_parallel])
    return max(256, -(-need // 256) * 256)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def _percentiles(values: Sequence[float], scale: float = 1000.0) -> tuple[float, float, float]:
    if len(values) == 0:
        return (math.nan, math.nan, math.nan)
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return (float(p50) * scale, float(p90) * scale, float(p99) * scale)


@dataclass
class RunResult:
    """What one runner did on one workload (times in seconds)."""

    runner: str
    workload: str
    npp: int
    ntg: int
    npl: int
    n_requests: int
    prompt_tokens: int
    gen_tokens: int
    t_pp: float
    t_total: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    decode_time: float | None = None
    ticks: int | None = None
    tick_time: float | None = None
    rate: float | None = None
    notes: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """One flat, JSON-ready dict (the ``--json`` row)."""
        t_tg = max(self.t_total - self.t_pp, 1e-12)
        ttft = _percentiles(self.ttft)
        itl = _percentiles(self.itl)
        e2e = _percentiles(self.e2e)
        row: dict[str, Any] = {
            "workload": self.workload,
            "runner": self.runner,
            "npp": self.npp,
            "ntg": self.ntg,
            "npl": self.npl,
            "n_requests": self.n_requests,
            "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens,
            "t_pp_s": self.t_pp,
            "t_tg_s": self.t_total - self.t_pp,
            "t_total_s": self.t_total,
            "prompt_tokens_per_s": self.prompt_tokens / self.t_pp if self.t_pp > 0 else math.nan,
            "decode_tokens_per_s": max(self.gen_tokens - self.n_requests, 0) / t_tg,
            "gen_tokens_per_s": self.gen_tokens / self.t_total,
            "total_tokens_per_s": (self.prompt_tokens + self.gen_tokens) / self.t_total,
            "requests_per_s": self.n_requests / self.t_total,
            "ttft_p50_ms": ttft[0],
            "ttft_p90_ms": ttft[1],
            "ttft_p99_ms": ttft[2],
            "itl_p50_ms": itl[0],
            "itl_p90_ms": itl[1],
            "itl_p99_ms": itl[2],
            "e2e_p50_ms": e2e[0],
            "e2e_p90_ms": e2e[1],
            "e2e_p99_ms": e2e[2],
        }
        if self.workload == "mixed":
            # Requests overlap at random: there are no prefill and decode phases to time.
            row.update(t_pp_s=None, t_tg_s=None, prompt_tokens_per_s=None, decode_tokens_per_s=None)
        if self.rate is not None:
            row["rate"] = self.rate
        if self.decode_time is not None:
            row["decode_time_s"] = self.decode_time
            row["outside_decode_share"] = max(0.0, 1.0 - self.decode_time / self.t_total)
        if self.ticks is not None:
            row["ticks"] = self.ticks
            if self.ticks and self.tick_time is not None and self.decode_time is not None:
                row["overhead_per_tick_us"] = (self.tick_time - self.decode_time) / self.ticks * 1e6
        if self.notes:
            row["notes"] = list(self.notes)
        return row


def _finish(
    runner: str,
    workload: str,
    requests: Sequence[BenchRequest],
    first: Sequence[float],
    end: Sequence[float],
    gen_counts: Sequence[int],
    itl: list[float],
    start: float,
    npl: int,
    rate: float | None,
    t_pp: float | None = None,
) -> RunResult:
    """Build a :class:`RunResult` from absolute per-request times; the prefill phase lasts
    until the last first token unless ``t_pp`` (the sequential runner's sum) is given."""
    arrivals = [start + r.arrival for r in requests]
    t_total = max(end) - start
    return RunResult(
        runner=runner,
        workload=workload,
        npp=round(sum(len(r.prompt) for r in requests) / len(requests)),
        ntg=round(sum(r.max_tokens for r in requests) / len(requests)),
        npl=npl,
        n_requests=len(requests),
        prompt_tokens=sum(len(r.prompt) for r in requests),
        gen_tokens=sum(gen_counts),
        t_pp=max(first) - start if t_pp is None else t_pp,
        t_total=t_total,
        ttft=[f - a for f, a in zip(first, arrivals, strict=True)],
        itl=itl,
        e2e=[e - a for e, a in zip(end, arrivals, strict=True)],
        rate=rate,
    )


# ---------------------------------------------------------------------------------------------
# Runners
# ---------------------------------------------------------------------------------------------


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


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

    name = ENGINE

    def __init__(self, config: BenchConfig, n_parallel: int, n_ctx: int) -> None:
        import inspect

        from llamabatch import LLM

        self.config = config
        self.n_parallel = n_parallel
        extra: dict[str, Any] = {}
        accepted = inspect.signature(LLM).parameters
        if "prefix_cache" in accepted:
            extra["prefix_cache"] = config.prefix_cache
        if "max_prefixes" in accepted and not config.prefix_cache:
            extra["max_prefixes"] = 0  # no pinned-prefix sequences: n_seq_max = n_parallel
        if "kv_unified" in accepted:
            extra["kv_unified"] = config.kv_unified
        elif not config.kv_unified:
            raise ValueError("this llamabatch has no kv_unified option")
        self.llm = LLM(
            config.model,
            n_ctx=n_ctx,
            n_parallel=n_parallel,
            n_batch=config.n_batch,
            n_ubatch=config.n_ubatch,
            chunk_size=config.chunk_size,
            strategy=config.strategy,
            n_threads=config.threads,
            flash_attn=config.flash_attn,
            max_queue=1 << 20,
            **extra,
        )
        self._ticks: list[tuple[float, int]] = []
        self.llm.add_listener(self._on_event)

    def _on_event(self, event: Any) -> None:
        decode_tokens = getattr(event, "decode_tokens", None)
        if decode_tokens is not None:  # a TickEvent
            self._ticks.append((time.perf_counter(), decode_tokens))

    def warmup(self, tokens: Sequence[int]) -> None:
        """A few tokens through the engine (pages the weights in, builds the graphs)."""
        from llamabatch import SamplingParams

        prompt = list(tokens[:8])
        self.llm.generate([prompt] * min(2, self.n_parallel), SamplingParams(max_tokens=2, temperature=0))

    def run(
        self, requests: Sequence[BenchRequest], workload: str, npl: int, rate: float | None = None
    ) -> RunResult:
        """Serve ``requests``, each submitted at its arrival time; wait for all of them.

        Requests that all arrive at 0 (the batched workload) go through one
        ``LLM.generate`` call, so they reach the engine together, unless streaming."""
        from llamabatch import SamplingParams

        llm = self.llm
        params = {
            m: SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
            for m in {r.max_tokens for r in requests}
        }
        stream = self.config.stream and len(requests) <= _MAX_STREAM_THREADS
        self._ticks.clear()
        before = llm.stats()
        if not stream and all(r.arrival == 0 for r in requests):
            submitted, stamps, outputs, start = self._run_generate(requests, params)
        else:
            submitted, stamps, outputs, start = self._run_submit(requests, params, stream)
        after = llm.stats()

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
        if not stream:
            ticks = list(self._ticks)
            for (t_prev, _), (t, n_decode) in itertools.pairwise(ticks):
                itl.extend([t - t_prev] * n_decode)
        result = _finish(self.name, workload, requests, first, end, counts, itl, start, npl, rate)
        result.decode_time = after["decode_time_s"] - before["decode_time_s"]
        result.tick_time = after["tick_time_s"] - before["tick_time_s"]
        result.ticks = after["ticks"] - before["ticks"]
        if stream:
            result.notes.append("itl: streamed (a consumer thread per request)")
        return result

    def _run_generate(
        self, requests: Sequence[BenchRequest], params: dict[int, Any]
    ) -> tuple[list[float], list[list[float]], list[Any], float]:
        prompts = [list(r.prompt) for r in requests]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, [params[r.max_tokens] for r in requests])
        return [start] * len(requests), [], outputs, start

    def _run_submit(
        self, requests: Sequence[BenchRequest], params: dict[int, Any], stream: bool
    ) -> tuple[list[float], list[list[float]], list[Any], float]:
        llm = self.llm
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
                _wait_until(start + requests[i].arrival)
                submitted[i] = time.perf_counter()
                handles[i] = llm.submit(list(requests[i].prompt), params[requests[i].max_tokens])
                if stream:
                    inbox.put((i, handles[i]))
            outputs = [h.result() for h in handles]
        finally:
            for _ in threads:
                inbox.put(None)
            for thread in threads:
                thread.join()
        return submitted, stamps, outputs, start

    def close(self) -> None:
        """Stop the engine and free the model."""
        self.llm.close()


class RawRunner:
    """A static batch through the binding, with no scheduler: the engine's ceiling.

    Prefill: every sequence's prompt, packed into batches of up to ``n_batch`` tokens, the
    last prompt token of each sequence requesting logits; the first token of each sequence
    is chosen right after the decode that held its last prompt token. Then ``ntg - 1``
    decode steps of one token per sequence. Greedy: the argmax of each output's logits row
    (``Context.logits_rows``, as the engine does for greedy requests). No detokenization,
    stop checks or delivery.
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
                n_ubatch=config.n_ubatch,
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
        result = _finish(
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


class LlamaCppRunner:
    """llama-cpp-python serving the requests one after another, as its users would.

    Each request is ``Llama.create_completion(prompt_token_ids, max_tokens=ntg,
    temperature=0)``; a request arriving while another runs waits. Token times come from a
    stopping-criteria callback that llama-cpp-python calls once per sampled token and that
    never stops the generation. A request that ends early on an end-of-generation token is
    run again with those tokens banned (logit bias), and the row says so.
    """

    name = LLAMA_CPP_PYTHON

    def __init__(self, config: BenchConfig, n_ctx: int) -> None:
        try:
            import llama_cpp
        except ImportError as exc:  # pragma: no cover - a dependency of llamabatch
            raise RuntimeError("--compare llama-cpp-python needs the llama-cpp-python package") from exc
        self.config = config
        self.n_ctx = n_ctx
        self.llama = llama_cpp.Llama(
            str(config.model),
            n_ctx=n_ctx,
            n_batch=config.n_batch,
            n_ubatch=config.n_ubatch or config.n_batch,
            n_threads=config.threads,
            n_threads_batch=config.threads,
            flash_attn=config.flash_attn,
            verbose=False,
        )
        vocab = _load_tokenizer(config)
        try:
            self._eog = [t for t in range(vocab.n_vocab) if vocab.is_eog(t)]
        finally:
            vocab.close()

    def warmup(self, tokens: Sequence[int]) -> None:
        """Two tokens from a short prompt."""
        self.llama.create_completion(list(tokens[:8]), max_tokens=2, temperature=0)
        self.llama.reset()

    def _complete(self, request: BenchRequest, ban_eog: bool) -> tuple[list[float], int]:
        from llama_cpp import StoppingCriteriaList

        stamps: list[float] = []
        now = time.perf_counter

        def stamp(_ids: Any, _logits: Any) -> bool:
            stamps.append(now())
            return False

        out = self.llama.create_completion(
            list(request.prompt),
            max_tokens=request.max_tokens,
            temperature=0,
            repeat_penalty=1.0,
            stopping_criteria=StoppingCriteriaList([stamp]),
            logit_bias={t: -math.inf for t in self._eog} if ban_eog else None,
        )
        n = int(out["usage"]["completion_tokens"])  # type: ignore[index]
        return stamps[:n], n

    def run(
        self, requests: Sequence[BenchRequest], workload: str, npl: int, rate: float | None = None
    ) -> RunResult:
        """Serve ``requests`` in arrival order, one at a time."""
        n = len(requests)
        order = sorted(range(n), key=lambda i: requests[i].arrival)
        first, end, counts = [0.0] * n, [0.0] * n, [0] * n
        itl: list[float] = []
        banned = 0
        t_pp = 0.0
        start = time.perf_counter()
        for i in order:
            request = requests[i]
            _wait_until(start + request.arrival)
            t_begin = time.perf_counter()
            stamps, count = self._complete(request, ban_eog=False)
            if count < request.max_tokens:
                banned += 1
                stamps, count = self._complete(request, ban_eog=True)
            end[i] = time.perf_counter()
            if count != request.max_tokens or not stamps:
                raise RuntimeError(
                    f"llama-cpp-python generated {count} tokens, expected {request.max_tokens}"
                )
            first[i] = stamps[0]
            t_pp += stamps[0] - t_begin
            counts[i] = count
            itl.extend(np.diff(stamps).tolist())
        self.llama.reset()
        result = _finish(self.name, workload, requests, first, end, counts, itl, start, npl, rate, t_pp)
        if banned:
            result.notes.append(f"{banned} request(s) re-run with end-of-generation tokens banned")
        return result

    def close(self) -> None:
        """Free the model."""
        self.llama.close()


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------

Progress = Callable[[str], None]


def _best_run(results: list[RunResult]) -> RunResult:
    """The repeat with the shortest wall time (as ``timeit`` does: on a shared machine noise
    only ever slows a run down)."""
    chosen = min(results, key=lambda r: r.t_total)
    if len(results) > 1:
        chosen.notes.append(
            f"best of {len(results)} runs (t_total {', '.join(f'{r.t_total:.3f}' for r in results)} s)"
        )
    return chosen


def _load_tokenizer(config: BenchConfig) -> Any:
    """The model, for its vocabulary (mmap: the weights are not read). ``vocab_only`` is
    avoided: llama.cpp aborts on ``llama_model_n_head`` for a vocab-only model."""
    from llamabatch._ffi.model import Model

    return Model(config.model)


def run_batched(
    config: BenchConfig,
    npps: Sequence[int],
    ntgs: Sequence[int],
    npls: Sequence[int],
    runners: Sequence[str] = (ENGINE,),
    repeat: int = 1,
    progress: Progress | None = None,
) -> list[RunResult]:
    """llama-batched-bench's grid (every ``npp`` x ``ntg`` x ``npl``) through ``runners``;
    repeats are interleaved (engine, raw, llama-cpp-python, engine, ...) and the fastest run
    of each is kept. ``progress(label)`` is called after every run."""
    _check_runners(runners)
    vocab = _load_tokenizer(config)
    try:
        grid = [
            (npp, ntg, npl, batched_requests(vocab, npp, ntg, npl, config.seed))
            for npp in npps
            for ntg in ntgs
            for npl in npls
        ]
    finally:
        vocab.close()
    warm_tokens = _warm_prompt([r for *_, reqs in grid for r in reqs])
    results: list[RunResult] = []
    lcp = None
    if LLAMA_CPP_PYTHON in runners:
        n_ctx = config.n_ctx or max(_auto_n_ctx(reqs, 1) for *_, reqs in grid)
        lcp = LlamaCppRunner(config, n_ctx)
        if config.warmup:
            lcp.warmup(warm_tokens)
    try:
        for npp, ntg, npl, requests in grid:
            n_parallel = config.n_parallel or npl
            n_ctx = config.n_ctx or _auto_n_ctx(requests, n_parallel, config.kv_unified)
            live: dict[str, Any] = {}
            try:
                if ENGINE in runners:
                    live[ENGINE] = EngineRunner(config, n_parallel, n_ctx)
                if RAW in runners:
                    n_ctx_raw = config.n_ctx or _auto_n_ctx(requests, npl, config.kv_unified)
                    live[RAW] = RawRunner(config, npl, n_ctx_raw)
                if lcp is not None:
                    live[LLAMA_CPP_PYTHON] = lcp
                if config.warmup:
                    for name, runner in live.items():
                        if name != LLAMA_CPP_PYTHON:
                            runner.warmup(warm_tokens)
                runs: dict[str, list[RunResult]] = {name: [] for name in live}
                for _ in range(repeat):
                    for name in RUNNERS:
                        if name in live:
                            runs[name].append(live[name].run(requests, "batched", npl))
                            if progress is not None:
                                progress(f"{name} npp={npp} ntg={ntg} npl={npl}")
                results.extend(_best_run(runs[name]) for name in RUNNERS if name in runs)
            finally:
                for name, runner in live.items():
                    if name != LLAMA_CPP_PYTHON:
                        runner.close()
    finally:
        if lcp is not None:
            lcp.close()
    return results


def run_mixed(
    config: BenchConfig,
    rates: Sequence[float],
    n_requests: int,
    mix: Sequence[tuple[int, int, float]] = DEFAULT_MIX,
    runners: Sequence[str] = (ENGINE,),
    repeat: int = 1,
    progress: Progress | None = None,
) -> list[RunResult]:
    """The mixed-arrival workload at every ``rate`` (requests/s) through ``runners`` (the raw
    runner does not apply: it serves only static batches)."""
    _check_runners(runners)
    runners = [r for r in runners if r != RAW]
    vocab = _load_tokenizer(config)
    try:
        workloads = [(rate, mixed_requests(vocab, n_requests, rate, mix, config.seed)) for rate in rates]
    finally:
        vocab.close()
    warm_tokens = _warm_prompt([r for _, reqs in workloads for r in reqs])
    n_parallel = config.n_parallel or 16
    n_ctx = config.n_ctx or max(_auto_n_ctx(reqs, n_parallel, config.kv_unified) for _, reqs in workloads)
    live: dict[str, Any] = {}
    results: list[RunResult] = []
    try:
        if ENGINE in runners:
            live[ENGINE] = EngineRunner(config, n_parallel, n_ctx)
        if LLAMA_CPP_PYTHON in runners:
            live[LLAMA_CPP_PYTHON] = LlamaCppRunner(
                config, config.n_ctx or max(_auto_n_ctx(reqs, 1) for _, reqs in workloads)
            )
        if config.warmup:
            for runner in live.values():
                runner.warmup(warm_tokens)
        for rate, requests in workloads:
            runs: dict[str, list[RunResult]] = {name: [] for name in live}
            for _ in range(repeat):
                for name in RUNNERS:
                    if name in live:
                        runs[name].append(live[name].run(requests, "mixed", n_parallel, rate))
                        if progress is not None:
                            progress(f"{name} rate={rate:g}/s")
            results.extend(_best_run(runs[name]) for name in RUNNERS if name in runs)
    finally:
        for runner in live.values():
            runner.close()
    return results


def _check_runners(runners: Iterable[str]) -> None:
    unknown = set(runners) - set(RUNNERS)
    if unknown:
        raise ValueError(f"unknown runner(s) {sorted(unknown)}; choose from {list(RUNNERS)}")


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["workload"], row["npp"], row["ntg"], row["npl"], row.get("rate"))


def ratio_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every workload point with an engine row: the engine's throughput over each other
    runner's (``total``, ``gen``) and its time to first token p50 over theirs. The ratios are
    also added to the engine rows themselves as ``vs_<runner>_total`` / ``vs_<runner>_gen``."""
    by_key: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(_key(row), {})[row["runner"]] = row
    out = []
    for key, group in by_key.items():
        engine = group.get(ENGINE)
        if engine is None:
            continue
        for name in (RAW, LLAMA_CPP_PYTHON):
            other = group.get(name)
            if other is None:
                continue
            slug = name.replace("-", "_")
            total = engine["total_tokens_per_s"] / other["total_tokens_per_s"]
            gen = engine["gen_tokens_per_s"] / other["gen_tokens_per_s"]
            engine[f"vs_{slug}_total"] = total
            engine[f"vs_{slug}_gen"] = gen
            out.append(
                {
                    "workload": key[0],
                    "npp": key[1],
                    "ntg": key[2],
                    "npl": key[3],
                    "rate": key[4],
                    "baseline": name,
                    "total_ratio": total,
                    "gen_ratio": gen,
                    "ttft_p50_ratio": engine["ttft_p50_ms"] / other["ttft_p50_ms"],
                }
            )
    return out


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("runner", "runner", "s"),
    ("npp", "PP", "d"),
    ("ntg", "TG", "d"),
    ("npl", "B", "d"),
    ("t_pp_s", "T_PP s", ".3f"),
    ("prompt_tokens_per_s", "S_PP t/s", ".1f"),
    ("t_tg_s", "T_TG s", ".3f"),
    ("decode_tokens_per_s", "S_TG t/s", ".1f"),
    ("t_total_s", "T s", ".3f"),
    ("total_tokens_per_s", "S t/s", ".1f"),
    ("gen_tokens_per_s", "gen t/s", ".1f"),
    ("ttft_p50_ms", "TTFT p50", ".1f"),
    ("ttft_p99_ms", "TTFT p99", ".1f"),
    ("itl_p50_ms", "ITL p50", ".2f"),
    ("itl_p90_ms", "ITL p90", ".2f"),
    ("itl_p99_ms", "ITL p99", ".2f"),
    ("outside_decode_share", "outside", ".1%"),
)


def _render(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in body:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the rows (times in s, latencies in ms; ``outside`` is the share of
    wall time outside ``llama_decode``)."""
    if not rows:
        return "(no results)"
    columns = list(_COLUMNS)
    if any("rate" in r for r in rows):
        columns.insert(1, ("rate", "rate/s", "g"))
    header = [c[1] for c in columns]
    body = [[_fmt(row.get(key), spec) for key, _, spec in columns] for row in rows]
    return _render(header, body)


def format_ratios(ratios: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of :func:`ratio_rows` (llamabatch / baseline)."""
    if not ratios:
        return ""
    header = ["llamabatch vs", "PP", "TG", "B", "rate/s", "total t/s", "gen t/s", "TTFT p50"]
    body = [
        [
            r["baseline"],
            str(r["npp"]),
            str(r["ntg"]),
            str(r["npl"]),
            _fmt(r["rate"], "g"),
            _fmt(r["total_ratio"], ".2f") + "x",
            _fmt(r["gen_ratio"], ".2f") + "x",
            _fmt(r["ttft_p50_ratio"], ".2f") + "x",
        ]
        for r in ratios
    ]
    return _render(header, body)


def check_plotting() -> None:
    """Raise ``RuntimeError`` with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, an optional extra: pip install 'llamabatch[plot]' "
            "(or pip install matplotlib)"
        ) from None


def plot_results(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw total and generated tokens/s against concurrency (``npl``; the arrival rate for
    the mixed workload), one line per runner and (npp, ntg); write ``path`` (PNG, SVG...)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed = any(r["workload"] == "mixed" for r in rows)
    xkey = "rate" if mixed else "npl"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for row in rows:
        label_key = (row["runner"], row["npp"], row["ntg"]) if not mixed else (row["runner"], 0, 0)
        series.setdefault(label_key, []).append(row)
    for (runner, npp, ntg), points in series.items():
        points = sorted(points, key=lambda r: r[xkey])
        xs = [p[xkey] for p in points]
        label = runner if mixed else f"{runner} (pp {npp}, tg {ntg})"
        for ax, metric in zip(axes, ("total_tokens_per_s", "gen_tokens_per_s"), strict=True):
            ax.plot(xs, [p[metric] for p in points], marker="o", label=label)
    for ax, name in zip(axes, ("total tokens/s", "generated tokens/s"), strict=True):
        ax.set_xlabel("arrival rate (requests/s)" if mixed else "parallel sequences (npl)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        if not mixed:
            ticks = sorted({r[xkey] for r in rows})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def iter_json_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    """The rows as JSON lines (NaN written as null)."""
    import json

    for row in rows:
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        yield json.dumps(clean, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Command line (``llamabatch bench``; the arguments are defined in llamabatch.cli)
# ---------------------------------------------------------------------------------------------


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} takes positive ints, got {text!r}")
    return values


def _float_list(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated numbers, got {text!r}") from None
    if not values or not min(values) > 0:
        raise ValueError(f"--{name} takes positive numbers, got {text!r}")
    return values


def run_cli(args: Any) -> int:
    """``llamabatch bench``: run the workload the parsed ``args`` ask for, print a table and
    the ratios (or JSON lines with ``--json``), draw ``--plot``. Returns the exit status."""
    import sys

    def fail(message: str) -> int:
        print(f"llamabatch bench: error: {message}", file=sys.stderr)
        return 2

    try:
        if args.plot:
            check_plotting()
        model = resolve_model(args.model)
        npps = _int_list(args.npp, "npp")
        ntgs = _int_list(args.ntg, "ntg")
        npls = _int_list(args.npl, "npl")
        rates = _float_list(args.rate, "rate")
        mix = parse_mix(args.mix) if args.mix else DEFAULT_MIX
        if args.repeat < 1:
            raise ValueError("--repeat must be >= 1")
        if args.requests < 1:
            raise ValueError("--requests must be >= 1")
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        return fail(str(exc))
    config = BenchConfig(
        model=model,
        n_threads=args.threads,
        n_ctx=args.n_ctx,
        n_batch=args.n_batch,
        n_ubatch=args.n_ubatch,
        chunk_size=args.chunk_size,
        strategy=args.strategy,
        flash_attn=args.flash_attn == "on",
        n_parallel=args.n_parallel,
        stream=args.stream,
        warmup=not args.no_warmup,
        seed=args.seed,
        prefix_cache=args.prefix_cache,
        kv_unified=args.kv_unified == "on",
    )
    runners = [ENGINE]
    if args.raw:
        runners.append(RAW)
    if args.compare:
        runners.append(LLAMA_CPP_PYTHON)
    if args.workload == "mixed" and args.raw:
        print("llamabatch bench: --raw applies to the batched workload only; ignored", file=sys.stderr)

    from tqdm import tqdm

    n_points = len(npps) * len(ntgs) * len(npls) if args.workload == "batched" else len(rates)
    n_runners = len([r for r in runners if not (args.workload == "mixed" and r == RAW)])
    bar = tqdm(
        total=n_points * n_runners * args.repeat,
        desc="llamabatch bench",
        unit="run",
        disable=True if args.no_progress else None,
        file=sys.stderr,
    )

    def progress(label: str) -> None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)

    try:
        if args.workload == "batched":
            results = run_batched(config, npps, ntgs, npls, runners, args.repeat, progress)
        else:
            results = run_mixed(config, rates, args.requests, mix, runners, args.repeat, progress)
    except (ValueError, RuntimeError, OSError) as exc:
        bar.close()
        return fail(str(exc))
    bar.close()

    rows = [r.row() for r in results]
    for row in rows:
        row.update(model=model.name, n_threads=config.threads, flash_attn=config.flash_attn)
        row.update(n_batch=config.n_batch, strategy=config.strategy, kv_unified=config.kv_unified)
    ratios = ratio_rows(rows)
    if args.json:
        for line in iter_json_lines(rows):
            print(line)
    else:
        print(
            f"model {model.name} | threads {config.threads} | n_batch {config.n_batch} | "
            f"strategy {config.strategy} | flash_attn {'on' if config.flash_attn else 'off'} | "
            f"kv_unified {'on' if config.kv_unified else 'off'} | "
            f"workload {args.workload}"
            + (
                f" ({args.requests} requests, mix {args.mix or 'default'})"
                if args.workload == "mixed"
                else ""
            )
        )
        print()
        print(format_table(rows))
        if ratios:
            print()
            print(format_ratios(ratios))
        notes = [f"{r['runner']}: {n}" for r in rows for n in r.get("notes", [])]
        if notes:
            print()
            print("\n".join(f"note: {n}" for n in dict.fromkeys(notes)))
    if args.plot:
        out = plot_results(rows, args.plot, title=f"{model.name}, {config.threads} threads")
        print(f"wrote {out}", file=sys.stderr)
    return 0
