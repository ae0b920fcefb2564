"""asv: the host-RAM tier's restore when idle prefixes hold its room (``cache_ram``).

``n_ctx=4096, n_parallel=2``: a 1,500-token prompt, four 3,000-token prompts one after
another, then the first prompt plus two tokens. The last request's time to first token with
``cache_ram=1024`` against ``cache_ram=0``, side by side in one run (target: <= 0.3x), and
whether both gave the same greedy token; on the base model, and with every request under a
random LoRA adapter (``testing.make_lora``), whose states the tier keys by adapter set.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from llamabatch import LLM, SamplingParams, testing
from llamabatch.gguf.testing import model_path


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def last_ttft(
    path: str, cache_ram: int, scale: float = 1.0, lora: str | None = None
) -> tuple[float, list[int], int]:
    """The final request's TTFT (s), its tokens, and the RAM tier's restores (every request
    under the adapter file ``lora`` when given)."""
    adapters = {"a": lora} if lora else None
    params = SamplingParams(max_tokens=1, temperature=0, lora="a" if lora else ())
    options = {"n_ctx": int(4096 * scale), "n_parallel": 2, "cache_ram": cache_ram, "n_threads": _threads()}
    with LLM(path, lora_adapters=adapters, **options) as llm:
        words = " ".join(testing.english_sentences(3000)).split()

        def text(i: int, n: int) -> list[int]:
            return llm.tokenize(" ".join(words[97 * i :]))[:n]

        first = text(0, int(1500 * scale))
        llm.generate(first, params)
        for i in range(4):
            llm.generate(text(1 + i, int(3000 * scale)), params)
        start = time.perf_counter()
        out = llm.generate(first + text(9, 3)[1:3], params)[0].outputs[0]
        return time.perf_counter() - start, list(out.token_ids), llm.stats().ram_cache_restores


def adapter_for(path: str) -> str:
    """A random rank-8 LoRA adapter for the model at ``path`` (in a temporary directory)."""
    return str(testing.make_lora(path, Path(tempfile.mkdtemp()) / "a.gguf", rank=8, seed=1))


class RestoreGetsItsRoom:
    params = (["135m"], [False, True])
    param_names = ("model", "adapter")
    timeout = 600
    number = 1
    repeat = 1

    def setup(self, model, adapter):
        path = str(model_path(model))
        lora = adapter_for(path) if adapter else None
        self.off = last_ttft(path, cache_ram=0, lora=lora)
        self.on = last_ttft(path, cache_ram=1024, lora=lora)

    def track_ttft_ratio(self, model, adapter):
        return self.on[0] / self.off[0]

    track_ttft_ratio.unit = "x"

    def track_restores(self, model, adapter):
        return self.on[2]

    track_restores.unit = "restores"

    def track_same_tokens(self, model, adapter):
        return int(self.on[1] == self.off[1])

    track_same_tokens.unit = "bool"


if __name__ == "__main__":
    import sys

    args = [a for a in sys.argv[1:] if a != "--adapter"]  # [scale] [--adapter]
    scale = float(args[0]) if args else 1.0
    chosen = str(model_path("135m"))
    lora_path = adapter_for(chosen) if "--adapter" in sys.argv else None
    off, on = last_ttft(chosen, 0, scale, lora_path), last_ttft(chosen, 1024, scale, lora_path)
    print(f"TTFT {on[0]:.3f} s with cache_ram=1024, {off[0]:.3f} s without ({on[0] / off[0]:.2f}x);")
    print(f"restores {on[2]}, same greedy tokens: {on[1] == off[1]}")
