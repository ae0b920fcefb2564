"""Route llama.cpp's log to the ``llamabatch.llama_cpp`` logger (quiet by default).

llama.cpp logs a lot at INFO while loading a model; we forward WARN and ERROR as
warnings and errors, and everything else at DEBUG, so nothing shows unless asked for.
"""

from __future__ import annotations

import logging

from llamabatch._ffi._llama import ffi, lib

logger = logging.getLogger("llamabatch.llama_cpp")

_LEVELS = {
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
}
_pending: list[str] = []
_pending_level = logging.DEBUG


@ffi.def_extern()
def _llamabatch_log_callback(level, text, user_data):  # pragma: no cover - called from C
    global _pending_level
    try:
        message = ffi.string(text).decode("utf-8", "replace")
        if level != lib.GGML_LOG_LEVEL_CONT:
            _pending_level = _LEVELS.get(level, logging.DEBUG)
        # llama.cpp emits lines in pieces; log whole lines only.
        _pending.append(message)
        if message.endswith("\n"):
            line = "".join(_pending).rstrip("\n")
            _pending.clear()
            if logger.isEnabledFor(_pending_level):
                logger.log(_pending_level, "%s", line)
    except Exception:  # a log callback must never raise into C
        pass


def install() -> None:
    lib.llama_log_set(lib._llamabatch_log_callback, ffi.NULL)
