"""llamabatch: an in-process continuous-batching engine for llama.cpp."""

from __future__ import annotations

from llamabatch._ffi.model import Model
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
from llamabatch.llm_engine import LLMEngine
from llamabatch.outputs import CompletionOutput, Delta, RequestOutput, StepOutput, Timings, ToolCall, Usage
from llamabatch.params import SamplingParams
from llamabatch.request import RequestHandle
from llamabatch.reranker import Reranker
from llamabatch.telemetry import EmbedderStats, EmbedPackEvent, GenerationStats, RequestEvent, TickEvent

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "ContextError",
    "DecodeError",
    "Delta",
    "EmbedPackEvent",
    "Embedder",
    "EmbedderStats",
    "EngineClosed",
    "GenerationStats",
    "KVCacheFull",
    "LLMEngine",
    "LlamaBatchError",
    "Model",
    "ModelLoadError",
    "PromptTooLong",
    "QueueFull",
    "RequestCancelled",
    "RequestEvent",
    "RequestHandle",
    "RequestOutput",
    "Reranker",
    "SamplingParams",
    "StepOutput",
    "TickEvent",
    "Timings",
    "ToolCall",
    "Usage",
    "__version__",
]
