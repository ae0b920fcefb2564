"""asv: scoring texts (``SamplingParams(prompt_logprobs=1)``), what lm-evaluation-harness's
``loglikelihood`` tasks and perplexity runs do: 8 English texts of 256 tokens on
SmolLM2-135M-Instruct (the real model), one token generated each.

- ``track_over_llama_cpp_python``: llama-cpp-python's own path for the same answer, from the
  same llama.cpp commit (``Llama(logits_all=True)``, ``create_completion(echo=True,
  logprobs=1)``, one text after another, as it serves one sequence), its time over ours.
- ``track_scoring_cost``: our time scoring over our time computing the same prompts unscored
  (``max_tokens=1``, no prompt reuse): what the prompt rows' logits and their
  log-probabilities cost.

``python asv_bench/benchmarks/bench_scoring.py --rounds N`` prints both, N rounds side by
side, with the CPU's flags. Threads: ``$LLAMABATCH_BENCH_THREADS`` (default: all cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

N_TEXTS = 8
N_TOKENS = 256


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def _texts(llm: Any) -> list[str]:
    """``N_TEXTS`` texts of ``N_TOKENS`` tokens, cut from different places of the English
    sentences of the tests (text: llama-cpp-python's echo takes no token ids)."""
    from llamabatch import testing

    words = " ".join(testing.english_sentences(2000)).split()
    return [llm.detokenize(llm.tokenize(" ".join(words[200 * i :]))[:N_TOKENS]) for i in range(N_TEXTS)]


def ours(path: str, texts: list[str], scored: bool = True) -> float:
    """Seconds to score (or, ``scored=False``, only compute) every text, all at once."""
    from llamabatch import LLM, SamplingParams

    with LLM(path, n_threads=_threads(), n_ctx=N_TEXTS * (N_TOKENS + 8), prefix_cache=False) as llm:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1 if scored else None)
        llm.generate(texts[:1], params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        llm.generate(texts, params, use_tqdm=False)
        return time.perf_counter() - t0


def llama_cpp_python(path: str, texts: list[str]) -> float:
    """Seconds for llama-cpp-python to score every text, one after another. (Its 0.3.36 echo
    log-probabilities are shifted by one: each token's comes from the row that already read
    it. The work is the same.)"""
    import llama_cpp

    llm = llama_cpp.Llama(
        path, n_ctx=N_TOKENS + 8, n_batch=512, logits_all=True, n_threads=_threads(), verbose=False
    )
    try:
        llm.create_completion(texts[0][:40], max_tokens=1, echo=True, logprobs=1, temperature=0)  # warm-up
        t0 = time.perf_counter()
        for text in texts:
            llm.create_completion(text, max_tokens=1, echo=True, logprobs=1, temperature=0)
        return time.perf_counter() - t0
    finally:
        llm.close()


class ScoreTexts:
    timeout = 900
    number = 1
    repeat = 1

    def setup(self) -> None:
        try:
            import llama_cpp  # noqa: F401  (llama-cpp-python, which builds our llama.cpp)
        except ImportError as exc:  # only a prefix build (LLAMABATCH_LLAMA_PREFIX) lacks it
            raise NotImplementedError("llama-cpp-python is not installed") from exc
        from llamabatch import LLM, testing

        self.path = str(testing.real_model_path())
        with LLM(self.path, n_threads=1) as llm:
            texts = _texts(llm)
        self.plain = ours(self.path, texts, scored=False)
        self.scored = ours(self.path, texts)
        self.peer = llama_cpp_python(self.path, texts)

    def track_over_llama_cpp_python(self) -> float:
        return self.peer / self.scored

    track_over_llama_cpp_python.unit = "x"  # type: ignore[attr-defined]

    def track_scoring_cost(self) -> float:
        return self.scored / self.plain

    track_scoring_cost.unit = "x"  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from llamabatch import LLM, testing
    from llamabatch.bench.cpu import cpu_summary

    path = str(testing.real_model_path())
    with LLM(path, n_threads=1) as llm:
        texts = _texts(llm)
    print(f"{cpu_summary()}; threads {_threads()}; {N_TEXTS} texts x {N_TOKENS} tokens, SmolLM2-135M")
    over, cost = [], []
    for r in range(args.rounds):  # each side in turn, never two at once
        plain = ours(path, texts, scored=False)
        scored = ours(path, texts)
        peer = llama_cpp_python(path, texts)
        over.append(peer / scored)
        cost.append(scored / plain)
        print(
            f"round {r + 1}: ours {scored:.2f} s (unscored {plain:.2f} s), llama-cpp-python {peer:.2f} s: "
            f"{over[-1]:.2f}x; scoring cost {cost[-1]:.2f}x"
        )
    print(
        f"median: {statistics.median(over):.2f}x llama-cpp-python ({min(over):.2f}-{max(over):.2f}); "
        f"scoring cost {statistics.median(cost):.2f}x ({min(cost):.2f}-{max(cost):.2f})"
    )


if __name__ == "__main__":
    main()
