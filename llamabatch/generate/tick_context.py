"""What the engine core hands its per-tick plug-ins (speculation): the ``TickContext``.

A plug-in sees the tick through this interface only, never the core's internals: the slot
table (what every sequence holds and this tick's batch), which request runs in which slot,
the llama.cpp context (logits rows, KV edits), the tick's token budget and time limit, and
the core's own steps for one output row: ``sample_row`` (the request's sampler, its
logprobs), ``emit_token`` (stop checks, detokenizing, the delta), ``draft_end`` (where a
draft would end its request) and ``finish``. The engine
core (``core.EngineCore``) is the one implementation; tests may pass their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llamabatch._core.slots import SlotTable
    from llamabatch._ffi.context import Context
    from llamabatch.generate.admission import TickLimit
    from llamabatch.generate.request import Request
    from llamabatch.generate.slot_map import SlotMap
    from llamabatch.outputs import FinishReason
    from llamabatch.runtime.telemetry import GenerationCounters

__all__ = ["TickContext"]


class TickContext(Protocol):
    """The engine core as its per-tick plug-ins see it (see the module)."""

    @property
    def table(self) -> SlotTable:
        """Every sequence's tokens and state, and the batch being filled or just decoded."""
        ...

    @property
    def slots(self) -> SlotMap:
        """Which request runs in which slot."""
        ...

    @property
    def context(self) -> Context:
        """The llama.cpp context: logits rows after the decode, KV edits."""
        ...

    @property
    def counters(self) -> GenerationCounters:
        """The engine's running totals (``stats()``)."""
        ...

    @property
    def clock(self) -> Callable[[], float]:
        """The clock decodes are timed with (seconds)."""
        ...

    @property
    def n_batch(self) -> int:
        """The most tokens of one batch."""
        ...

    @property
    def kv_cells_free(self) -> int:
        """KV cells free for this tick's tokens (unified KV): the slot table's, less those
        M-RoPE images hold beyond the positions it counts (``vision.extra_cells``)."""
        ...

    @property
    def watermark(self) -> int:
        """KV cells kept free for running sequences' next tokens (unified KV)."""
        ...

    @property
    def budget(self) -> int:
        """This tick's token budget (the admission policy's ``tick_budget``)."""
        ...

    @property
    def tick_limit(self) -> TickLimit | None:
        """The decode time this tick keeps under, with the model predicting it (None: none)."""
        ...

    def sample_row(
        self, slot: int, request: Request, idx: int, logits: Any, row: int, n_before: int = -1
    ) -> int | None:
        """The token sampled at batch index ``idx`` with the request's own sampler (None:
        sampling failed and the request ended); ``n_before`` >= 0: tokens sampled before it
        this tick and not emitted yet (the caller then records logprobs, and errors raise)."""
        ...

    def emit_token(
        self, slot: int, request: Request, token: int, now: float, n_past: int = -1, last: bool = True
    ) -> bool:
        """Emit ``token`` of ``request``; whether it goes on (``n_past``, ``last``: one of
        several tokens emitted this tick, only the last one decoded next)."""
        ...

    def logprobs(self, idx: int, token: int, n: int) -> dict[int, float]:
        """The logprobs of ``token`` and the ``n`` likeliest at batch index ``idx``."""
        ...

    def draft_end(self, request: Request, tokens: list[int]) -> int:
        """The index of the first of ``tokens``, drafted after ``request``'s output, that would
        end it (``draft_cuts.first_end``), else ``len(tokens)``."""
        ...

    def finish(
        self, slot: int, reason: FinishReason, error: str | Exception | None = None, stop_reason: Any = None
    ) -> None:
        """End the request running in ``slot``."""
        ...
