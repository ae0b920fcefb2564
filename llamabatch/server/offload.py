"""Bounded worker pools for the server's CPU-heavy steps, and each request's budget of them.

A request's CPU-heavy steps (parsing a big body, tokenizing, rendering a chat template,
building samplers and grammars, tokenizing rerank pairs, encoding a big answer as JSON) run
off the event loop, in one of a few small pools of daemon threads, one pool per kind of step
(:data:`PREPARE`, :data:`GRAMMAR`, :data:`RERANK`, :data:`ENCODE`): hostile grammars or
rerank queries can fill their own pool, never the one that tokenizes a plain prompt.

Each request awaits one step at a time, and its steps share a budget of wall-clock time
(``WorkLimits.timeout_s``: waiting for a worker counts, waiting for generation does not). A
step is abandoned when its budget runs out (the client gets 503 ``work_timeout``), when its
client disconnects, or when the server shuts down: its result is dropped, and its thread is
interrupted (an exception raised in it at its next Python instruction; a call into C returns
first). The pool starts a replacement thread for one that has not stopped yet (up to as many
as the pool has workers), so abandoned work does not take a pool's capacity.

The threads are daemon threads, never joined at exit: a stuck one cannot hold up shutdown.

The engine threads share the GIL with these pools: every C call (a decode, a sampler, a
logits row) gives it up and takes it back, dozens of times per tick. While a pool thread runs
Python, taking it back waits for the interpreter's switch interval, 5 ms by default: a tick of
a millisecond took tens. ``llamabatch serve`` shortens the interval
(:func:`shorten_gil_waits`).

They share the CPUs too: the pools' threads, and a served reranker's or embedder's engine
thread (:func:`lower_engine_priority`), run ``WorkLimits.nice`` levels below the generation
engine's thread (``--worker-nice``, default 10), so clients' bulk work takes the CPUs the
decodes leave idle rather than slowing every stream.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

from llamabatch.errors import EngineClosed
from llamabatch.runtime.thread_priority import DEFAULT_WORKER_NICE, MAX_NICE, lower_thread_priority
from llamabatch.server.protocol import APIError

logger = logging.getLogger("llamabatch.server")

__all__ = [
    "ENCODE",
    "GRAMMAR",
    "POOLS",
    "PREPARE",
    "RERANK",
    "Offload",
    "RequestWork",
    "WorkAbandoned",
    "WorkLimits",
    "lower_engine_priority",
    "run_step",
    "shorten_gil_waits",
    "small_work",
]

T = TypeVar("T")

#: tokenizing and detokenizing prompts, rendering chat templates, parsing big bodies
PREPARE = "prepare"
#: sampling parameters holding grammars, JSON schemas or tools
GRAMMAR = "grammar"
#: tokenizing (query, document) pairs for /v1/rerank
RERANK = "rerank"
#: building and JSON-encoding big answers (log-probabilities, embeddings)
ENCODE = "encode"
POOLS = (PREPARE, GRAMMAR, RERANK, ENCODE)

#: the status of a request whose steps ran past their budget (see ``work_timeout_error``)
WORK_TIMEOUT_STATUS = 503
#: characters (or token ids) of text a step may take and still run on the event loop
SMALL_STEP_CHARS = 2048
#: the interpreter's switch interval in the server (seconds; CPython's default is 0.005)
SWITCH_INTERVAL_S = 0.0005


def shorten_gil_waits(interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Set the interpreter's switch interval to ``interval_s`` unless it is shorter already:
    a thread back from a C call gets the GIL from a thread running Python within it (see the
    module). Process-wide: ``llamabatch serve`` calls it, an embedding application may."""
    if sys.getswitchinterval() > interval_s:
        sys.setswitchinterval(interval_s)


