"""The worker skeleton alone (``llamabatch.runtime.worker``), with a fake unit of work.

No llama.cpp, no sleeps: the worker is held inside a step with events, so every ordering
below is forced, not hoped for.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from llamabatch._ffi.context import DecodeCode
from llamabatch.errors import EngineClosed, LlamaBatchError
from llamabatch.runtime.worker import Worker, halve_and_retry

WAIT = 10.0  # seconds: only reached when a test is broken


class Job:
    """A unit of work that records how it ended, and how many times (must be once)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.endings: list[tuple[str, Any]] = []
        self.ended = threading.Event()

    def end(self, kind: str, payload: Any) -> None:
        self.endings.append((kind, payload))
        self.ended.set()

    @property
    def outcome(self) -> tuple[str, Any]:
        assert self.ended.wait(WAIT), "the job never ended"
        assert len(self.endings) == 1, f"ended {len(self.endings)} times: {self.endings}"
        return self.endings[0]


class FakeWorker(Worker):
    """A worker that is its own task (``Worker(name, task)``): runs ``step(job)`` per job;
    ``fail_pending`` ends the queued and the running jobs."""

    _kind = "fake"

    def __init__(self, step: Callable[[FakeWorker, Job], Any], start: bool = True) -> None:
        super().__init__("test-worker", self)
        self.step = step
        self.queue: deque[Job] = deque()
        self.current: Job | None = None
        self.in_step = False
        self.freed: list[bool] = []  # one entry per on_close: was a step running then?
        self.interrupts = 0
        self.fail_pending_calls = 0
        if start:
            self.start()

    def submit(self, value: Any) -> Job:
        job = Job(value)
        with self.cond:
            self.raise_if_closed()
            self.queue.append(job)
            self.cond.notify_all()
        return job

    def has_work(self) -> bool:
        return bool(self.queue)

    def run_once(self) -> None:
        with self.cond:
            job = self.current = self.queue.popleft()
        self.in_step = True
        try:
            result = self.step(self, job)
        finally:
            self.in_step = False
        job.end("ok", result)
        self.current = None

    def fail_pending(self, error: BaseException) -> None:
        self.fail_pending_calls += 1
        with self.cond:
            jobs = list(self.queue)
            self.queue.clear()
        if self.current is not None:
            jobs.insert(0, self.current)
            self.current = None
        for job in jobs:
            job.end("error", error)

    def on_close(self) -> None:
        self.freed.append(self.in_step)

    def interrupt(self) -> None:
        self.interrupts += 1


