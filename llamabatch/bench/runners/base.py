"""What every runner shares: the settings (:class:`BenchConfig`) and the runner protocol."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from llamabatch.bench.report import RunResult
from llamabatch.bench.workloads import BenchRequest

__all__ = ["ENGINE", "HTTP", "LLAMA_CPP_PYTHON", "RAW", "BenchConfig", "Runner", "wait_until"]

#: The runner names (the ``runner`` column).
ENGINE = "llamabatch"
RAW = "raw"
LLAMA_CPP_PYTHON = "llama-cpp-python"
HTTP = "server"


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
            delta (see :class:`~llamabatch.bench.runners.EngineRunner`); without it the
            inter-token latency comes from the engine's tick events.
        warmup: run a few tokens through each runner before timing it.
        seed: the seed of the prompts and of the mixed workload's arrivals.
        prefix_cache: let the engine reuse cached prompt prefixes (off by default: the raw
            loop recomputes every prompt; the prompts of a workload share no prefix anyway).
        kv_unified: one KV buffer shared by all sequences, or a stream per sequence
            (llamabatch's default), whose attention then spans only its own cells (the engine
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
    kv_unified: bool = False
    #: the KV cache types (``EngineConfig.type_k`` / ``type_v``)
    type_k: str = "f16"
    type_v: str = "f16"
    #: the engine's target inter-token latency (``EngineConfig.target_itl_ms``; None: none)
    target_itl_ms: float | None = None
    #: the host-RAM prompt cache in MiB (``EngineConfig.cache_ram``; 0 or None: off)
    cache_ram: int | None = 8192
    #: the engine's speculative decoding (``EngineConfig.speculative_config``; None: off)
    speculative_config: dict[str, Any] | None = field(default=None, hash=False)
    #: the SLO a request meets for ``goodput`` (ms; None: no bound)
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None

    @property
    def threads(self) -> int:
        """The thread count every runner uses."""
        return self.n_threads if self.n_threads is not None else (os.cpu_count() or 1)

    @property
    def micro_batch(self) -> int:
        """``n_ubatch`` resolved for every runner alike: as given, else ``n_batch``."""
        return self.n_ubatch or self.n_batch


class Runner(Protocol):
    """Serves the requests of a workload point and times them."""

    name: str

    def warmup(self, tokens: Sequence[int]) -> None:
        """Run a few tokens through (pages the weights in, builds the graphs)."""

    def run(
        self, requests: Sequence[BenchRequest], workload: str, npl: int, rate: float | None = None
    ) -> RunResult:
        """Serve ``requests`` (each at its arrival time), wait for all of them, and measure."""

    def close(self) -> None:
        """Free what the runner holds."""


def wait_until(t: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``t``."""
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
