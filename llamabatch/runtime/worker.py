"""The worker thread shared by the embedder and the generation engine.

One thread owns one llama.cpp context; callers on any thread hand it work under one
condition variable (``Worker.cond``). A ``Worker`` drives a *task* (``WorkerTask``: the
engine's loop, which owns the core and its queues) by composition: the facade (``LLM``,
``Embedder``) owns a ``Worker``, the ``Worker`` owns the thread and calls the task. This
module holds what every such worker needs, so each engine keeps only what is specific to
its work:

- the thread and its loop: sleep until there is work, a call or a close; run queued
  *calls* (``call(fn)``), then one *unit of work* (``task.run_once()``: a pack, a tick);
- ``call(fn, timeout)``: run ``fn`` on the worker thread and return its result (or raise
  its exception). From the worker thread itself it runs ``fn`` at once (no deadlock);
- ``close(timeout)``: idempotent. From another thread it stops the worker and waits for it.
  From the worker thread itself (a telemetry listener, a strategy) it is *deferred*: the
  current unit of work finishes, then the loop ends. Either way the context is freed by
  the worker thread after its last unit, never under a running step;
- crash containment: an unexpected exception out of ``run_once`` is logged once, the
  worker is marked closed, and every pending job ends exactly once with an error: no
  caller is left waiting;
- ``halve_and_retry``: the one policy for ``llama_decode`` codes that mean "no memory for
  this batch" (``DecodeCode.retryable``): free memory if the caller can, else halve.

The owner makes ``Worker(name, task, kind=...)`` once its task is ready, then calls
``start()``. The task implements (``WorkerTask``):

- ``has_work() -> bool``: is there a unit of work to run? Called with ``cond`` held.
- ``run_once()``: run one unit of work on the worker thread (``cond`` not held: take
  ``with worker.cond:`` to read what callers share, and release it before computing).
- ``fail_pending(error)``: end every job not finished yet (queued or in the unit that
  was running) with ``error``. Called exactly once, on the worker thread after its last
  unit (or on the closing thread if the worker never started). Take what you fail from
  the shared queues under ``cond``; ending a job must be idempotent (exactly once).
- ``on_close()``: free resources (context, batches, model). Called once, after
  ``fail_pending``.
- ``interrupt()``: make a running unit end early (``Context.abort()``). Called by
  ``close()`` on the closing thread, so it must be safe from any thread at any time,
  even after ``on_close``: set a flag, touch nothing else.

Callers' submission paths check ``raise_if_closed()`` under ``cond`` before queueing, so
nothing is queued after the worker stopped taking work.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from llamabatch._ffi.context import DecodeCode
from llamabatch._ffi.openmp import release_openmp_threads
from llamabatch.errors import EngineClosed, LlamaBatchError

__all__ = ["RetryOutcome", "Worker", "WorkerTask", "halve_and_retry"]

logger = logging.getLogger("llamabatch")

T = TypeVar("T")

#: how long interpreter exit waits for each worker thread to end and free its model
EXIT_TIMEOUT_S = 10.0

#: the workers whose thread was started; closed at interpreter exit
_started_workers: weakref.WeakSet[Worker] = weakref.WeakSet()


def _close_started_workers() -> None:
    """At interpreter exit, before daemon threads are frozen, let every worker thread end
    and free its model. A thread still inside ``llama_free`` when finalisation starts (a
    crashed worker still freeing, a facade never closed) aborts the process: llama.cpp's
    log callback cannot take the GIL back there."""
    for worker in list(_started_workers):
        worker.close(timeout=EXIT_TIMEOUT_S)


atexit.register(_close_started_workers)


class WorkerTask(Protocol):
    """What a ``Worker`` runs (see the module doc): the engine's side of the thread."""

    def has_work(self) -> bool:
        """Whether a unit of work is waiting (``Worker.cond`` is held)."""
        ...

    def run_once(self) -> None:
        """Run one unit of work on the worker thread."""
        ...

    def fail_pending(self, error: BaseException) -> None:
        """End every unfinished job with ``error`` (exactly once per job)."""
        ...

    def on_close(self) -> None:
        """Free the resources (after ``fail_pending``)."""
        ...

    def interrupt(self) -> None:
        """Make a running unit of work end early; safe from any thread at any time."""
        ...


