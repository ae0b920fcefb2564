"""llamabatch: an in-process continuous-batching engine for llama.cpp."""

from __future__ import annotations

from llamabatch.embedder import Embedder
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
from llamabatch.llm import LLM
from llamabatch.outputs import CompletionOutput, Delta, Timings, Usage
from llamabatch.params import SamplingParams
from llamabatch.request import RequestHandle
from llamabatch.telemetry import RequestEvent, TickEvent

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "ContextError",
    "DecodeError",
    "Delta",
    "Embedder",
    "EngineClosed",
    "KVCacheFull",
    "LlamaBatchError",
    "ModelLoadError",
    "PromptTooLong",
    "QueueFull",
    "RequestCancelled",
    "RequestEvent",
    "RequestHandle",
    "SamplingParams",
    "TickEvent",
    "Timings",
    "Usage",
    "__version__",
]
