"""asv: speculative decoding's speed-up for one stream, where the drafts hold.

- ``NgramOnRepeatingText``: n-gram speculation on text that repeats itself. The random test
  models' greedy text rarely repeats its prompt, so the model is ``loop_model("135m")`` (the
  135M shape, every layer computed, whose next token depends on the current one alone) and
  the prompts hold a turn of the token cycle it walks (``loop_prompts``).
- ``DraftModelPair``: the ``draft_pair("135m")`` (a 30-layer target with exactly its 4-layer
  draft's logits), 128 prompt and 128 new tokens, where every greedy draft is accepted.

Each ``track_speedup`` is generation tokens/s (after the first token) with speculation over
without, in one process, on the same prompts. Threads: ``$LLAMABATCH_BENCH_THREADS``.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import numpy as np

from llamabatch import LLM, SamplingParams
from llamabatch.testing import draft_pair, loop_model, loop_prompts


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def _tokens_per_second(
    model: str, prompts: list[list[int]], n_new: int, spec: dict[str, Any] | None
) -> float:
    """Generation tokens/s after each prompt's first token, one stream, greedy."""
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    with LLM(model, n_parallel=1, n_threads=_threads(), speculative_config=spec) as llm:
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        seconds = 0.0
        for prompt in prompts:
            first = None
            for _ in llm.stream(prompt, params):
                if first is None:
                    first = time.perf_counter()
            assert first is not None
            seconds += time.perf_counter() - first
    return len(prompts) * (n_new - 1) / seconds


class NgramOnRepeatingText:
    params: ClassVar[list[int]] = [16, 64]
    param_names: ClassVar[list[str]] = ["num_speculative_tokens"]
    timeout = 300

    def setup(self, k: int) -> None:
        self.model = str(loop_model("135m"))
        self.prompts = loop_prompts(self.model, 3, 256)

    def track_speedup(self, k: int) -> float:
        spec = {"method": "ngram", "num_speculative_tokens": k}
        plain = _tokens_per_second(self.model, self.prompts, 256, None)
        return _tokens_per_second(self.model, self.prompts, 256, spec) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


class DraftModelPair:
    params: ClassVar[list[int]] = [16, 31]
    param_names: ClassVar[list[str]] = ["num_speculative_tokens"]
    timeout = 300

    def setup(self, k: int) -> None:
        pair = draft_pair("135m")
        self.target, self.draft = str(pair.target), str(pair.draft)
        rng = np.random.default_rng(0)
        self.prompts = [[int(t) for t in rng.integers(10, 30000, 128)] for _ in range(3)]

    def track_speedup(self, k: int) -> float:
        spec = {"method": "draft_model", "model": self.draft, "num_speculative_tokens": k}
        plain = _tokens_per_second(self.target, self.prompts, 128, None)
        return _tokens_per_second(self.target, self.prompts, 128, spec) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]