@dataclass(frozen=True)
class WorkLimits:
    """The bounds of the server's CPU-heavy steps (:func:`llamabatch.server.create_app`).

    Args:
        timeout_s: wall-clock seconds one request's steps may take in all (``--work-timeout-s``).
        threads: worker threads of each pool (``--work-threads``).
        nice: niceness levels the pools' threads run below the engine threads (``--worker-nice``;
            ``runtime/thread_priority.py``): clients' bulk work takes the CPUs only when the
            decodes leave them idle. 0: the same priority.
    """

    timeout_s: float = 30.0
    threads: int = 2
    nice: int = DEFAULT_WORKER_NICE

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 1 <= self.threads <= 64:
            raise ValueError(f"threads must be an int in [1, 64], got {self.threads!r}")
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) or not 0 <= self.nice <= MAX_NICE:
            raise ValueError(f"nice must be an int in [0, {MAX_NICE}], got {self.nice!r}")


class WorkAbandoned(BaseException):
    """Raised inside a step's thread to stop a step nobody waits for any more (a
    ``BaseException``, so ``except Exception`` in the step's code does not swallow it)."""


def _interrupt(thread_id: int) -> None:
    """Raise ``WorkAbandoned`` in thread ``thread_id`` at its next Python instruction."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(WorkAbandoned)
    )
    if done > 1:  # pragma: no cover - cannot happen for a live thread id; undo as CPython's docs say
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


def _clear_interrupt() -> None:
    """Drop an interrupt sent to this thread that has not fired yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)


class _Job:
    """One step: ``fn(*args)`` and the asyncio future its request awaits."""

    __slots__ = ("args", "fn", "future", "interrupted", "kwargs", "loop", "state", "thread_id")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()
        self.state = "queued"  # -> running -> done, or -> abandoned
        self.thread_id = 0
        self.interrupted = False

    def settle(self, value: Any, error: BaseException | None) -> None:
        """Hand the outcome to the loop (dropped if the request stopped waiting)."""

        def deliver() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass


