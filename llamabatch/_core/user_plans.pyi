"""Type stubs for the compiled ``llamabatch._core.user_plans`` (see user_plans.pyx)."""

from llamabatch._core.slot_record import SlotState

class TableView:
    """Read-only view of a ``SlotTable``, valid during ``plan()`` (made by the table only)."""

    @property
    def n_parallel(self) -> int: ...
    @property
    def decode_slots(self) -> list[int]:
        """DECODE slots in round-robin order (the order the built-ins serve them)."""
    @property
    def prefill_slots(self) -> list[int]:
        """PREFILL slots in arrival order (oldest first)."""
    def state(self, slot: int) -> SlotState: ...
    def n_pending(self, slot: int) -> int:
        """Prompt tokens still to compute (0 unless PREFILL)."""
    def n_past(self, slot: int) -> int:
        """Tokens of the slot already in the KV cache."""
    def arrival(self, slot: int) -> int:
        """Start counter of the slot's request (FIFO order of prompts)."""
    def n_generated(self, slot: int) -> int:
        """Tokens accepted after the prompt."""
