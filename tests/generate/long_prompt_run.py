"""A long prompt arriving while three streams decode, on real llama.cpp, with its tick
telemetry: the shared run of the ``target_itl_ms`` and SLO tests (``test_latency_real``,
``test_slo_real``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from llamabatch import LLM, CompletionOutput, GenerationStats, SamplingParams, TickEvent

#: the long prompt's tokens (two 512-token chunks, less)
N_LONG = 900


@dataclass
class LongPromptRun:
    #: the ticks that prefilled part of the long prompt while the streams decoded
    mixed: list[TickEvent]
    #: the three streams' and the long prompt's outputs
    outputs: list[CompletionOutput]
    stats: GenerationStats


def run_long_prompt(path: Any, **engine: Any) -> LongPromptRun:
    """Three streams decode (4 slots, n_ctx 8192, 1 thread, 512-token ticks and chunks, plus ``engine``);
    once they have, an ``N_LONG``-token prompt arrives; every request runs to its length."""
    ticks: list[TickEvent] = []
    lock = threading.Lock()

    def listen(event: object) -> None:
        if isinstance(event, TickEvent):
            with lock:
                ticks.append(event)

    with LLM(path, n_parallel=4, n_ctx=8192, n_threads=1, n_batch=512, chunk_size=512, **engine) as llm:
        llm.add_listener(listen)
        params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        streams = [llm.submit([10 + i, 20, 30, 40], params) for i in range(3)]
        while True:  # the streams decode before the long prompt arrives
            with lock:
                if sum(t.decode_tokens >= 3 for t in ticks) >= 20:
                    break
            threading.Event().wait(0.005)
        long_prompt = [(7 * i) % 200 + 5 for i in range(N_LONG)]
        long = llm.submit(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        outputs = [handle.result().outputs[0] for handle in [*streams, long]]
        stats = llm.stats()
    return LongPromptRun(
        mixed=[t for t in ticks if t.prefill_tokens and t.decode_tokens >= 3],
        outputs=outputs,
        stats=stats,
    )
