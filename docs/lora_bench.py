"""LoRA adapters on the real SmolLM2: what a switch of adapter set costs, and one adapter
(unmerged) against the base model. The figures in README's "LoRA adapters" section.

    python docs/lora_bench.py [--threads 2] [--tokens 32]

Workloads, 8 slots, every request arriving together, greedy:

- ``base``: 20 requests, no adapter;
- ``one adapter``: the same 20 requests, all with one adapter (applied unmerged every decode);
- ``mixed``: 4 adapters x 4 requests + 4 base requests (five adapter sets): ticks alternate
  between sets, each switch re-plans llama.cpp's graph.

Prints the wall time and tokens per second of each, the switches and the switch cost the
engine fitted (``SwitchCost``). With ``--llama-server PATH`` the mixed workload also runs on
``llama-server -np 8 --lora ...`` (the same files, each request's ``lora`` field naming its
adapter), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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


def run_llama_server(
    server: Path, base: Path, adapters: list[Path], sets: list[object], tokens: int, threads: int
) -> tuple[float, int]:
    """The mixed workload on llama-server: 8 slots, one HTTP request per prompt, together."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [str(server), "-m", str(base), "--port", str(port), "-t", str(threads), "-np", "8", "-c", "4096"]
    for adapter in adapters:
        argv += ["--lora", str(adapter)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(server.parent)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not start") from None
                time.sleep(0.3)

        def one(i: int) -> int:
            name = sets[i]
            lora = [{"id": k, "scale": 1.0 if name == f"a{k}" else 0.0} for k in range(len(adapters))]
            body = {
                "prompt": PROMPTS[i % len(PROMPTS)] + f" ({i})",
                "n_predict": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "lora": lora,
            }
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=3600) as resp:
                return int(json.load(resp).get("tokens_predicted", tokens))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(sets)) as pool:
            n = sum(pool.map(one, range(len(sets))))
        return time.perf_counter() - t0, n
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="base GGUF (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--llama-server", default=None, help="a llama-server binary to run the mixed workload on"
    )
    parser.add_argument("--workloads", default="base,one adapter,mixed", help="comma-separated, of the three")
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
            for name in args.workloads.split(","):
                sets = workloads[name]
                llm.clear_prefix_cache()  # no workload reuses another's prompts
                before = llm.core.lora.stats()["lora_switches"]
                elapsed, n = run(llm, sets, args.tokens)
                stats = llm.core.lora.stats()
                print(
                    f"{name:12s} {elapsed:6.2f} s  {n / elapsed:6.1f} tok/s  "
                    f"switches {stats['lora_switches'] - before:4d}  "
                    f"fitted switch cost {1000 * stats['lora_switch_seconds']:.1f} ms"
                )
        if args.llama_server:
            paths = [adapters[f"a{i}"] for i in range(4)]
            elapsed, n = run_llama_server(
                Path(args.llama_server), base, paths, workloads["mixed"], args.tokens, args.threads
            )
            print(f"{'llama-server':12s} {elapsed:6.2f} s  {n / elapsed:6.1f} tok/s  (mixed)")


if __name__ == "__main__":
    main()
