"""Run a thread's CPU work at a lower OS priority than the rest of the process.

A server's bulk work that clients choose (tokenizing big prompts, rendering templates,
building grammars, reranking, JSON-encoding big answers) shares the CPUs with the engine
thread that decodes everyone's tokens. On Linux the niceness is a property of each thread,
not of the process: raising a thread's niceness lowers only that thread, and the threads it
creates afterwards inherit it (so the OpenMP or ggml threads a niced engine thread starts
for its decodes are niced too). Raising it needs no privilege; lowering it back does, so
nothing here ever lowers it.

The niceness is counted from the main thread's (a server started with ``nice -n 5`` runs
its workers at ``5 + N``), capped at 19, the lowest priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["DEFAULT_WORKER_NICE", "MAX_NICE", "lower_thread_priority", "thread_niceness"]

logger = logging.getLogger("llamabatch")

#: the lowest priority (highest niceness) Linux has
MAX_NICE = 19
#: niceness levels ``llamabatch serve`` runs its bulk workers below the generation engine's
#: thread (``--worker-nice``; ``server/offload.py``)
DEFAULT_WORKER_NICE = 10


def _supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def thread_niceness(native_id: int | None = None) -> int | None:
    """The niceness of the thread whose kernel id is ``native_id`` (default: the calling
    thread), or None where threads have no niceness of their own (not Linux)."""
    if not _supported():
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if native_id is None else native_id)


def lower_thread_priority(nice: int) -> bool:
    """Make the calling thread ``nice`` levels nicer than the main thread (at most
    :data:`MAX_NICE`); True when its niceness is that now.

    ``nice`` 0 does nothing. A thread already at least that nice is left as it is (its
    niceness is never lowered). Where threads have no niceness of their own, or the call is
    refused, it does nothing and logs why (debug).

    Raises:
        ValueError: ``nice`` is not an int in ``[0, 19]``.
    """
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice must be an int in [0, {MAX_NICE}], got {nice!r}")
    if nice == 0:
        return False
    if not _supported():
        logger.debug("no per-thread niceness on %s: the worker runs at normal priority", sys.platform)
        return False
    tid = threading.get_native_id()
    try:
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, tid) >= target:
            return True
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as exc:
        logger.debug("could not raise thread %d's niceness to %d: %s", tid, target, exc)
        return False
    return True
