"""Memory over many requests: the engine must not grow with the number of requests served.

:func:`rss_after_requests` serves short requests through one :class:`llamabatch.LLM` and
records the resident set size after given request counts (the target: RSS after 2,000
requests within 5% of RSS after 100). Used by ``tests/bench/test_bench.py`` and the asv suite.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["current_rss", "rss_after_requests", "rss_growth"]


def current_rss() -> int:
    """The process's resident set size now, in bytes (``/proc/self/statm`` on Linux; psutil
    elsewhere; the peak RSS as a last resort)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def rss_after_requests(
    model: str | os.PathLike[str] = "tiny",
    checkpoints: Sequence[int] = (100, 2000),
    *,
    n_parallel: int = 8,
    prompt_tokens: int = 8,
    max_tokens: int = 4,
    wave: int = 50,
    n_threads: int | None = None,
    seed: int = 0,
) -> dict[int, int]:
    """Serve short greedy requests (``prompt_tokens`` prompt tokens, ``max_tokens`` generated,
    different prompts) through one engine, in waves of ``wave`` concurrent requests, and
    return ``{n: rss_bytes}`` measured (after a garbage collection) once ``n`` requests have
    completed, for every ``n`` in ``checkpoints``. ``model`` is a GGUF path or a test-model
    preset name."""
    from llamabatch import LLM, SamplingParams
    from llamabatch.bench.runners.engine import completion
    from llamabatch.bench.workloads import resolve_model, text_token_pool

    marks = sorted(set(checkpoints))
    if not marks or marks[0] < 1:
        raise ValueError("checkpoints must be positive request counts")
    path: Path = resolve_model(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rng = random.Random(seed)
    out: dict[int, int] = {}
    with LLM(
        path,
        n_ctx=max(256, n_parallel * (prompt_tokens + max_tokens)),
        n_parallel=n_parallel,
        n_batch=max(64, n_parallel * prompt_tokens),
        n_threads=n_threads,
    ) as llm:
        pool = text_token_pool(llm.model, prompt_tokens * 64)
        limit = len(pool) - prompt_tokens
        done = 0
        for mark in marks:
            while done < mark:
                n = min(wave, mark - done)
                starts = [rng.randrange(limit + 1) for _ in range(n)]
                outs = [
                    completion(o)
                    for o in llm.generate(
                        [pool[s : s + prompt_tokens] for s in starts], params, use_tqdm=False
                    )
                ]
                if any(o.finish_reason != "length" for o in outs):
                    raise RuntimeError(f"a request ended {[o.finish_reason for o in outs]}")
                done += n
            del outs
            gc.collect()
            out[mark] = current_rss()
    return out


def rss_growth(model: str | os.PathLike[str] = "tiny", first: int = 100, last: int = 2000) -> float:
    """Relative RSS growth between ``first`` and ``last`` requests served (0.05 = 5%)."""
    rss = rss_after_requests(model, (first, last))
    return rss[last] / rss[first] - 1.0