class Worker:
    """One thread that owns a llama.cpp context and runs a task's units of work (see the
    module doc).

    ``cond`` guards everything callers share with the worker; ``closed`` is True once
    ``close()`` was called or the worker crashed (no more work is accepted).
    """

    #: what the worker is, in messages ("the embedder is closed"); see ``kind``
    _kind = "worker"

    def __init__(self, name: str, task: WorkerTask, *, kind: str | None = None) -> None:
        self.cond = threading.Condition()
        self.task = task
        if kind is not None:
            self._kind = kind
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._closing = False  # no more work accepted: close() was called, or the worker crashed
        self._shut_down = False  # fail_pending and on_close have run
        self._resource_users = 0  # callers' threads inside using_resources()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    @property
    def kind(self) -> str:
        """What the worker is, in messages (``"LLM"``, ``"embedder"``)."""
        return self._kind

    # -- any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (once the task is set up)."""
        self._thread.start()
        _started_workers.add(self)

    @property
    def started(self) -> bool:
        """Whether the thread was started."""
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        """Whether the thread is running (started, and its loop not ended)."""
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after ``close()``)."""
        self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called or the worker crashed: no more work is accepted."""
        return self._closing

    @property
    def on_worker_thread(self) -> bool:
        """Whether the current thread is the worker thread (listeners, strategies run there)."""
        return threading.current_thread() is self._thread

    def raise_if_closed(self) -> None:
        """``EngineClosed`` when no more work is accepted (call with ``cond`` held)."""
        if self._closing:
            raise EngineClosed(f"the {self._kind} is closed")

    @contextlib.contextmanager
    def using_resources(self) -> Iterator[None]:
        """Keep the resources (the model) alive while a caller's thread uses them
        (tokenizing, building a sampler): ``EngineClosed`` once closing, and ``_on_close``
        runs only after every such user has left (freeing the model under a running
        ``llama_tokenize`` was a segfault)."""
        with self.cond:
            self.raise_if_closed()
            self._resource_users += 1
        try:
            yield
        finally:
            with self.cond:
                self._resource_users -= 1
                if not self._resource_users:
                    self.cond.notify_all()

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn()`` on the worker thread (the context's only user); return its result.

        ``fn``'s exception is raised here. Calls run between units of work, in the order
        they were made. From the worker thread itself ``fn`` runs at once.

        Raises:
            EngineClosed: the worker is closed, or closes before ``fn`` ran.
            TimeoutError: ``fn`` did not finish within ``timeout`` seconds (if it had not
                started, it never will).
        """
        if self.on_worker_thread:
            return fn()
        if self._thread.ident is None:
            raise RuntimeError(f"the {self._kind}'s worker thread was never started")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self.cond:
            self.raise_if_closed()
            self._calls.append((fn, future))
            self.cond.notify_all()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # not started yet: the worker skips it
            raise TimeoutError(f"the call did not finish within {timeout} s") from None

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker; work not finished ends with ``EngineClosed``. Idempotent.

        From another thread: waits (up to ``timeout`` seconds) for the worker to end and
        free its resources. From the worker thread (a listener, a strategy): returns at
        once; the current unit of work finishes, then the worker ends and frees them.
        """
        with self.cond:
            first = not self._closing
            self._closing = True
            self.cond.notify_all()
        if first:
            self.task.interrupt()
        if self._thread.ident is None:  # never started: nothing runs, end it all here
            self._shutdown(EngineClosed(f"the {self._kind} was closed"))
            return
        if self.on_worker_thread:
            return  # deferred: the loop ends after the current unit of work
        self._thread.join(timeout)

    # -- worker thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        error: BaseException | None = None
        task = self.task
        cond = self.cond
        try:
            while True:
                with cond:
                    idle = not (self._calls or self._closing or task.has_work())
                if idle:
                    # About to sleep: give back this thread's OpenMP workers, which would
                    # otherwise slow every other llama.cpp thread of the process
                    # (_ffi/openmp.py). Outside the lock: it joins threads.
                    release_openmp_threads()
                with cond:
                    while not (self._calls or self._closing or task.has_work()):
                        cond.wait()
                    if self._closing:
                        break
                    calls = list(self._calls)
                    self._calls.clear()
                    work = task.has_work()
                for fn, future in calls:
                    if future.set_running_or_notify_cancel():  # False: cancelled by a timeout
                        try:
                            future.set_result(fn())
                        except BaseException as exc:
                            future.set_exception(exc)
                if work and not self._closing:
                    task.run_once()
        except BaseException as exc:  # a bug: contain it, never leave a caller hanging
            logger.critical("llamabatch: the %s's worker thread crashed", self._kind, exc_info=True)
            error = LlamaBatchError(
                f"the {self._kind}'s worker thread crashed: {exc!r} (see the 'llamabatch' log)"
            )
        finally:
            self._shutdown(error if error is not None else EngineClosed(f"the {self._kind} was closed"))

    def _shutdown(self, error: BaseException) -> None:
        """End all pending work with ``error`` and free the resources; runs once."""
        with self.cond:
            if self._shut_down:
                return
            self._shut_down = True
            self._closing = True
            calls = list(self._calls)
            self._calls.clear()
            self.cond.notify_all()  # wake callers blocked on the condition (e.g. waiting for room)
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        try:
            self.task.fail_pending(error)
        except Exception:  # pragma: no cover - a bug in a task
            logger.exception("llamabatch: ending the %s's pending work failed", self._kind)
        with self.cond:  # callers' threads may still be using the model: let them finish
            while self._resource_users:
                self.cond.wait()
        try:
            self.task.on_close()
        except Exception:  # pragma: no cover - a bug in a task
            logger.exception("llamabatch: freeing the %s failed", self._kind)


@dataclass(frozen=True)
class RetryOutcome:
    """What ``halve_and_retry`` ended with."""

    #: the last attempt's code (``OK``, a non-retryable code, or a retryable one at the floor)
    code: DecodeCode
    #: the last attempt's raw return value (unknown codes keep their number)
    raw: int
    #: the budget of the last attempt
    budget: int
    #: what the last attempt used (tokens, sequences: whatever ``run`` counts)
    used: int
    #: attempts after the first: reliefs plus halvings
    retries: int

    @property
    def ok(self) -> bool:
        return self.code is DecodeCode.OK


def halve_and_retry(
    run: Callable[[int], tuple[int, int]],
    budget: int,
    *,
    floor: int = 1,
    relieve: Callable[[], bool] | None = None,
    what: str = "llama_decode",
) -> RetryOutcome:
    """Run ``run(budget)`` until it succeeds, fails for good, or cannot shrink any more.

    ``run(budget)`` builds and decodes a batch of at most ``budget`` units (tokens,
    sequences) and returns ``(code, used)``: llama.cpp's return value and the units the
    batch held (at least ``floor`` when there is anything to run; ``(0, 0)`` when there
    is nothing). A failed ``run`` must leave no trace (roll back what the batch wrote).

    On a retryable code (``DecodeCode.retryable``: no KV room, failed allocation):

    1. ``relieve()``, when given, tries to free memory (evict cached prefixes, preempt a
       request) and returns True when it freed something: the same budget is tried again.
       It must return False once it has nothing left to free.
    2. Otherwise the budget becomes half of what the failed attempt *used* (never below
       ``floor``), so every retry runs a smaller batch.
    3. An attempt of ``floor`` units that still fails is final: the caller fails what that
       batch held (for the embedder: the one sequence that cannot be embedded even alone).

    Any other code is returned at once (``ABORTED`` when closing, ``FATAL``, ...).
    Returns the last attempt's outcome; its ``budget`` is a good start for the next batch
    while memory stays short.
    """
    retries = 0
    while True:
        raw, used = run(budget)
        code = DecodeCode.of(raw)
        if code is DecodeCode.OK or not code.retryable:
            return RetryOutcome(code, raw, budget, used, retries)
        if relieve is not None and relieve():
            retries += 1
            logger.debug("%s: code %d on %d; memory freed, retrying", what, raw, used)
            continue
        if used <= floor:
            return RetryOutcome(code, raw, budget, used, retries)
        budget = max(floor, used // 2)
        retries += 1
        logger.debug("%s: code %d on %d; retrying with %d", what, raw, used, budget)