class Gate:
    """Holds the worker inside a step until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        assert self.release.wait(WAIT)


@pytest.fixture
def gated() -> Iterator[tuple[FakeWorker, Gate]]:
    gate = Gate()

    def step(worker: FakeWorker, job: Job) -> Any:
        if job.value == "hold":
            gate.hold()
        return job.value

    worker = FakeWorker(step)
    yield worker, gate
    gate.release.set()
    worker.close(WAIT)


def _joined(worker: Worker) -> bool:
    worker.join(WAIT)
    return not worker.alive


# --------------------------------------------------------------------------- calls


def test_call_runs_on_the_worker_thread_and_returns_or_raises(gated: tuple[FakeWorker, Gate]) -> None:
    worker, _ = gated
    assert worker.call(lambda: threading.current_thread().name) == "test-worker"

    def boom() -> None:
        raise KeyError("from fn")

    with pytest.raises(KeyError, match="from fn"):
        worker.call(boom)
    assert worker.call(lambda: 42) == 42  # a failed call leaves the worker serving
    assert worker.submit("x").outcome == ("ok", "x")


def test_call_from_the_worker_thread_runs_directly() -> None:
    seen: list[Any] = []

    def step(worker: FakeWorker, job: Job) -> Any:
        seen.append(worker.on_worker_thread)
        return worker.call(lambda: ("inline", worker.in_step))  # would deadlock if queued

    worker = FakeWorker(step)
    try:
        assert worker.submit(1).outcome == ("ok", ("inline", True))
        assert seen == [True] and not worker.on_worker_thread
    finally:
        worker.close(WAIT)


def test_calls_run_between_units_in_order(gated: tuple[FakeWorker, Gate]) -> None:
    worker, gate = gated
    order: list[str] = []
    held = worker.submit("hold")
    assert gate.entered.wait(WAIT)
    callers = []
    for k in range(3):
        caller = threading.Thread(target=worker.call, args=(lambda k=k: order.append(f"call{k}"),))
        caller.start()
        callers.append(caller)
        assert _until(lambda n=k + 1: len(worker._calls) == n)  # queued before the next caller starts
    gate.release.set()
    for t in callers:
        t.join(WAIT)
    assert held.outcome == ("ok", "hold")
    assert order == ["call0", "call1", "call2"]


def _until(predicate: Callable[[], bool]) -> bool:
    """Wait for a condition another thread makes true, without sleeping blindly."""
    event = threading.Event()
    for _ in range(100_000):
        if predicate():
            return True
        event.wait(0.0001)
    return False


def test_call_timeout_never_runs_the_call_later(gated: tuple[FakeWorker, Gate]) -> None:
    worker, gate = gated
    worker.submit("hold")
    assert gate.entered.wait(WAIT)
    ran: list[int] = []
    with pytest.raises(TimeoutError):
        worker.call(lambda: ran.append(1), timeout=0.01)
    gate.release.set()
    assert worker.call(lambda: "after") == "after"  # calls run in order: the cancelled one was skipped
    assert ran == []


# --------------------------------------------------------------------------- close


def test_close_from_another_thread_ends_pending_work_once(gated: tuple[FakeWorker, Gate]) -> None:
    worker, gate = gated
    held = worker.submit("hold")
    assert gate.entered.wait(WAIT)
    queued = [worker.submit(k) for k in range(3)]
    call_result: list[BaseException] = []

    def pending_call() -> None:
        try:
            worker.call(lambda: "never")
        except EngineClosed as exc:
            call_result.append(exc)

    caller = threading.Thread(target=pending_call)
    caller.start()
    assert _until(lambda: len(worker._calls) == 1)
    closer = threading.Thread(target=worker.close)
    closer.start()
    assert _until(lambda: worker.closed)
    assert worker.interrupts == 1 and worker.freed == []  # nothing freed under the running step
    gate.release.set()
    closer.join(WAIT)
    caller.join(WAIT)
    assert not closer.is_alive() and _joined(worker)
    assert held.outcome == ("ok", "hold")  # the unit in flight finished
    for job in queued:
        kind, error = job.outcome
        assert kind == "error" and isinstance(error, EngineClosed)
    assert len(call_result) == 1
    assert worker.freed == [False] and worker.fail_pending_calls == 1
    with pytest.raises(EngineClosed, match="fake is closed"):
        worker.submit("late")
    with pytest.raises(EngineClosed):
        worker.call(lambda: 1)
    worker.close()  # idempotent
    assert worker.interrupts == 1 and worker.freed == [False]


def test_close_from_the_worker_thread_is_deferred_until_the_unit_ends() -> None:
    trace: list[str] = []
    release = threading.Event()

    def step(worker: FakeWorker, job: Job) -> Any:
        if job.value == "close":
            assert release.wait(WAIT)  # the other jobs are queued by now
            worker.close()  # e.g. from a telemetry listener: must not free or join here
            trace.append(f"after close: closed={worker.closed} freed={worker.freed}")
            worker.close()  # still idempotent
        return job.value

    worker = FakeWorker(step)
    first = worker.submit("close")
    rest = [worker.submit(k) for k in range(3)]
    release.set()
    assert first.outcome == ("ok", "close")  # the unit that called close() completed
    assert trace == ["after close: closed=True freed=[]"]
    assert _joined(worker)
    assert worker.freed == [False]  # freed once, after the step, by the worker thread
    for job in rest:
        kind, error = job.outcome
        assert kind == "error" and isinstance(error, EngineClosed)
    worker.close()  # from another thread after the fact: returns at once


def test_close_before_start_ends_and_frees() -> None:
    worker = FakeWorker(lambda w, j: None, start=False)
    queued = Job("q")
    worker.queue.append(queued)
    with pytest.raises(RuntimeError, match="never started"):
        worker.call(lambda: 1)
    worker.close()
    assert worker.closed and worker.freed == [False] and worker.fail_pending_calls == 1
    assert queued.outcome[0] == "error"


# --------------------------------------------------------------------------- crash containment


def test_a_crash_ends_every_job_once_logs_once_and_closes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    unhandled: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    gate = Gate()

    def step(worker: FakeWorker, job: Job) -> Any:
        if job.value == "crash":
            gate.hold()
            raise RuntimeError("a bug in the unit of work")
        return job.value

    worker = FakeWorker(step)
    with caplog.at_level(logging.CRITICAL, logger="llamabatch"):
        ok = worker.submit("fine")
        assert ok.outcome == ("ok", "fine")
        crash = worker.submit("crash")
        queued = [worker.submit(k) for k in range(4)]
        assert gate.entered.wait(WAIT)
        caller_errors: list[BaseException] = []

        def pending_call() -> None:
            try:
                worker.call(lambda: "never")
            except LlamaBatchError as exc:
                caller_errors.append(exc)

        caller = threading.Thread(target=pending_call)
        caller.start()
        assert _until(lambda: len(worker._calls) == 1)
        gate.release.set()
        caller.join(WAIT)
        assert _joined(worker)
    for job in [crash, *queued]:
        kind, error = job.outcome
        assert kind == "error" and type(error) is LlamaBatchError
        assert "crashed" in str(error) and "a bug in the unit of work" in str(error)
    assert len(caller_errors) == 1 and "crashed" in str(caller_errors[0])
    crashes = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(crashes) == 1 and crashes[0].exc_info is not None
    assert unhandled == []  # logged once: not re-raised into threading.excepthook
    assert worker.closed and worker.freed == [False] and worker.fail_pending_calls == 1
    with pytest.raises(EngineClosed):
        worker.submit("after the crash")
    worker.close()  # still fine


# --------------------------------------------------------------------------- halve_and_retry


class Script:
    """``run(budget)`` answering scripted codes; records the budgets it was given."""

    def __init__(self, codes: list[int], used: Callable[[int], int] = lambda budget: budget) -> None:
        self.codes = deque(codes)
        self.used = used
        self.budgets: list[int] = []

    def __call__(self, budget: int) -> tuple[int, int]:
        self.budgets.append(budget)
        return self.codes.popleft(), self.used(budget)


def test_retry_ok_at_once() -> None:
    run = Script([0])
    outcome = halve_and_retry(run, 512)
    assert outcome.ok and outcome.code is DecodeCode.OK and outcome.retries == 0
    assert run.budgets == [512] and outcome.budget == 512 and outcome.used == 512


def test_retry_halves_what_was_used() -> None:
    run = Script([1, -2, 0])  # no KV slot, then a failed allocation (both retryable), then OK
    outcome = halve_and_retry(run, 512)
    assert outcome.ok and outcome.retries == 2 and run.budgets == [512, 256, 128]
    # a batch that used less than its budget: half of what it used, not of the budget
    run = Script([1, 0], used=lambda budget: min(budget, 300))
    assert halve_and_retry(run, 512).ok and run.budgets == [512, 150]


def test_retry_stops_at_the_floor() -> None:
    run = Script([1] * 10)
    outcome = halve_and_retry(run, 512, floor=100)
    assert run.budgets == [512, 256, 128, 100]
    assert not outcome.ok and outcome.code is DecodeCode.NO_KV_SLOT and outcome.raw == 1
    assert outcome.used == 100 and outcome.retries == 3
    run = Script([-2])  # already at the floor: one attempt
    assert halve_and_retry(run, 1).code is DecodeCode.ALLOC_FAILED and run.budgets == [1]


def test_retry_relieves_memory_before_halving() -> None:
    log: list[str] = []
    frees = deque([True, True, False, False])

    def relieve() -> bool:
        log.append("relieve")
        return frees.popleft()

    codes = deque([1, 1, 1, 1, 0])

    def run(budget: int) -> tuple[int, int]:
        log.append(f"run {budget}")
        return codes.popleft(), budget

    outcome = halve_and_retry(run, 64, relieve=relieve)
    assert outcome.ok and outcome.retries == 4
    assert log == [
        "run 64", "relieve",  # freed something: same budget
        "run 64", "relieve",
        "run 64", "relieve",  # nothing left to free: halve
        "run 32", "relieve",
        "run 16",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "code"), [(2, DecodeCode.ABORTED), (-1, DecodeCode.INVALID_BATCH), (-7, DecodeCode.FATAL)]
)
def test_retry_returns_other_codes_at_once(raw: int, code: DecodeCode) -> None:
    relieved: list[int] = []
    run = Script([raw])
    outcome = halve_and_retry(run, 512, relieve=lambda: relieved.append(1) or True)
    assert outcome.code is code and outcome.raw == raw and outcome.retries == 0
    assert run.budgets == [512] and relieved == []


def test_retry_as_the_embedder_uses_it() -> None:
    # Sequences of a pack; the "context" has room for 300 tokens per decode. A retry halves
    # the part; only the sequence that does not fit alone fails, the rest is decoded.
    lengths = [120, 90, 400, 60, 70]
    decoded: list[list[int]] = []
    failed: list[int] = []
    start = 0
    limit = sum(lengths)
    while start < len(lengths):
        part: list[int] = []

        def attempt(budget: int, start: int = start, part: list[int] = part) -> tuple[int, int]:
            part.clear()
            part.append(start)
            tokens = lengths[start]
            for i in range(start + 1, len(lengths)):
                if tokens + lengths[i] > budget:
                    break
                part.append(i)
                tokens += lengths[i]
            return (0 if tokens <= 300 else 1), tokens

        outcome = halve_and_retry(attempt, limit, floor=lengths[start])
        limit = outcome.budget
        if outcome.ok:
            decoded.append(list(part))
        else:
            failed.extend(part)
        start += len(part)
    assert failed == [2]
    assert sorted(i for part in decoded for i in part) == [0, 1, 3, 4]


# --------------------------------------------------------------------------- interpreter exit

EXIT_CHILD = """
import sys, threading, time
from llamabatch.runtime.worker import Worker

class Task:
    failed = threading.Event()
    def has_work(self): return True
    def run_once(self): raise RuntimeError("a bug in the unit of work")
    def fail_pending(self, error): self.failed.set()
    def on_close(self):
        time.sleep(0.5)  # freeing a model takes a while
        open(sys.argv[1], "w").write("freed")
    def interrupt(self): pass

task = Task()
Worker("exit-test", task).start()
assert task.failed.wait(10)
# the caller's work has ended: the script exits while the crashed thread is still freeing
"""


def test_interpreter_exit_waits_for_a_crashed_worker_to_free_its_resources(tmp_path: Any) -> None:
    """A caller whose requests failed may exit at once; the worker thread, a daemon, is then
    still freeing the model. Frozen mid-``llama_free`` by finalisation, it aborted the
    process; exit must wait for it."""
    import subprocess
    import sys

    marker = tmp_path / "freed"
    child = subprocess.run(
        [sys.executable, "-c", EXIT_CHILD, str(marker)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert marker.read_text() == "freed", "the worker thread was frozen before it freed its resources"
