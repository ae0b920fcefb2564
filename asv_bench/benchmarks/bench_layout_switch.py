"""asv: the KV layout that follows the workload (``generate/layout_switch.py``).

A shared 2,000-token prompt, 24 requests of 16 unique tokens and 64 new ones, 8 slots, in
rounds (all 24 at once, then a quiet moment), in one ``LLM`` each: the defaults (the layout
chosen at load, then followed) against ``kv_unified=True, flash_attn=False`` (the best layout
for it, README "Memory"), side by side in one run. Tracked: the defaults' last round over the
explicit layout's (target >= 0.95x after the switch), the switches made, and the time they
took. ``python asv_bench/benchmarks/bench_layout_switch.py [scale]`` prints the same figures.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import model_path

ROUNDS = 4
REQUESTS = 24


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def rounds(path: str, scale: float = 1.0, **options: Any) -> tuple[list[float], Any]:
    """Each round's wall time (s), and the final ``stats()``."""
    params = SamplingParams(max_tokens=max(1, int(64 * scale)), temperature=0, ignore_eos=True)
    times = []
    with LLM(path, n_parallel=8, n_threads=_threads(), **options) as llm:
        vocab = llm.model.n_vocab - 300
        prefix = [llm.model.bos, *((i * 104729) % vocab + 256 for i in range(int(2000 * scale)))]
        for r in range(ROUNDS):
            prompts = [
                prefix + [(r * 977 + i * 31 + j) % vocab + 256 for j in range(16)] for i in range(REQUESTS)
            ]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            time.sleep(0.05)  # the quiet moment (the engine thread switches there, if it does)
        return times, llm.stats()


class LayoutFollowsTheWorkload:
    params = (["135m"],)
    param_names = ("model",)
    timeout = 1200
    number = 1
    repeat = 1

    def setup(self, model):
        path = str(model_path(model))
        self.defaults = rounds(path)
        self.best = rounds(path, kv_unified=True, flash_attn=False)

    def track_last_round_best_over_defaults(self, model):
        return self.best[0][-1] / self.defaults[0][-1]

    track_last_round_best_over_defaults.unit = "x"

    def track_switches(self, model):
        return self.defaults[1].layout_switches

    def track_switch_time(self, model):
        return self.defaults[1].layout_switch_time_s

    track_switch_time.unit = "seconds"


if __name__ == "__main__":
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    path = str(model_path("135m"))
    (d_times, d_stats), (b_times, _) = (
        rounds(path, scale),
        rounds(path, scale, kv_unified=True, flash_attn=False),
    )
    print("defaults rounds (s):", [round(t, 2) for t in d_times])
    print("unified, fa off rounds (s):", [round(t, 2) for t in b_times])
    print("last round best / defaults:", round(b_times[-1] / d_times[-1], 3))
    print(
        "switches:",
        d_stats.layout_switches,
        d_stats.layout_switch_reasons,
        round(d_stats.layout_switch_time_s, 3),
        "s",
    )
    print("final layout: kv_unified", d_stats.kv_unified, "flash_attn", d_stats.flash_attn)
