"""asv: structured output with the grammar masks kept across requests (``grammar_cache_mb``,
``llamabatch._ffi.sampler.GrammarMasks``) and without them.

- ``StructuredThroughput``: generated tokens/s of 8 chats under one 5-property JSON schema, 8
  slots, on SmolLM2-135M-Instruct (the default model: a real vocabulary and real JSON), after
  one warm-up batch of the same schema, by ``grammar_cache_mb`` (0: off; 32: the default) and
  temperature (greedy; 0.8 with top-k 40). Without a schema for reference (``"none"``).

Run ``python asv_bench/benchmarks/bench_grammar_masks.py`` for the figures at once (each
configuration in turn, the ratios over the cache switched off).
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from llamabatch import LLM, SamplingParams
from llamabatch.bench.workloads import resolve_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email": {"type": "string", "maxLength": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "ok"],
}


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


class StructuredThroughput:
    """Generated tokens/s of 8 schema-constrained chats at once, by the grammar cache's size."""

    params = (["none", "0", "32"], [0.0, 0.8])
    param_names: ClassVar[list[str]] = ["grammar_cache_mb", "temperature"]
    timeout = 300

    def setup(self, cache: str, temperature: float) -> None:
        mb = 0 if cache == "none" else int(cache)
        self.llm = LLM(
            resolve_model(None), n_parallel=8, n_ctx=4096, n_threads=_threads(), grammar_cache_mb=mb
        )
        schema = {} if cache == "none" else {"json_schema": SCHEMA}
        self.params = SamplingParams(max_tokens=96, temperature=temperature, seed=1, **schema)
        self.round = 0
        self.run_batch()  # the warm-up batch: the schema's masks are kept from here

    def teardown(self, cache: str, temperature: float) -> None:
        self.llm.close()

    def run_batch(self) -> float:
        """One batch of 8 new chats (new prompts each time: no prefix reuse); its tokens/s."""
        self.round += 1
        chats = [
            [{"role": "user", "content": f"Describe person number {self.round * 100 + i} as JSON."}]
            for i in range(8)
        ]
        start = time.perf_counter()
        outputs = self.llm.chat(chats, self.params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return tokens / (time.perf_counter() - start)

    def track_tokens_per_s(self, cache: str, temperature: float) -> float:
        return self.run_batch()

    track_tokens_per_s.unit = "tokens/s"  # type: ignore[attr-defined]


def main() -> None:
    for temperature in (0.8, 0.0):
        figures = {}
        for cache in StructuredThroughput.params[0]:
            bench = StructuredThroughput()
            bench.setup(cache, temperature)
            figures[cache] = bench.track_tokens_per_s(cache, temperature)
            bench.teardown(cache, temperature)
        print(
            f"temperature {temperature}: no schema {figures['none']:.1f} tokens/s; schema, no masks "
            f"{figures['0']:.1f}; schema, masks {figures['32']:.1f} ({figures['32'] / figures['0']:.2f}x)"
        )


if __name__ == "__main__":
    main()
