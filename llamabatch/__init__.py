"""llamabatch: an in-process continuous-batching engine for llama.cpp."""

from __future__ import annotations

from llamabatch.errors import (
    ContextError,
    DecodeError,
    EngineClosed,
    KVCacheFull,
    LlamaBatchError,
    ModelLoadError,
    PromptTooLong,
    QueueFull,
    RequestCancelled,
)

__version__ = "0.1.0"

__all__ = [
    "ContextError",
    "DecodeError",
    "EngineClosed",
    "KVCacheFull",
    "LlamaBatchError",
    "ModelLoadError",
    "PromptTooLong",
    "QueueFull",
    "RequestCancelled",
    "__version__",
]
