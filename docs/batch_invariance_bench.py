"""Throughput of ``batch_invariant=True`` against the defaults and other layouts, at 8 x (128
prompt + 128 generated tokens), SmolLM2-135M-Instruct, 2 threads, each configuration in its
own process, configurations rotated between rounds (README, "Reproducibility").

Run: ``python docs/batch_invariance_bench.py [rounds] [model.gguf]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CONFIGS = {
    "defaults": {},
    "batch_invariant": {"batch_invariant": True},
    "per-stream, FA on, f16": {"kv_unified": False, "flash_attn": True},
    "per-stream, FA on, bf16": {"kv_unified": False, "flash_attn": True, "type_k": "bf16", "type_v": "bf16"},
    "unified, FA on, f16": {"kv_unified": True, "flash_attn": True},
}


def one_run(model: str, options: dict) -> float:
    """Generated tokens per second of 8 requests of 128 + 128 tokens, in one batch."""
    from llamabatch import LLM, SamplingParams, testing

    with LLM(model, n_parallel=8, n_threads=2, n_threads_batch=2, **options) as llm:
        text = " ".join(testing.english_sentences(300)).split()
        prompts = [llm.tokenize(" ".join(text[40 * i :]))[:128] for i in range(8)]
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        llm.generate(prompts[0][:16], SamplingParams(max_tokens=4), use_tqdm=False)  # pages in
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main(argv: list[str]) -> None:
    if len(argv) > 2 and argv[1] == "--one":
        print(json.dumps(one_run(argv[2], json.loads(argv[3]))))
        return
    rounds = int(argv[1]) if len(argv) > 1 else 3
    if len(argv) > 2:
        model = argv[2]
    else:
        from llamabatch.testing import real_model_path

        model = str(real_model_path())
    names = list(CONFIGS)
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out = subprocess.run(
                [sys.executable, __file__, "--one", model, json.dumps(CONFIGS[name])],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            results[name].append(float(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {name}: {results[name][-1]:.1f} tokens/s", flush=True)
    for name in names:
        ratios = [v / d for v, d in zip(results[name], results["defaults"], strict=True)]
        print(
            f"{name}: "
            + " / ".join(f"{v:.1f}" for v in results[name])
            + " tokens/s, x defaults: "
            + " / ".join(f"{x:.2f}" for x in ratios)
        )


if __name__ == "__main__":
    main(sys.argv)
