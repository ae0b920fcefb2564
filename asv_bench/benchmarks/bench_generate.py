"""asv: generation through the engine on the project's test models.

One class per operation, ``params`` over the models, all preparation in ``setup``:

- ``GenerationThroughput``: generated and total tokens/s, decode-heavy, prefill-heavy and
  mixed request lengths (more requests than slots: continuous batching);
- ``TimeToFirstToken``: a new request's time to first token while other slots decode;
- ``EngineOverhead``: the engine's time per tick outside ``llama_decode`` (from ``stats()``:
  ``(tick_time - decode_time) / ticks``) and the share of wall time outside it, at 8 and 64
  slots;
- ``PeakMemory``: peak RSS of loading a model and serving a batch;
- ``MemoryGrowth``: RSS after 2,000 requests over RSS after 100 (tiny model).

Workloads are scaled so each run takes seconds. Threads: ``$LLAMABATCH_BENCH_THREADS``
(default: all cores).
"""

from __future__ import annotations

import os
import time
from typing import ClassVar

from llamabatch import LLM, SamplingParams
from llamabatch.bench.memory import rss_after_requests
from llamabatch.bench.runners import BenchConfig, EngineRunner
from llamabatch.bench.workloads import (
    BenchRequest,
    batched_requests,
    make_prompts,
    open_tokenizer,
    resolve_model,
)

MODELS = ["tiny", "135m"]


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def _config(model: str) -> BenchConfig:
    return BenchConfig(model=resolve_model(model), n_threads=_threads(), stream=False)


# workload -> model -> (n_parallel, [(npp, ntg, count), ...]); sized to run in seconds.
_WORKLOADS = {
    "decode_heavy": {
        "tiny": (16, [(16, 512, 16)]),
        "135m": (16, [(16, 32, 16)]),
    },
    "prefill_heavy": {
        "tiny": (8, [(512, 16, 32)]),
        "135m": (8, [(140, 8, 8)]),
    },
    "mixed": {
        "tiny": (8, [(16, 256, 16), (128, 64, 16), (512, 16, 8)]),
        "135m": (8, [(16, 16, 6), (128, 8, 6), (384, 4, 2)]),
    },
}


def _requests(model: str, spec: list[tuple[int, int, int]], seed: int = 0) -> list[BenchRequest]:
    """The requests of ``spec`` ((npp, ntg, count) kinds), the kinds interleaved round-robin."""
    kinds = [[(npp, ntg)] * count for npp, ntg, count in spec]
    lengths = [k[i] for i in range(max(len(k) for k in kinds)) for k in kinds if i < len(k)]
    vocab = open_tokenizer(resolve_model(model))
    try:
        prompts = make_prompts(vocab, [npp for npp, _ in lengths], seed=seed)
    finally:
        vocab.close()
    return [BenchRequest(p, ntg) for p, (_, ntg) in zip(prompts, lengths, strict=True)]


