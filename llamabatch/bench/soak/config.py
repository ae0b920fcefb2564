"""The soak's configuration (``SoakConfig``) and the sizes of its requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The longest prompt + ``max_tokens`` a soak request holds (tokens).
MAX_SEQ_TOKENS = 128
MAX_PROMPT = 96
MAX_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24)
LONG_MAX_TOKENS = (32, 48, 64, 96)
REASONS = ("stop", "length", "cancelled", "error")
GRAMMAR = 'root ::= [a-z]+ (" " [a-z]+)*'
MB = 1024 * 1024

Key = tuple[Any, int]  # (request id, completion index)


@dataclass(frozen=True)
class SoakConfig:
    """What a soak run does (the ``llamabatch bench-soak`` options)."""

    #: a GGUF path or a test-model preset name
    model: str = "tiny"
    #: prompts to submit in all
    requests: int = 10_000
    #: client threads (one of them runs an asyncio loop when there are two or more)
    threads: int = 8
    #: concurrent tasks in the asyncio thread
    async_tasks: int = 4
    #: requests per LLM life: a close()/reopen every this many
    close_every: int = 500
    #: share of requests cancelled (by their caller, in one of the ways above)
    cancel_rate: float = 0.15
    #: injected decode faults per request (0: none): 0.02 is one fault every 50 requests
    fault_rate: float = 0.02
    #: slots per LLM
    n_parallel: int = 8
    #: cells of the unified KV cache (tight: preemption happens); the split layout gets
    #: ``n_parallel * MAX_SEQ_TOKENS``
    unified_n_ctx: int = 2 * MAX_SEQ_TOKENS
    #: llama.cpp CPU threads (None: all cores); the tiny model's decodes are too small to
    #: split, and on a busy machine a second thread mostly waits at llama.cpp's barriers
    n_threads: int | None = 1
    #: seconds a request, a drain, a close or any progress may take before it is a failure
    timeout: float = 60.0
    #: fail when RSS grows more than this share between warm-up and the end (None: report only)
    max_rss_growth: float | None = None
    seed: int = 0
    #: a tqdm bar on stderr (on a terminal)
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("requests", "threads", "async_tasks", "close_every", "n_parallel", "unified_n_ctx"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SoakConfig.{name} must be an int >= 1, got {value!r}")
        if not 0.0 <= self.cancel_rate <= 1.0:
            raise ValueError(f"SoakConfig.cancel_rate must be in [0, 1], got {self.cancel_rate!r}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"SoakConfig.fault_rate must be in [0, 1], got {self.fault_rate!r}")
        if not self.timeout > 0:
            raise ValueError(f"SoakConfig.timeout must be > 0, got {self.timeout!r}")
        if self.unified_n_ctx < MAX_SEQ_TOKENS:
            raise ValueError(
                f"SoakConfig.unified_n_ctx must be >= {MAX_SEQ_TOKENS}, got {self.unified_n_ctx}"
            )
