"""Type stubs for the compiled ``llamabatch._core.kv_record`` (see kv_record.pyx for the behaviour)."""

from collections.abc import Sequence

class KVRecord:
    """The cells of ``n_seq`` sequences of up to ``n_ctx_seq`` positions."""

    @property
    def n_seq(self) -> int: ...
    @property
    def n_ctx_seq(self) -> int: ...
    @property
    def kv_unified(self) -> bool: ...
    @property
    def kv_size(self) -> int:
        """Cells in the pool (unified) or in each stream."""
    @property
    def n_free_cells(self) -> int: ...
    @property
    def n_overflow(self) -> int:
        """Positions without a cell (llama.cpp held more than the pool)."""
    def __init__(self, n_seq: int, n_ctx_seq: int, kv_unified: bool = True, kv_size: int = 0) -> None: ...
    def last_use(self, seq: int) -> int:
        """The LRU clock of ``seq`` when it was last touched (0: never)."""
    @property
    def cells_used(self) -> int:
        """Cells of the pool holding some position, plus positions without a cell (unified)."""
    def check(self, lengths: Sequence[int]) -> None:
        """Raise ``AssertionError`` unless the reference counts and the free list match ``lengths``."""