class GenerationThroughput:
    """Tokens/s of a batch of requests (all submitted at once) through the engine."""

    params = (MODELS, ["decode_heavy", "prefill_heavy", "mixed"])
    param_names: ClassVar[list[str]] = ["model", "workload"]
    timeout = 300
    unit = "tokens/s"

    def setup(self, model: str, workload: str) -> None:
        n_parallel, spec = _WORKLOADS[workload][model]
        self.requests = _requests(model, spec)
        n_ctx = max(256, sum(sorted(len(r.prompt) + r.max_tokens for r in self.requests)[-n_parallel:]))
        self.runner = EngineRunner(_config(model), n_parallel, -(-n_ctx // 256) * 256)
        self.runner.warmup(self.requests[0].prompt[1:])
        self.n_parallel = n_parallel

    def teardown(self, model: str, workload: str) -> None:
        self.runner.close()

    def _row(self) -> dict:
        return self.runner.run(self.requests, "batched", self.n_parallel).row()

    def track_gen_tokens_per_s(self, model: str, workload: str) -> float:
        """Generated tokens / wall time."""
        return self._row()["gen_tokens_per_s"]

    track_gen_tokens_per_s.unit = "tokens/s"  # type: ignore[attr-defined]

    def track_total_tokens_per_s(self, model: str, workload: str) -> float:
        """(Prompt + generated tokens) / wall time."""
        return self._row()["total_tokens_per_s"]

    track_total_tokens_per_s.unit = "tokens/s"  # type: ignore[attr-defined]


class TimeToFirstToken:
    """Time to first token of a new 128-token prompt while 7 other slots decode."""

    params = (MODELS,)
    param_names: ClassVar[list[str]] = ["model"]
    timeout = 300

    def setup(self, model: str) -> None:
        path = resolve_model(model)
        self.llm = LLM(path, n_ctx=4096, n_parallel=8, n_threads=_threads(), flash_attn=False)
        prompts = make_prompts(self.llm.model, [16] * 7 + [128] * 3, seed=1)
        self.background, self.probes = prompts[:7], prompts[7:]
        self.llm.generate([list(prompts[0][:8])], SamplingParams(max_tokens=2, temperature=0))

    def teardown(self, model: str) -> None:
        self.llm.close()

    def track_ttft_under_load_ms(self, model: str) -> float:
        """Median over 3 probes, each submitted once the 7 background requests decode."""
        llm = self.llm
        load = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        handles = [llm.submit(list(p), load) for p in self.background]
        try:
            for handle in handles:  # wait until every background request has a token
                next(iter(handle))
            ttfts = []
            for probe in self.probes:
                out = llm.submit(list(probe), SamplingParams(max_tokens=1, temperature=0)).result()
                ttft = out.outputs[0].timings.time_to_first_token
                assert ttft is not None
                ttfts.append(ttft * 1000)
                time.sleep(0.01)
        finally:
            for handle in handles:
                handle.cancel()
            for handle in handles:
                handle.result()
        return sorted(ttfts)[1]

    track_ttft_under_load_ms.unit = "ms"  # type: ignore[attr-defined]


class EngineOverhead:
    """The engine's work outside ``llama_decode``: per tick, and as a share of wall time."""

    params = (MODELS, [8, 64])
    param_names: ClassVar[list[str]] = ["model", "slots"]
    timeout = 300

    def setup(self, model: str, slots: int) -> None:
        # tiny: long enough that per-run fixed costs do not count; 135m: a few seconds.
        ntg = (1024 if slots == 8 else 256) if model == "tiny" else (16 if slots == 8 else 8)
        vocab = open_tokenizer(resolve_model(model))
        try:
            self.requests = batched_requests(vocab, 16, ntg, slots)
        finally:
            vocab.close()
        self.runner = EngineRunner(_config(model), slots, max(256, -(-slots * (16 + ntg) // 256) * 256))
        self.runner.warmup(self.requests[0].prompt[1:])
        self.slots = slots

    def teardown(self, model: str, slots: int) -> None:
        self.runner.close()

    def _row(self) -> dict:
        return self.runner.run(self.requests, "batched", self.slots).row()

    def track_overhead_per_tick_us(self, model: str, slots: int) -> float:
        """(tick_time - decode_time) / ticks, in microseconds."""
        return self._row()["overhead_per_tick_us"]

    track_overhead_per_tick_us.unit = "us"  # type: ignore[attr-defined]

    def track_outside_decode_percent(self, model: str, slots: int) -> float:
        """Share of the run's wall time spent outside llama_decode, in percent."""
        return self._row()["outside_decode_share"] * 100

    track_outside_decode_percent.unit = "%"  # type: ignore[attr-defined]


class PeakMemory:
    """Peak RSS of loading a model and serving 16 requests on 8 slots."""

    params = (MODELS,)
    param_names: ClassVar[list[str]] = ["model"]
    timeout = 300

    def setup(self, model: str) -> None:
        self.path = resolve_model(model)
        vocab = open_tokenizer(self.path)
        try:
            self.prompts = [list(p) for p in make_prompts(vocab, [32] * 16, seed=2)]
        finally:
            vocab.close()

    def peakmem_generate_16(self, model: str) -> None:
        """Load, serve 16 requests (32 prompt + 8 generated tokens) on 8 slots, close."""
        with LLM(self.path, n_ctx=1024, n_parallel=8, n_threads=_threads(), flash_attn=False) as llm:
            llm.generate(
                self.prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
            )


class MemoryGrowth:
    """RSS after 2,000 short requests against RSS after 100 (tiny model): must stay flat
    (``tests/bench/test_bench.py`` fails above 1.05)."""

    timeout = 300

    def track_rss_ratio_2000_vs_100(self) -> float:
        """RSS after 2,000 requests / RSS after 100 (a ratio near 1, so that asv's relative
        comparison of two commits flags real growth, not noise on a near-zero percentage)."""
        rss = rss_after_requests("tiny", (100, 2000), n_threads=_threads())
        return rss[2000] / rss[100]

    track_rss_ratio_2000_vs_100.unit = "ratio"  # type: ignore[attr-defined]
