"""Batching strategies: the protocol a custom strategy satisfies, and the built-ins.

A strategy decides, every tick, which slots get how many tokens of the next batch
(``LLM(strategy=...)``). Pass a built-in's name (``"decode_maximal"``, the default,
``"prefill_priority"``, ``"balanced"``) or any object with a ``plan`` method; no base class
is needed. :class:`Strategy` is that method as a :class:`typing.Protocol`, so type checkers
accept ``LLM(strategy=MyStrategy())`` and check the method's signature::

    from collections.abc import Iterable

    from llamabatch.strategies import Strategy, TableView

    class DecodeFirst:
        name = "decode_first"  # optional: used in error messages

        def plan(
            self, view: TableView, budget: int, chunk_size: int, queue_depth: int
        ) -> Iterable[tuple[int, int]]:
            plan = [(slot, 1) for slot in view.decode_slots[:budget]]
            left = budget - len(plan)
            for slot in view.prefill_slots:
                n = min(view.n_pending(slot), chunk_size, left)
                if n > 0:
                    plan.append((slot, n))
                    left -= n
            return plan

    strategy: Strategy = DecodeFirst()

The rules a plan must follow, and what ``view`` offers, are in
:mod:`llamabatch._core.strategies`' docstring.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from llamabatch._core.slot_record import SlotState
from llamabatch._core.strategies import STRATEGIES, Balanced, DecodeMaximal, PrefillPriority, get_strategy
from llamabatch._core.user_plans import TableView

__all__ = [
    "STRATEGIES",
    "Balanced",
    "DecodeMaximal",
    "PrefillPriority",
    "SlotState",
    "Strategy",
    "SubsetView",
    "TableView",
    "get_strategy",
]


@runtime_checkable
class Strategy(Protocol):
    """A batching strategy: anything with this ``plan`` method (the built-ins included).

    ``plan`` returns ``(slot, n_tokens)`` pairs, in batch order, within ``budget`` tokens:
    one token for a slot in ``view.decode_slots``, ``1 .. min(view.n_pending(slot),
    chunk_size)`` for a slot in ``view.prefill_slots``. ``queue_depth`` is the number of
    requests waiting for a free slot. The engine validates the plan and raises
    ``ValueError`` naming the strategy and the violation.
    """

    def plan(
        self, view: TableView, budget: int, chunk_size: int, queue_depth: int
    ) -> Iterable[tuple[int, int]]: ...


class SubsetView:
    """``view`` showing only the runnable slots ``decode`` and ``prefill`` (the rest of the
    view passes through): what a strategy that wraps another hands it to plan over some slots
    (the engine's image and LoRA-adapter strategies do)."""

    def __init__(self, view: Any, decode: list[int], prefill: list[int]) -> None:
        self._view = view
        self.decode_slots = decode
        self.prefill_slots = prefill
        self.n_parallel = view.n_parallel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)
