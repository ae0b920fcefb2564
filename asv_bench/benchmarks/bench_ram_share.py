"""asv: each client's share of the host-RAM tier (``cache_ram``) under another client's flood.

``n_ctx=4096, n_parallel=2, cache_ram=64``: client "b" sends a 1,000-token prompt, client
"flood" seven more (the tier drops states for them), then b's next turn. Its time to first
token with the clients named (the flood recycles its own share: b's state comes back) over
the same run with none (one LRU for all, as before the share: b's state was pushed out and
its prompt is computed again), side by side in one run.

    python asv_bench/benchmarks/bench_ram_share.py [-m MODEL] [--rounds N]
"""

from __future__ import annotations

import os
import statistics
import time

from llamabatch import LLM, SamplingParams, testing
from llamabatch.gguf.testing import model_path


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def next_turn_after_flood(path: str, named: bool) -> tuple[float, int, list[int]]:
    """b's next turn after the flood: its TTFT (s), the prompt tokens reused, its tokens."""
    params = SamplingParams(max_tokens=8, temperature=0)
    options = {"n_ctx": 4096, "n_parallel": 2, "cache_ram": 64, "n_threads": _threads()}
    b, flood = ("b", "flood") if named else (None, None)
    with LLM(path, **options) as llm:
        words = " ".join(testing.english_sentences(2000)).split()
        texts = [llm.tokenize(" ".join(words[300 * i :]))[:1000] for i in range(8)]
        first = llm.submit(texts[0], params, client=b).result().outputs[0]
        for text in texts[1:]:
            llm.submit(text, params, client=flood).result()
        follow = texts[0] + first.token_ids + llm.tokenize(" And then?", add_special=False)
        start = time.perf_counter()
        out = llm.submit(follow, params, client=b).result().outputs[0]
        return time.perf_counter() - start, out.usage.reused_tokens, list(out.token_ids)


class FloodKeepsOthersConversation:
    params = (["135m"],)
    param_names = ("model",)
    timeout = 600
    number = 1
    repeat = 1

    def setup(self, model: str) -> None:
        self.path = str(model_path(model))

    def track_ttft_ratio(self, model: str) -> float:
        shared, _, _ = next_turn_after_flood(self.path, named=True)
        lru, _, _ = next_turn_after_flood(self.path, named=False)
        return shared / lru

    track_ttft_ratio.unit = "x"  # type: ignore[attr-defined]


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=str(model_path("135m")))
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    ratios = []
    for r in range(args.rounds):
        shared, reused, tokens = next_turn_after_flood(args.model, named=True)
        lru, lru_reused, lru_tokens = next_turn_after_flood(args.model, named=False)
        ratios.append(shared / lru)
        print(
            f"round {r}: clients named {shared:.3f} s ({reused} tokens reused), none {lru:.3f} s "
            f"({lru_reused} reused): {shared / lru:.2f}x, same tokens: {tokens == lru_tokens}",
            flush=True,
        )
    print(f"median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