class WorkPool:
    """Up to ``threads`` daemon threads (started when work comes) running queued steps in
    order; abandoned steps are interrupted, and a thread still busy with one is replaced
    (at most ``threads`` such: never more than ``2 * threads`` threads in all). Each thread
    runs ``nice`` levels below the main thread (``runtime/thread_priority.py``)."""

    def __init__(self, name: str, threads: int, nice: int = 0) -> None:
        self.name = name
        self.threads = threads
        self.nice = nice
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: set[_Job] = set()
        self._live = 0  # threads alive
        self._idle = 0  # threads waiting for a step
        self._written_off = 0  # threads still busy with an abandoned step
        self._closed = False

    def _grow(self) -> None:
        """Start a thread if queued work has none and the pool is short of serving threads."""
        serving = self._live - self._written_off
        if (
            self._queue
            and self._idle < len(self._queue)
            and serving < self.threads
            and self._live < 2 * self.threads
        ):
            self._live += 1
            threading.Thread(target=self._serve, name=f"llamabatch-{self.name}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Job:
        """Queue ``fn(*args, **kwargs)``; await the returned job's ``future``."""
        job = _Job(fn, args, kwargs)
        with self._cond:
            if self._closed:
                raise _shutting_down()
            self._queue.append(job)
            self._grow()
            self._cond.notify()
        return job

    def abandon(self, job: _Job) -> None:
        """Stop waiting for ``job``: dropped if queued, interrupted if running."""
        with self._cond:
            if job.state == "queued":
                self._queue.remove(job)
            elif job.state == "running" and job.thread_id:
                _interrupt(job.thread_id)
                job.interrupted = True
                self._running.discard(job)
                self._written_off += 1  # its thread leaves, if replaced, when the step returns
                if not self._closed:
                    self._grow()
            else:
                return
            job.state = "abandoned"

    def close(self) -> None:
        """Abandon every queued and running step; idle threads exit."""
        with self._cond:
            self._closed = True
            queued, running = list(self._queue), list(self._running)
        for job in queued + running:
            self.abandon(job)
            try:
                job.loop.call_soon_threadsafe(_fail, job, _shutting_down())
            except RuntimeError:  # its loop is closed: nobody is waiting
                pass
        with self._cond:
            self._cond.notify_all()

    @property
    def busy(self) -> int:
        """Threads running a step, abandoned ones included."""
        with self._cond:
            return len(self._running) + self._written_off

    def _next(self) -> _Job | None:
        with self._cond:
            while not self._queue:
                if self._closed:
                    self._live -= 1
                    return None
                self._idle += 1
                try:
                    self._cond.wait()
                finally:
                    self._idle -= 1
            job = self._queue.popleft()
            job.state, job.thread_id = "running", threading.get_ident()
            self._running.add(job)
            return job

    def _serve(self) -> None:
        lower_thread_priority(self.nice)
        while True:
            try:
                job = self._next()
                if job is None:
                    return
                if not self._run(job):
                    return  # written off while it ran: a replacement serves the queue
            except WorkAbandoned:
                continue  # an interrupt that fired after its step had returned

    def _run(self, job: _Job) -> bool:
        """Run ``job``; False when this thread was written off while running it."""
        value: Any = None
        error: BaseException | None = None
        try:
            value = job.fn(*job.args, **job.kwargs)
        except WorkAbandoned:
            error = None
        except BaseException as exc:  # the request's error, raised where it awaits
            error = exc
        while True:  # leave the job (once): no interrupt can be sent for it after this block
            try:
                with self._cond:
                    if job.thread_id:
                        self._running.discard(job)
                        if job.state == "abandoned":
                            self._written_off -= 1
                        else:
                            job.state = "done"
                        job.thread_id = 0
                break
            except WorkAbandoned:
                continue
        abandoned = job.state == "abandoned"
        if job.interrupted:
            try:
                _clear_interrupt()
            except WorkAbandoned:
                pass
        if abandoned:
            with self._cond:
                if self._live - self._written_off <= self.threads and not self._closed:
                    return True  # the pool is short of threads: stay
                self._live -= 1
            return False
        job.settle(value, error)
        del job, value, error  # the error's traceback holds this frame: no cycle through the job
        return True


def _fail(job: _Job, error: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(error)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


def work_timeout_error(timeout_s: float) -> APIError:
    """The answer to a request whose steps ran past their budget: 503 ``work_timeout``."""
    return APIError(
        WORK_TIMEOUT_STATUS,
        f"the request's processing took more than its {timeout_s:g} s budget (--work-timeout-s) "
        "and was abandoned; send a smaller request (or retry when the server is less busy)",
        type="server_error",
        code="work_timeout",
    )


class Offload:
    """The server's worker pools (one per name of :data:`POOLS`) and its ``WorkLimits``."""

    def __init__(self, limits: WorkLimits | None = None) -> None:
        self.limits = limits if limits is not None else WorkLimits()
        self.pools = {name: WorkPool(name, self.limits.threads, self.limits.nice) for name in POOLS}
        self.closed = False

    def close(self) -> None:
        """Abandon all work (its requests get 503); call on the event loop's thread."""
        self.closed = True
        for pool in self.pools.values():
            pool.close()

    def reopen(self) -> None:
        """New pools after ``close`` (an app served again, e.g. by a second test client)."""
        if self.closed:
            self.pools = {name: WorkPool(name, self.limits.threads, self.limits.nice) for name in POOLS}
            self.closed = False

    def request(
        self, state: Any, receive: Callable[[], Awaitable[MutableMapping[str, Any]]] | None
    ) -> RequestWork:
        """The ``RequestWork`` kept on a request's ``state`` (made on first use)."""
        work = getattr(state, "work", None)
        if work is None:
            work = RequestWork(self, receive)
            state.work = work
        return work


async def _wait_disconnect(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RequestWork:
    """One request's steps: one at a time, within one budget, abandoned if its client leaves."""

    def __init__(
        self, offload: Offload, receive: Callable[[], Awaitable[MutableMapping[str, Any]]] | None
    ) -> None:
        self.offload = offload
        self.receive = receive
        self.spent = 0.0  # seconds of steps so far

    async def run(
        self, pool: str, fn: Callable[..., T], /, *args: Any, watch: bool = True, **kwargs: Any
    ) -> T:
        """``fn(*args, **kwargs)`` on a thread of ``pool``; its exception is raised here.

        ``watch``: race the step against the client's disconnect (``ClientGone``); off where
        something else already watches (a streamed answer's pump cancels the awaiting task).
        Raises ``APIError`` 503 ``work_timeout`` past the budget."""
        from llamabatch.server.streaming import ClientGone

        budget = self.offload.limits.timeout_s
        left = budget - self.spent
        if left <= 0:
            raise work_timeout_error(budget)
        job = self.offload.pools[pool].submit(fn, args, kwargs)
        loop = asyncio.get_running_loop()
        start = loop.time()
        waits: set[asyncio.Future[Any]] = {job.future}
        watcher = None
        if watch and self.receive is not None:
            watcher = asyncio.ensure_future(_wait_disconnect(self.receive))
            waits.add(watcher)
        try:
            done, _ = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the request is gone
            self.offload.pools[pool].abandon(job)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            self.spent += loop.time() - start
        if job.future in done:
            future = job.future
            del job, waits, done  # a raised error's traceback holds this frame: no cycle through it
            try:
                return future.result()  # type: ignore[no-any-return]
            finally:
                del future
        self.offload.pools[pool].abandon(job)
        job.future.cancel()
        if watcher is not None and watcher in done:
            raise ClientGone
        logger.warning(
            "a request's %s step ran past its %g s budget (--work-timeout-s): abandoned", pool, budget
        )
        raise work_timeout_error(budget)


def lower_engine_priority(engines: Iterable[Any], nice: int) -> None:
    """Run each of ``engines``' worker threads (an ``Embedder``'s, a ``Reranker``'s: bulk work
    that clients choose) ``nice`` levels below the main thread, the generation engine's
    priority; the OpenMP and ggml threads each starts for its decodes from then on inherit it
    (see ``runtime/thread_priority.py``). ``None`` entries and closed engines are skipped."""
    if nice == 0:
        return
    for engine in engines:
        if engine is None:
            continue
        try:
            engine.call(functools.partial(lower_thread_priority, nice))
        except EngineClosed:
            logger.debug("%s is closed: its thread's priority is left as it is", type(engine).__name__)


def small_work(texts: Iterable[Any], max_chars: int = SMALL_STEP_CHARS) -> bool:
    """Whether a step over ``texts`` (strings, bytes or token id lists) is small enough to run
    on the event loop (see :func:`run_step`): at most ``max_chars`` characters, bytes or ids
    in all."""
    total = 0
    for text in texts:
        total += len(text) if isinstance(text, (str, bytes, list, tuple)) else max_chars + 1
        if total > max_chars:
            return False
    return True


async def run_step(
    request: Any, pool: str, fn: Callable[..., T], /, *args: Any, small: bool = False, **kwargs: Any
) -> T:
    """Run ``fn(*args, **kwargs)`` as one of a Starlette ``request``'s steps, on ``pool``
    (the app's ``Offload`` is ``request.app.state.offload``).

    ``small``: the step is known to take microseconds (a short prompt to tokenize, a short
    answer to encode: :func:`small_work`), and runs on the event loop at once: a thread hop,
    and a wait behind other requests' heavy steps in the pool's queue, would cost a short
    request more than the step itself."""
    if small:
        return fn(*args, **kwargs)
    offload: Offload = request.app.state.offload
    return await offload.request(request.state, request.receive).run(pool, fn, *args, **kwargs)
