"""Exceptions raised by llamabatch."""

from __future__ import annotations


class LlamaBatchError(Exception):
    """Base class of every llamabatch error."""


class ModelLoadError(LlamaBatchError):
    """llama.cpp could not load a model file (not a GGUF, truncated, unsupported)."""

    def __init__(self, path: str, reason: str = "") -> None:
        self.path = path
        detail = f": {reason}" if reason else ""
        super().__init__(f"cannot load model {path!r}{detail}")


class LoraLoadError(ModelLoadError):
    """A LoRA adapter file cannot be used with the model: not an adapter, another architecture,
    tensors that do not fit the base model, or llama.cpp refused it. Names the file."""

    def __init__(self, path: str, reason: str = "") -> None:
        ModelLoadError.__init__(self, path, reason)
        detail = f": {reason}" if reason else ""
        self.args = (f"cannot load LoRA adapter {path!r}{detail}",)


class DraftModelMismatch(LlamaBatchError, ValueError):
    """A speculative-decoding draft model cannot draft for the target: its vocabulary differs
    (size, tokenizer type, special tokens or token texts)."""


class ContextError(LlamaBatchError):
    """llama.cpp could not create a context (usually out of memory for the KV cache)."""


class DecodeError(LlamaBatchError):
    """``llama_decode`` / ``llama_encode`` failed; ``code`` is llama.cpp's return value."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


class KVCacheFull(DecodeError):
    """No room in the KV cache for the batch, even after retrying with smaller batches."""


class QueueFull(LlamaBatchError):
    """The request queue holds ``max_queue`` requests already."""


class SLOUnmet(QueueFull):
    """A request refused at submit because it cannot meet its TTFT SLO (``slo_reject``);
    ``retry_after``: the seconds the queue ahead of it is predicted to take."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PromptTooLong(LlamaBatchError, ValueError):
    """A prompt (plus ``max_tokens``) or an input text exceeds the per-sequence limit."""


class EngineClosed(LlamaBatchError):
    """The engine was closed; it accepts no more requests."""


class RequestCancelled(LlamaBatchError):
    """The request was cancelled before it produced a result."""


class GrammarDeadEnd(LlamaBatchError, ValueError):
    """A request's own constraints stopped its generation: its grammar, with ``min_tokens``,
    ``stop_token_ids``, ``logit_bias`` and the model's vocabulary, admits no next token, or the
    grammar grew too ambiguous (``GrammarLimits.max_live_stacks``). The request caused it, not
    the engine: the completion ends with ``finish_reason="error"`` and ``error_type`` this
    class, and the server answers 400."""


class RequestTooLarge(LlamaBatchError, ValueError):
    """A request's estimated memory (its grammar's parser per completion, and its outputs:
    ``n`` x ``max_tokens`` tokens with their log-probabilities) exceeds the engine's
    ``max_request_memory_mb``; refused at submit."""


class ImageError(LlamaBatchError, ValueError):
    """An image a request carries is refused: too many bytes or pixels, too many images, not
    an image, undecodable, or a URL that is not allowed. ``part`` names where it was (such as
    ``messages[0].content[1]``); the server answers 400."""

    def __init__(self, part: str, reason: str) -> None:
        self.part = part
        self.reason = reason
        super().__init__(f"{part}: {reason}")
