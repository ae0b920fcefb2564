"""The models, data and tolerances the Embedder tests share (``conftest.py`` makes the
fixtures of them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data"
SENTENCES = DATA / "sentences_en.txt"
REFERENCE = DATA / "minilm_reference.npy"
MIN_COSINE = 0.999
THREADS = 1  # one thread: robust when other processes share the cores (no spinning barriers)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (an embedder thread's progress), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
