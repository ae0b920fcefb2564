"""Type stubs for the compiled ``llamabatch._core.strategies`` (see strategies.pyx).

The protocol a user strategy satisfies is :class:`llamabatch.strategies.Strategy`; the
``Strategy`` class here is the optional Cython base class of the built-ins.
"""

from collections.abc import Iterable
from typing import ClassVar, Literal, Protocol, TypeVar, overload

from llamabatch._core.user_plans import TableView
from llamabatch.strategies import Strategy as StrategyProtocol

_S = TypeVar("_S", bound=StrategyProtocol)

class _PlanView(Protocol):
    """What the built-ins read from a view: a :class:`TableView`, or any look-alike (tests)."""

    @property
    def decode_slots(self) -> list[int]: ...
    @property
    def prefill_slots(self) -> list[int]: ...
    def n_pending(self, slot: int, /) -> int: ...

class Strategy:
    """Base class of the strategies (optional for user strategies)."""

    name: ClassVar[str | None]
    @property
    def native(self) -> bool:
        """True for the exact built-in classes: ``SlotTable.fill`` runs their C plan."""
    def plan(
        self, view: TableView, budget: int, chunk_size: int, queue_depth: int = 0
    ) -> Iterable[tuple[int, int]]:
        """Return an iterable of ``(slot, n_tokens)`` pairs, in batch order."""

class DecodeMaximal(Strategy):
    """Every decoding slot's token first, then prompt chunks (FIFO) with the rest."""

    name: ClassVar[str]
    def plan(
        self, view: _PlanView, budget: int, chunk_size: int, queue_depth: int = 0
    ) -> list[tuple[int, int]]: ...

class PrefillPriority(Strategy):
    """Prompt chunks (FIFO) first, then decode tokens with the rest."""

    name: ClassVar[str]
    def plan(
        self, view: _PlanView, budget: int, chunk_size: int, queue_depth: int = 0
    ) -> list[tuple[int, int]]: ...

class Balanced(Strategy):
    """Decode up to half the budget, prefill the rest; unused budget flows both ways."""

    name: ClassVar[str]
    def plan(
        self, view: _PlanView, budget: int, chunk_size: int, queue_depth: int = 0
    ) -> list[tuple[int, int]]: ...

#: Built-in strategies by name.
STRATEGIES: dict[str, type[DecodeMaximal | PrefillPriority | Balanced]]

@overload
def get_strategy(spec: Literal["decode_maximal"] = "decode_maximal") -> DecodeMaximal: ...
@overload
def get_strategy(spec: Literal["prefill_priority"]) -> PrefillPriority: ...
@overload
def get_strategy(spec: Literal["balanced"]) -> Balanced: ...
@overload
def get_strategy(spec: str) -> DecodeMaximal | PrefillPriority | Balanced:
    """A built-in by name (case and ``-``/``_`` insensitive); ``ValueError`` for an unknown one."""

@overload
def get_strategy(spec: _S) -> _S:
    """An instance with a ``plan`` method, returned as is (``TypeError`` for a class)."""

def strategy_name(strategy: object) -> str:
    """The name used for ``strategy`` in messages."""
