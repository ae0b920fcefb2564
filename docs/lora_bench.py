"""LoRA adapters on the real SmolLM2: what a switch of adapter set costs, and one adapter
(unmerged) against the base model. The figures in README's "LoRA adapters" section.

    python docs/lora_bench.py [--threads 2] [--tokens 32]

Workloads, 8 slots, every request arriving together, greedy:

- ``base``: 20 requests, no adapter;
- ``one adapter``: the same 20 requests, all with one adapter (applied unmerged every decode);
- ``mixed``: 4 adapters x 4 requests + 4 base requests (five adapter sets): ticks alternate
  between sets, each switch re-plans llama.cpp's graph.

Prints the wall time and tokens per second of each, the switches and the switch cost the
engine fitted (``SwitchCost``), and llama.cpp's own time for one re-reservation.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from llamabatch import LLM, SamplingParams
from llamabatch.testing import make_lora, real_model_path

PROMPTS = [
    "The history of the city of",
    "def fibonacci(n):",
    "The primary colors are",
    "Once upon a time",
    "The capital of France is",
]


def run(llm: LLM, sets: list[object], tokens: int) -> tuple[float, int]:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(len(sets))]
    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, lora=s) for s in sets]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="base GGUF (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    base = Path(args.model) if args.model else real_model_path()
    with tempfile.TemporaryDirectory() as d:
        adapters = {f"a{i}": make_lora(base, Path(d) / f"a{i}.gguf", rank=8, seed=i) for i in range(4)}
        workloads = {
            "base": [()] * 20,
            "one adapter": ["a0"] * 20,
            "mixed": [f"a{i // 4}" for i in range(16)] + [()] * 4,
        }
        options = {"n_parallel": 8, "n_ctx": 4096, "n_threads": args.threads}
        with LLM(base, lora_adapters=adapters, **options) as llm:
            run(llm, ["a0", ()], 4)  # warm up: both sets' graphs once
            for name, sets in workloads.items():
                before = llm.core.lora.stats()["lora_switches"]
                elapsed, n = run(llm, sets, args.tokens)
                stats = llm.core.lora.stats()
                print(
                    f"{name:12s} {elapsed:6.2f} s  {n / elapsed:6.1f} tok/s  "
                    f"switches {stats['lora_switches'] - before:4d}  "
                    f"fitted switch cost {1000 * stats['lora_switch_seconds']:.1f} ms"
                )


if __name__ == "__main__":
    main()
