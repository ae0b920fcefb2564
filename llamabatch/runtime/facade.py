"""``ThreadedFacade``: the lifecycle every facade whose work runs on one worker thread shares
(``LLM``, ``Embedder``, ``Reranker``): starting its ``Worker``, closing it, the context
manager, the finaliser, and the resource guard that keeps the model alive while a caller's
thread tokenizes.

A facade builds its task (the core and its queues), hands it to :meth:`ThreadedFacade.attach`
with the worker's thread name and ``kind`` (what messages call it: "the embedder is
closed"), finishes its own setup, then calls :meth:`start`. Everything else of the facade
talks to the thread through :attr:`worker`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from llamabatch.runtime.worker import Worker, WorkerTask

__all__ = ["ThreadedFacade"]

T = TypeVar("T")
Facade = TypeVar("Facade", bound="ThreadedFacade")

#: how long a facade dropped without ``close()`` waits for its thread to stop
FINALISER_TIMEOUT_S = 5.0


class ThreadedFacade:
    """The worker-thread lifecycle of a facade: ``attach``, ``start``, ``close``, ``with``,
    ``using_resources`` and ``call``. Thread-safe; ``close`` is idempotent."""

    def attach(self, name: str, task: WorkerTask, kind: str) -> Worker:
        """Make the worker thread (not started) that runs ``task``; returns it."""
        self._worker: Worker | None = Worker(name, task, kind=kind)
        return self._worker

    def start(self) -> None:
        """Start the worker thread (once, when the facade is ready)."""
        self.worker.start()

    @property
    def worker(self) -> Worker:
        """The worker thread and its lock (``worker.cond``), which own the context."""
        worker = getattr(self, "_worker", None)
        if worker is None:
            raise RuntimeError(f"{type(self).__name__} has no worker thread (its construction failed)")
        return worker

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called or the worker thread crashed: no more work is accepted."""
        return self.worker.closed

    @property
    def on_worker_thread(self) -> bool:
        """Whether the current thread is the worker thread (listeners run there)."""
        return self.worker.on_worker_thread

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn()`` on the worker thread (the context's only user); return its result."""
        return self.worker.call(fn, timeout)

    @contextlib.contextmanager
    def using_resources(self) -> Iterator[None]:
        """Keep the model alive while the current thread uses it (``EngineClosed`` once
        closing; ``close()`` frees the model only after every such user has left)."""
        with self.worker.using_resources():
            yield

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker thread and free the model; work still queued ends with
        ``EngineClosed``. Idempotent. From the worker thread itself (a listener) it takes
        effect when the current unit of work ends."""
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.close(timeout)

    def __enter__(self: Facade) -> Facade:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            worker = getattr(self, "_worker", None)
            if worker is not None and not worker.closed:
                worker.close(timeout=FINALISER_TIMEOUT_S)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
