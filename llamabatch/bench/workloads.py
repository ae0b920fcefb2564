"""The generation workloads: requests made of prompt token ids, identical for every runner.

``batched`` (llama-batched-bench's workload)
    For every ``npl``: requests of ``npp`` prompt tokens and ``ntg`` generated tokens, all
    arriving at once (``npl`` of them unless another count is asked for).
``repeat``
    As ``batched``, but each prompt is a passage of 48 tokens (cut at a seeded random offset)
    repeated to ``npp`` tokens: a greedy continuation then tends to repeat it too, the case
    n-gram speculative decoding (prompt lookup) is for.
``retry``
    As ``batched``, each prompt asked twice: the ``npl`` requests, then the same ``npl``
    again, queued behind them (an agent retrying a call): the second answer is the first one,
    the case of drafts shared across requests (``speculative_config={"method": "suffix"}``).
``mixed``
    ``n_requests`` requests arriving as a Poisson process at ``rate`` requests/s, with prompt
    and output lengths drawn from a weighted mix (e.g. chat-like, balanced, RAG-like).

Prompts are cut from English text at seeded random offsets, so the work is the same on every
runner and every run; no two prompts start with the same token, so no runner can reuse a
cached prefix of another request.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "DEFAULT_MIX",
    "BenchRequest",
    "Tokenizer",
    "WorkloadSpec",
    "auto_n_ctx",
    "batched_requests",
    "make_prompts",
    "mixed_requests",
    "open_tokenizer",
    "parse_mix",
    "point_seed",
    "repeat_requests",
    "resolve_model",
    "retry_requests",
    "text_token_pool",
    "warm_prompt",
]

#: The default request mix of the mixed workload: (prompt tokens, generated tokens, weight).
DEFAULT_MIX = ((16, 128, 1.0), (128, 64, 1.0), (512, 16, 1.0))

#: Tokens of the passage a ``repeat`` workload prompt repeats.
REPEAT_PASSAGE = 48

# Prompts of a workload that get a first token of their own (the check scans the text).
_MAX_DISTINCT_STARTS = 256


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload points to run.

    ``kind`` ``"batched"`` (or ``"repeat"``, its prompts repeating a passage, or ``"retry"``,
    each prompt asked twice): every ``npp`` x
    ``ntg`` x ``npl``, ``n_requests`` requests each (default ``npl``), all at once. ``"mixed"``:
    ``n_requests`` (default 32) Poisson arrivals at every rate of ``rates``, lengths from ``mix``."""

    kind: str = "batched"
    npps: tuple[int, ...] = (128,)
    ntgs: tuple[int, ...] = (64,)
    npls: tuple[int, ...] = (1, 8, 16)
    rates: tuple[float, ...] = (2.0,)
    n_requests: int | None = None
    mix: tuple[tuple[int, int, float], ...] = DEFAULT_MIX

    @property
    def n_points(self) -> int:
        """Workload points (rows per runner)."""
        if self.kind in ("batched", "repeat", "retry"):
            return len(self.npps) * len(self.ntgs) * len(self.npls)
        return len(self.rates)


