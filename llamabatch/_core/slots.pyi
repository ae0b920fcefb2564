"""Type stubs for the compiled ``llamabatch._core.slots`` (see slots.pyx for the behaviour)."""

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from llamabatch._core.batch import Batch, _Tokens
from llamabatch._core.slot_record import SlotRecord as SlotRecord
from llamabatch._core.slot_record import SlotState as SlotState
from llamabatch._core.user_plans import TableView
from llamabatch.strategies import Strategy

#: True when the core was built with LLAMABATCH_DEBUG=1 (transition and invariant checks).
DEBUG: bool
#: The most draft tokens a slot verifies in one tick (speculative decoding).
MAX_DRAFT: int

def live_tables() -> int:
    """Number of ``SlotTable`` C buffers currently allocated in this process."""

#: The allowed state transitions, as (from, to) pairs.
EDGES: frozenset[tuple[SlotState, SlotState]]

class SlotTable(SlotRecord):
    """``n_parallel`` slots of up to ``n_ctx_seq`` tokens; prompt chunks of ``chunk_size``."""

    @property
    def chunk_size(self) -> int: ...
    @property
    def ubatch_cost_cells(self) -> float:
        """One KV stream per sequence: what one more ubatch costs, in cells attended by one
        token (0: no cuts of the table's own; the batch still goes by slot)."""
    @ubatch_cost_cells.setter
    def ubatch_cost_cells(self, value: float) -> None: ...
    @property
    def draft_rows_below(self) -> int:
        """Drafts keep a tick's query rows per KV stream under this (0: no bound); see
        ``speculative.draft_rows_below``."""
    @draft_rows_below.setter
    def draft_rows_below(self, value: int) -> None: ...
    @property
    def n_outputs(self) -> int: ...
    @property
    def fill_pending(self) -> bool: ...
    @property
    def n_commits(self) -> int: ...
    @property
    def n_rollbacks(self) -> int: ...
    def __init__(
        self,
        n_parallel: int,
        n_ctx_seq: int,
        chunk_size: int = 512,
        n_pinned: int = 0,
        kv_unified: bool = True,
        kv_size: int = 0,
    ) -> None: ...

    # -- the state machine
    def start(self, slot: int, prompt_tokens: _Tokens, n_past: int = 0, score_chunk: int = 0) -> None:
        """IDLE -> PREFILL; ``PromptTooLong`` if the prompt exceeds ``n_ctx_seq``. ``score_chunk``:
        every prompt row computed has logits (prompt log-probabilities), at most that many a tick."""
    def accept(self, slot: int, token: int) -> None:
        """Append a sampled token: AWAIT_SAMPLE -> DECODE."""
    def set_draft(self, slot: int, tokens: _Tokens) -> int: ...
    def draft_in_fill(self, slot: int) -> int: ...
    def reject(self, slot: int, n: int) -> None: ...
    @property
    def n_draft_tokens(self) -> int: ...
    @property
    def n_score_rows(self) -> int:
        """Prompt rows with logits in the last fill (``start(score_chunk=...)``)."""
    def finish(self, slot: int, keep: bool = False) -> None:
        """End the slot's request, from any busy state: -> IDLE."""
    def _transition(self, slot: int, state: SlotState | int) -> None:
        """Test hook: call the transition function directly."""

    # -- the tick
    def fill(self, batch: Batch, strategy: Strategy | str, n_batch: int, queue_depth: int = 0) -> int:
        """Build this tick's batch in place; return its ``n_tokens``."""
    def commit(self) -> None:
        """The decode of the last fill succeeded: apply it."""
    def rollback(self) -> None:
        """The decode of the last fill failed: forget the fill."""

    # -- outputs, telemetry
    @property
    def out_slot(self) -> npt.NDArray[np.int32]:
        """``out_slot[i]`` is the slot whose logits are at ``out_index[i]``."""
    @property
    def out_index(self) -> npt.NDArray[np.int32]:
        """Batch index of each output's logits."""
    def outputs(self) -> list[tuple[int, int]]:
        """The last fill's outputs as ``(slot, batch_index)``, in batch order."""
    @property
    def last_fill_stats(self) -> tuple[int, int]:
        """``(n_decode_tokens, n_prefill_tokens)`` of the last fill."""
    def tokens_in_batch(self, slot: int) -> int: ...
    def batch_index(self, slot: int) -> int: ...
    def last_plan(self) -> list[tuple[int, int]]:
        """The last fill's plan: ``[(slot, n_tokens), ...]`` in batch order."""
    @property
    def decode_cursor(self) -> int: ...

    # -- prompt order
    def order_prefill(self, order: Iterable[int]) -> None:
        """Serve the PREFILL slots' prompts in ``order`` (a permutation of them)."""
    def view(self) -> TableView:
        """A read-only view of the table (what a user strategy's ``plan`` receives)."""
    def check_invariants(self) -> None: ...
