"""asv: the host-RAM tier's restore when idle prefixes hold its room (``cache_ram``).

``n_ctx=4096, n_parallel=2``: a 1,500-token prompt, four 3,000-token prompts one after
another, then the first prompt plus two tokens. The last request's time to first token with
``cache_ram=1024`` against ``cache_ram=0``, side by side in one run (target: <= 0.3x), and
whether both gave the same greedy token.
"""

from __future__ import annotations

import os
import time

from llamabatch import LLM, SamplingParams, testing
from llamabatch.gguf.testing import model_path

PARAMS = SamplingParams(max_tokens=1, temperature=0)


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def last_ttft(path: str, cache_ram: int, scale: float = 1.0) -> tuple[float, list[int], int]:
    """The final request's TTFT (s), its tokens, and the RAM tier's restores."""
    with LLM(path, n_ctx=int(4096 * scale), n_parallel=2, cache_ram=cache_ram, n_threads=_threads()) as llm:
        words = " ".join(testing.english_sentences(3000)).split()

        def text(i: int, n: int) -> list[int]:
            return llm.tokenize(" ".join(words[97 * i :]))[:n]

        first = text(0, int(1500 * scale))
        llm.generate(first, PARAMS)
        for i in range(4):
            llm.generate(text(1 + i, int(3000 * scale)), PARAMS)
        start = time.perf_counter()
        out = llm.generate(first + text(9, 3)[1:3], PARAMS)[0].outputs[0]
        return time.perf_counter() - start, list(out.token_ids), llm.stats().ram_cache_restores


class RestoreGetsItsRoom:
    params = (["135m"],)
    param_names = ("model",)
    timeout = 600
    number = 1
    repeat = 1

    def setup(self, model):
        path = str(model_path(model))
        self.off = last_ttft(path, cache_ram=0)
        self.on = last_ttft(path, cache_ram=1024)

    def track_ttft_ratio(self, model):
        return self.on[0] / self.off[0]

    track_ttft_ratio.unit = "x"

    def track_restores(self, model):
        return self.on[2]

    track_restores.unit = "restores"

    def track_same_tokens(self, model):
        return int(self.on[1] == self.off[1])

    track_same_tokens.unit = "bool"


if __name__ == "__main__":
    import sys

    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    chosen = str(model_path("135m"))
    off, on = last_ttft(chosen, 0, scale), last_ttft(chosen, 1024, scale)
    print(f"TTFT {on[0]:.3f} s with cache_ram=1024, {off[0]:.3f} s without ({on[0] / off[0]:.2f}x);")
    print(f"restores {on[2]}, same greedy tokens: {on[1] == off[1]}")
