"""Slots that follow the load: ``LLM``'s defaults against ``llama-batched-bench``'s, side by side,
on uniform batches (every request arriving together, ``npp`` prompt + ``ntg`` new tokens).

    python docs/slots_bench.py [-m /tmp/smollm2.gguf] [-t 2] [--npl 1,8,16,32] [--shapes 128+64,16+128]
        [--bb ~/.cache/llamabatch-anchors/llama-batched-bench] [--bb-args "-fa on"] [--rounds 3]

For every shape and ``npl``: ``llama-batched-bench -c C -npp P -ntg T -npl B`` (its defaults
otherwise; ``C = max(4096, B x (P + T))``, as it skips a batch that does not fit), ``LLM`` with
its defaults and ``n_ctx=C`` given, and ``LLM`` with its defaults alone (no ``n_ctx``). Each
row prints total tokens per second as batched-bench counts them (``B x (P + T)`` over the
whole time), ours over the same tokens, the ratio to batched-bench, and the slots ``LLM``
chose (``stats().n_parallel`` and its reason). Without the binary only our rows are run.

With ``--rounds N`` every row is measured N times, the three runs side by side in each round,
and the row prints the medians (tokens/s, and ratios taken within a round) with the ratios'
range: on a shared 2-core machine one run moves by 5-10%, both sides alike.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from llamabatch import LLM, SamplingParams

ANCHORS = Path.home() / ".cache" / "llamabatch-anchors"


def batched_bench(
    binary: Path, model: str, threads: int, n_ctx: int, npp: int, ntg: int, npl: int, extra: list[str]
) -> float | None:
    """llama-batched-bench's ``S t/s`` for one batch (None when it printed no row)."""
    cmd = [
        str(binary),
        "-m",
        model,
        "-t",
        str(threads),
        "-c",
        str(n_ctx),
        "-npp",
        str(npp),
        "-ntg",
        str(ntg),
        "-npl",
        str(npl),
        *extra,
    ]
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == npl:
            return float(cells[-1])
    return None


def ours(model: str, threads: int, npp: int, ntg: int, npl: int, **options: object) -> tuple[float, str]:
    """Total tokens per second of ``npl`` requests on ``LLM(model, **options)``, and its slots."""
    rng = random.Random(0)
    with LLM(model, n_threads=threads, **options) as llm:
        vocab = llm.model.n_vocab
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(npp)] for _ in range(npl)]
        params = SamplingParams(max_tokens=ntg, temperature=0, ignore_eos=True)
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
    return npl * (npp + ntg) / seconds, f"{stats.n_parallel} slots ({stats.n_parallel_reason})"


def ratio(ours_tps: Sequence[float], theirs: Sequence[float | None]) -> str:
    """The median of the rounds' ratios, with their range when there are several."""
    ratios = [o / t for o, t in zip(ours_tps, theirs, strict=True) if t]
    if not ratios:
        return "-"
    text = f"{statistics.median(ratios):.2f}x"
    return text + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")


def median(values: Sequence[float | None]) -> str:
    present = [v for v in values if v]
    return f"{statistics.median(present):.1f}" if present else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="/tmp/smollm2.gguf")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--npl", default="1,8,16,32", help="sequences, comma-separated")
    p.add_argument("--shapes", default="128+64,16+128", help="prompt+new tokens, comma-separated")
    p.add_argument("--bb", type=Path, default=ANCHORS / "llama-batched-bench")
    p.add_argument("--bb-args", default="", help="more llama-batched-bench flags, e.g. '-fa on'")
    p.add_argument("--rounds", type=int, default=1, help="runs of each row, side by side (medians)")
    args = p.parse_args()
    columns = ["shape", "npl", "llama-batched-bench t/s", "ours, n_ctx given", "ratio"]
    columns += ["ours, no n_ctx", "ratio"]
    print("| " + " | ".join([*columns, "slots"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    extra = shlex.split(args.bb_args)
    for shape in args.shapes.split(","):
        npp, ntg = (int(x) for x in shape.split("+"))
        for npl in (int(x) for x in args.npl.split(",")):
            n_ctx = max(4096, npl * (npp + ntg))
            bb: list[float | None] = []
            given: list[float] = []
            alone: list[float] = []
            for _ in range(max(1, args.rounds)):
                if args.bb.exists():
                    bb.append(batched_bench(args.bb, args.model, args.threads, n_ctx, npp, ntg, npl, extra))
                else:
                    bb.append(None)
                tps, slots = ours(args.model, args.threads, npp, ntg, npl, n_ctx=n_ctx)
                given.append(tps)
                tps, slots_alone = ours(args.model, args.threads, npp, ntg, npl)
                alone.append(tps)
            print(
                f"| {shape} | {npl} | {median(bb)} | {median(given)} | {ratio(given, bb)} | "
                f"{median(alone)} | {ratio(alone, bb)} | {slots}; no n_ctx: {slots_alone} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
