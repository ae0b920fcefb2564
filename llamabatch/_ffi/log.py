"""Route llama.cpp's log to the ``llamabatch.llama_cpp`` logger (quiet by default).

llama.cpp logs a lot at INFO while loading a model; we forward WARN and ERROR as warnings and
errors, and everything else at DEBUG, so nothing shows unless asked for. Lines under WARN do
not even reach Python unless the logger is enabled for DEBUG when a model or context is made
(:func:`sync_level`): each line that does takes the GIL from inside llama.cpp. The routing is
set again with every model and context (:func:`install`).

Some of llama.cpp's warnings and errors are expected in normal operation and handled by
llamabatch: a decode aborted because a request was cancelled or the engine closed, a batch
retried smaller because the KV cache had no room, a context shorter than the model's training
context. Those go to DEBUG too (see :data:`EXPECTED`); every other warning and error keeps its
level.

While a model loads, :func:`capture` holds back llama.cpp's warnings and errors so that a
failed load can put llama.cpp's own reason into the ``ModelLoadError`` (see :func:`load_reason`)
instead of printing it apart from the exception.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from llamabatch._ffi._llama import ffi, lib

logger = logging.getLogger("llamabatch.llama_cpp")

_LEVELS = {
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
}

#: Messages llamabatch expects and handles, logged at DEBUG whatever llama.cpp's level.
EXPECTED = re.compile(
    "|".join(
        [
            # An abort callback stopped a decode (a cancelled request, an engine closing).
            # GGML_STATUS_ABORTED is 1; llama_decode/llama_encode return 2 for it.
            r"compute aborted",
            r"failed to compute graph, compute status: 1\b",
            r"graph_compute_async failed with error 1\b",
            r"failed to (?:de|en)code, ret = 2\b",
            # No room in the KV cache: the engine retries with a smaller batch.
            r"failed to find a memory slot",
            r"failed to decode, ret = 1\b",
            # What llama.cpp does after a failed or aborted ubatch; the caller reports the failure.
            r"removing memory module entries for seq_id",
            # Contexts smaller (or larger) than the training context are the caller's choice.
            r"n_ctx_seq \(\d+\) [<>] n_ctx_train",
            # The Embedder's pooling= overrides what the GGUF declares, on purpose.
            r"model default pooling_type is \[-?\d+\], but \[-?\d+\] was specified",
        ]
    )
)

# llama.cpp emits a line in pieces (GGML_LOG_LEVEL_CONT continues the previous one); the
# pieces of one line come from one thread, so the partial line is kept per thread.
_local = threading.local()


class Capture:
    """Warnings and errors llama.cpp logged on this thread inside :func:`capture`."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str]] = []

    @property
    def errors(self) -> list[str]:
        return [line for level, line in self.records if level >= logging.ERROR]

    @property
    def warnings(self) -> list[str]:
        return [line for level, line in self.records if level == logging.WARNING]

    def release(self, failed: bool) -> None:
        """Log the held lines: at their own levels, or at DEBUG when ``failed`` (the caller
        raises an exception carrying them instead)."""
        records, self.records = self.records, []
        for level, line in records:
            level = logging.DEBUG if failed else level
            if logger.isEnabledFor(level):
                logger.log(level, "%s", line)


@contextmanager
def capture() -> Iterator[Capture]:
    """Hold back llama.cpp's warnings and errors logged by this thread until the block ends.

    The caller calls ``Capture.release(failed)``; lines not released are logged at their own
    levels when the block ends.
    """
    cap = Capture()
    previous = getattr(_local, "capture", None)
    _local.capture = cap
    try:
        yield cap
    finally:
        _local.capture = previous
        cap.release(False)


def _emit(level: int, line: str) -> None:
    if level >= logging.WARNING and EXPECTED.search(line):
        level = logging.DEBUG
    cap = getattr(_local, "capture", None)
    if cap is not None and level >= logging.WARNING:
        cap.records.append((level, line))
        return
    if logger.isEnabledFor(level):
        logger.log(level, "%s", line)


@ffi.def_extern()
def _llamabatch_log_callback(level, text, user_data):  # pragma: no cover - called from C
    try:
        message = ffi.string(text).decode("utf-8", "replace")
        pending = getattr(_local, "pending", None)
        if pending is None:
            pending = _local.pending = []
            _local.level = logging.DEBUG
        if level != lib.GGML_LOG_LEVEL_CONT:
            _local.level = _LEVELS.get(level, logging.DEBUG)
        pending.append(message)
        if message.endswith("\n"):
            line = "".join(pending).rstrip("\n")
            pending.clear()
            _emit(_local.level, line)
    except Exception:  # a log callback must never raise into C
        pass


_PREFIX = re.compile(r"^\w+: ")
# Lines that only say that loading failed, not why.
_GENERIC = re.compile(r"failed to load model(?: from .*)?|llama_model_loader: failed to load model from .*")


def load_reason(lines: list[str]) -> str:
    """The reason llama.cpp gave for rejecting a model, from the error lines it logged."""
    reasons: list[str] = []
    for line in lines:
        text = line.strip()
        while True:  # "llama_model_load: error loading model: llama_model_loader: ..." -> the why
            stripped = _PREFIX.sub("", text, count=1)
            stripped = re.sub(r"^error loading model(?: \w+)?: ", "", stripped)
            if stripped == text:
                break
            text = stripped
        if text and not _GENERIC.fullmatch(text) and text not in reasons:
            reasons.append(text)
    return "; ".join(reasons)


def sync_level() -> None:
    """Let llama.cpp's lines under WARN reach Python only while the ``llamabatch.llama_cpp``
    logger is enabled for DEBUG: a C filter drops them otherwise, before they take the GIL."""
    lib.llamabatch_log_debug = 1 if logger.isEnabledFor(logging.DEBUG) else 0


def install() -> None:
    """Route llama.cpp's log here, at the logger's level now (:func:`sync_level`). Called when
    the backend starts and again whenever a model or context is made: llama.cpp has one log
    callback per process, and another binding in it takes it (llama-cpp-python does when
    imported), which left a failed load without llama.cpp's reason."""
    sync_level()
    lib.llama_log_set(lib.llamabatch_log_filter, ffi.NULL)
