"""asv: closing gaps among busy KV streams (``generate/compaction.py``).

``GapsAmongStreams``: 8 requests submitted at once on 8 KV streams (``kv_unified=False``),
every other one short (24 new tokens) and the others long (192): once the short ones end,
the long ones run in streams 0, 2, 4, 6, four forward passes a tick, until they move next
to each other. ``track_speedup`` is generated tokens/s with the moves over without (the
engine's ``compact`` replaced by a no-op), in one process, alternating, on the same prompts;
the outputs must be as long (a random model's near ties may flip between tick shapes; SmolLM2's
tokens are the same, ``tests/generate/test_compaction.py``). The model:
``$LLAMABATCH_BENCH_MODEL`` (a path; default the 135M random-weight test model). Threads:
``$LLAMABATCH_BENCH_THREADS``.
"""

from __future__ import annotations

import os
import time

from llamabatch import LLM, SamplingParams
from llamabatch.generate import core
from llamabatch.testing import model_path

N_STREAMS = 8


def _rate(llm: LLM, prompts: list[str], params: list[SamplingParams], moves: bool) -> tuple[float, list]:
    """Generated tokens/s of one run, and its tokens."""
    compact = core.compact
    if not moves:
        core.compact = lambda _core: False  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        core.compact = compact  # type: ignore[assignment]
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


class GapsAmongStreams:
    timeout = 600

    def setup(self) -> None:
        path = os.environ.get("LLAMABATCH_BENCH_MODEL") or str(model_path("135m"))
        threads = int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))
        self.llm = LLM(
            path, n_parallel=N_STREAMS, n_ctx=4096, kv_unified=False, prefix_cache=False, n_threads=threads
        )
        self.prompts = [f"Write a long story about a dragon named number {i}." for i in range(N_STREAMS)]
        lengths = [24 if i % 2 else 192 for i in range(N_STREAMS)]
        self.params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        self.llm.generate(self.prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    def teardown(self) -> None:
        self.llm.close()

    def track_speedup(self) -> float:
        on, tokens_on = _rate(self.llm, self.prompts, self.params, True)
        off, tokens_off = _rate(self.llm, self.prompts, self.params, False)
        assert self.llm.stats().slot_moves > 0
        # random weights: near ties may flip between tick shapes, so only the lengths must match
        assert [len(t) for t in tokens_on] == [len(t) for t in tokens_off]
        return on / off

    track_speedup.unit = "x"  # type: ignore[attr-defined]