class Tokenizer(Protocol):
    """What the workloads need of a model: ``llamabatch.Model`` or ``LLM``."""

    def tokenize(self, text: str, add_special: bool = ..., parse_special: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: prompt token ids, tokens to generate, arrival time (seconds
    after the workload starts)."""

    prompt: tuple[int, ...]
    max_tokens: int
    arrival: float = 0.0


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF to benchmark: a path, or a test-model preset name (``tiny``, ``small``,
    ``135m``; built and cached on first use); ``None`` is SmolLM2-135M-Instruct (the same
    shape as ``135m``, Q4_1 weights; fetched once, else the ``135m`` preset, said on stderr)."""
    from llamabatch.gguf import testing
    from llamabatch.gguf.real_model import default_model_path

    if model is None:
        return default_model_path("135m")
    path = Path(model)
    if not path.exists() and str(model) in testing.PRESETS:
        return testing.model_path(str(model))
    if not path.is_file():
        raise FileNotFoundError(f"no model file {path} (nor a test-model preset: {sorted(testing.PRESETS)})")
    return path


def open_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The model at ``path``, for its vocabulary (mmap: the weights are not read); close it
    after use. ``vocab_only`` is avoided: a vocab-only model has no shape to report."""
    from llamabatch import Model

    return Model(path)


def text_token_pool(model: Tokenizer, min_tokens: int) -> list[int]:
    """Token ids of English text, at least ``min_tokens`` of them (repeated when needed)."""
    from llamabatch.gguf.testing import english_sentences

    pool = model.tokenize(" ".join(english_sentences(400)), add_special=False)
    if not pool:
        raise ValueError("the model tokenizes English text to nothing")
    while len(pool) < min_tokens + 1:
        pool = pool + pool
    return pool


def make_prompts(model: Tokenizer, lengths: Sequence[int], seed: int = 0) -> list[tuple[int, ...]]:
    """Prompts of exactly ``lengths[i]`` token ids each, cut from English text at random
    (seeded) offsets. No two prompts start with the same token while the text has unused
    first tokens left (checked for the first 256 prompts), so no runner can reuse a cached
    prefix of another request."""
    if not lengths:
        return []
    if min(lengths) < 1:
        raise ValueError("prompt lengths must be >= 1")
    pool = text_token_pool(model, max(lengths))
    rng = random.Random(seed)
    used: set[int] = set()
    distinct = len(set(pool))
    prompts: list[tuple[int, ...]] = []
    for k, length in enumerate(lengths):
        limit = len(pool) - length
        start = rng.randrange(limit + 1)
        if len(used) < distinct and k < _MAX_DISTINCT_STARTS:
            for _ in range(limit + 1):
                if pool[start] not in used:
                    break
                start = (start + 1) % (limit + 1)
        prompt = tuple(pool[start : start + length])
        used.add(prompt[0])
        prompts.append(prompt)
    return prompts


def batched_requests(
    model: Tokenizer, npp: int, ntg: int, npl: int, seed: int = 0, n_requests: int | None = None
) -> list[BenchRequest]:
    """llama-batched-bench's workload: ``n_requests`` (default ``npl``) requests of ``npp``
    prompt tokens and ``ntg`` generated tokens, all arriving at time 0."""
    count = npl if n_requests is None else n_requests
    prompts = make_prompts(model, [npp] * count, seed=seed * 1_000_003 + npp * 1009 + npl)
    return [BenchRequest(p, ntg, 0.0) for p in prompts]


def repeat_requests(
    model: Tokenizer, npp: int, ntg: int, npl: int, seed: int = 0, n_requests: int | None = None
) -> list[BenchRequest]:
    """As :func:`batched_requests`, each prompt a 48-token passage repeated to ``npp`` tokens
    (the ``repeat`` workload)."""
    count = npl if n_requests is None else n_requests
    passages = make_prompts(
        model, [min(REPEAT_PASSAGE, npp)] * count, seed=seed * 1_000_003 + npp * 1013 + npl
    )
    return [BenchRequest(tuple((p * (npp // len(p) + 1))[:npp]), ntg, 0.0) for p in passages]


def retry_requests(
    model: Tokenizer, npp: int, ntg: int, npl: int, seed: int = 0, n_requests: int | None = None
) -> list[BenchRequest]:
    """:func:`batched_requests`, then the same requests again (the ``retry`` workload): all
    arrive at 0, the copies queued behind the first ones (FIFO: with ``npl`` slots they start
    as the first ones end)."""
    first = batched_requests(model, npp, ntg, npl, seed, n_requests)
    return first + list(first)


def parse_mix(text: str) -> tuple[tuple[int, int, float], ...]:
    """Parse a request mix ``"NPP:NTG[:WEIGHT],..."`` (e.g. ``"16:128,512:16:2"``)."""
    mix = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"bad mix entry {item!r}: expected NPP:NTG or NPP:NTG:WEIGHT")
        try:
            npp, ntg = int(parts[0]), int(parts[1])
            weight = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ValueError(f"bad mix entry {item!r}: NPP and NTG must be ints, WEIGHT a number") from None
        if npp < 1 or ntg < 1 or not weight > 0:
            raise ValueError(f"bad mix entry {item!r}: NPP, NTG and WEIGHT must be positive")
        mix.append((npp, ntg, weight))
    if not mix:
        raise ValueError("empty request mix")
    return tuple(mix)


def mixed_requests(
    model: Tokenizer,
    n_requests: int,
    rate: float,
    mix: Sequence[tuple[int, int, float]] = DEFAULT_MIX,
    seed: int = 0,
) -> list[BenchRequest]:
    """``n_requests`` requests arriving as a Poisson process of ``rate`` requests/s (the first
    at time 0), each with a (prompt, output) length pair drawn from ``mix`` by weight."""
    if n_requests < 1:
        raise ValueError("n_requests must be >= 1")
    if not rate > 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    kinds = rng.choices(range(len(mix)), weights=[w for _, _, w in mix], k=n_requests)
    arrivals = [0.0]
    for _ in range(n_requests - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    prompts = make_prompts(model, [mix[k][0] for k in kinds], seed=seed + 7)
    return [BenchRequest(p, mix[k][1], t) for p, k, t in zip(prompts, kinds, arrivals, strict=True)]


def point_seed(seed: int, point: int) -> int:
    """The prompt seed of a run's ``point``-th workload point (rate, grid point or capacity
    probe): each point gets prompts of its own, so a server's prompt cache cannot serve one
    point from an earlier point's identical prompts; point 0 keeps ``seed``."""
    return seed + 1009 * point


def warm_prompt(requests: Sequence[BenchRequest]) -> tuple[int, ...]:
    """An 8-token warm-up prompt that shares no first token with ``requests``."""
    firsts = {r.prompt[0] for r in requests}
    for r in requests:
        for k in range(1, len(r.prompt)):
            if r.prompt[k] not in firsts:
                return tuple(r.prompt[k : k + 8])
    return tuple(requests[0].prompt[-8:])


def auto_n_ctx(requests: Sequence[BenchRequest], n_parallel: int, unified: bool = True) -> int:
    """A KV cache that holds the ``n_parallel`` longest requests at once (multiple of 256).
    Without a unified KV cache every sequence gets ``n_ctx / n_parallel`` cells of its own,
    so each must hold the longest request."""
    lengths = sorted((len(r.prompt) + r.max_tokens for r in requests), reverse=True)
    if not unified:
        return n_parallel * max(256, -(-lengths[0] // 256) * 256)
    need = sum(lengths[:n_parallel])
    return max(256, -(-need // 256) * 256)
