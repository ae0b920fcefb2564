"""The caller's side of an embedding call: its texts as a job of tokenized sequences, the rows
they fill, the future the caller waits on, the progress bar; and running a call as jobs
(``run_jobs``, shared by ``Embedder`` and ``Reranker``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "Job",
    "Matrix",
    "ProgressBar",
    "Seq",
    "Vector",
    "as_texts",
    "normalize_rows",
    "run_jobs",
    "show_progress",
]

logger = logging.getLogger("llamabatch")

#: One text's vector, and the rows of many texts (float32).
Vector = np.ndarray[tuple[int], np.dtype[np.float32]]
Matrix = np.ndarray[tuple[int, int], np.dtype[np.float32]]


def normalize_rows(x: np.ndarray, mode: str) -> np.ndarray:
    """Normalise the last axis of ``x`` in place; all-zero rows stay zero."""
    if mode == "none" or x.size == 0:
        return x
    if mode == "l2":
        scale = np.sqrt(np.einsum("...i,...i->...", x, x))[..., None]
    else:  # max_abs
        scale = np.abs(x).max(axis=-1, keepdims=True)
    np.divide(x, scale, out=x, where=scale > 0)
    return x


def as_texts(texts: Any) -> tuple[bool, list[Any]]:
    """``(single, texts)``: a lone string (or prompt with images) becomes a list of one."""
    if isinstance(texts, (str, Mapping)):  # a mapping: one prompt with images
        return True, [texts]
    if isinstance(texts, (bytes, bytearray)):
        raise TypeError("texts must be a str or a sequence of str, not bytes: decode them first")
    if isinstance(texts, np.ndarray):
        return False, texts.tolist()
    try:
        return False, list(texts)
    except TypeError:
        raise TypeError(f"texts must be a str or a sequence of str, got {type(texts).__name__}") from None


def cancel_submitted(submit: asyncio.Future[Any]) -> None:
    """Cancel the job an abandoned ``aembed`` submitted (its texts are then not packed)."""
    if not submit.cancelled() and submit.exception() is None:
        submit.result().future.cancel()


def show_progress(show_progress_bar: bool | None) -> bool:
    """sentence-transformers' default: a bar when its logger (here ``llamabatch``) is at
    INFO or DEBUG."""
    if show_progress_bar is None:
        return logger.getEffectiveLevel() in (logging.INFO, logging.DEBUG)
    return bool(show_progress_bar)


class ProgressBar:
    """A tqdm bar on stderr advanced per text by the worker thread; ``close`` on the caller's."""

    def __init__(self, total: int, desc: str = "Embedding", unit: str = "text") -> None:
        from tqdm import tqdm

        self._lock = threading.Lock()
        self._bar: Any = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)

    def update(self, n: int) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(n)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class Job:
    """Texts of one call (or of one ``batch_size`` chunk of it): the rows they fill, the
    future that resolves when they are all in, and the progress bar they advance."""

    __slots__ = ("future", "n_done", "n_reported", "n_tokens", "out", "progress", "remaining", "t_submit")

    def __init__(self, out: Any, remaining: int, progress: ProgressBar | None) -> None:
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.out = out  # shared by the jobs of one call: each writes its own rows
        self.remaining = remaining
        self.progress = progress
        self.n_done = 0
        self.n_reported = 0
        #: the tokens of its texts, as embedded (after truncation): a call's usage
        self.n_tokens = 0
        self.t_submit = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.future.done()

    def store(self, index: int, value: np.ndarray) -> None:
        """One text's result (worker thread); ``deliver`` publishes it."""
        self.out[index] = value
        self.remaining -= 1
        self.n_done += 1

    def deliver(self) -> None:
        """Advance the bar, then resolve the job when its last text is in (the bar must
        move before the caller wakes and closes it)."""
        if self.progress is not None and self.n_done > self.n_reported:
            self.progress.update(self.n_done - self.n_reported)
            self.n_reported = self.n_done
        if self.remaining == 0:
            try:
                self.future.set_result(None)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass

    def fail(self, error: BaseException) -> None:
        """End the job with ``error`` unless it has ended already (exactly once)."""
        try:
            self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass


class Seq:
    """One text of a job, tokenized, waiting in the queue or in a pack; ``media``: a prompt
    with images (``embed/images.py``), whose ``tokens`` are its positions' ids."""

    __slots__ = ("index", "job", "media", "n", "tokens")

    def __init__(self, job: Job, index: int, tokens: np.ndarray, media: Any = None) -> None:
        self.job = job
        self.index = index  # the text's index in its call
        self.tokens = tokens
        self.media = media
        self.n = int(tokens.shape[0])


#: ``submit(texts, offset, out, bar, new_call) -> Job``: tokenize and queue one chunk of a call
Submit = Callable[[list[Any], int, Any, "ProgressBar | None", bool], Job]


def run_jobs(
    submit: Submit,
    items: list[Any],
    chunk: int,
    out: Any,
    show: bool,
    *,
    desc: str = "Embedding",
    unit: str = "text",
) -> Any:
    """Queue ``items`` with ``submit`` in jobs of ``chunk``, wait for them all; returns ``out``.
    On any error (or interruption) the jobs' items not decoded yet are dropped. ``show``: a
    progress bar labelled ``desc``, counting ``unit``s."""
    bar = ProgressBar(len(items), desc, unit) if show else None
    jobs: list[Job] = []
    try:
        for start in range(0, len(items), max(chunk, 1)):
            jobs.append(submit(items[start : start + chunk], start, out, bar, not jobs))
        for job in jobs:
            job.future.result()
    except BaseException:
        for job in jobs:  # their texts not decoded yet are dropped
            job.future.cancel()
        raise
    finally:
        if bar is not None:
            bar.close()
    return out
