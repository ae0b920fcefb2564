"""llamabatch: an in-process continuous-batching engine for llama.cpp."""

from __future__ import annotations

from llamabatch._ffi.model import Model
from llamabatch.config import EngineConfig
from llamabatch.embed.config import EmbedderConfig
from llamabatch.embed.embedder import Embedder
from llamabatch.embed.reranker import Reranker
from llamabatch.errors import (
    ContextError,
    DecodeError,
    EngineClosed,
    GrammarDeadEnd,
    KVCacheFull,
    LlamaBatchError,
    LoraLoadError,
    ModelLoadError,
    PromptTooLong,
    QueueFull,
    RequestCancelled,
    RequestTooLarge,
    SLOUnmet,
)
from llamabatch.generate.llm import LLM
from llamabatch.generate.llm_engine import LLMEngine
from llamabatch.generate.request import RequestHandle
from llamabatch.outputs import CompletionOutput, Delta, RequestOutput, StepOutput, Timings, ToolCall, Usage
from llamabatch.params import LoRARequest, SamplingParams
from llamabatch.runtime.telemetry import (
    EmbedderStats,
    EmbedPackEvent,
    GenerationStats,
    RequestEvent,
    TickEvent,
)
from llamabatch.status import RequestStatus

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "ContextError",
    "DecodeError",
    "Delta",
    "EmbedPackEvent",
    "Embedder",
    "EmbedderConfig",
    "EmbedderStats",
    "EngineClosed",
    "EngineConfig",
    "GenerationStats",
    "GrammarDeadEnd",
    "KVCacheFull",
    "LLMEngine",
    "LlamaBatchError",
    "LoRARequest",
    "LoraLoadError",
    "Model",
    "ModelLoadError",
    "PromptTooLong",
    "QueueFull",
    "RequestCancelled",
    "RequestEvent",
    "RequestHandle",
    "RequestOutput",
    "RequestStatus",
    "RequestTooLarge",
    "Reranker",
    "SLOUnmet",
    "SamplingParams",
    "StepOutput",
    "TickEvent",
    "Timings",
    "ToolCall",
    "Usage",
    "__version__",
]
