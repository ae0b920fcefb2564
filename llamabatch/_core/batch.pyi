"""Type stubs for the compiled ``llamabatch._core.batch`` (see batch.pyx for the behaviour)."""

from array import array
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

#: What the core accepts as tokens: any int32 buffer (no copy) or a sequence of ints (converted).
_Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]] | array[int] | Buffer

def live_batches() -> int:
    """Number of ``Batch`` C buffers currently allocated in this process."""

class CView:
    """Read-only buffer over C memory (internal: cannot be created from Python)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

class Batch:
    """One preallocated ``llama_batch`` (get it from :meth:`BatchPool.acquire`)."""

    @property
    def address(self) -> int:
        """Address of the ``llama_batch`` struct (for ``ffi.cast("llama_batch *", ...)``)."""
    @property
    def n_tokens(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def n_seq_max(self) -> int: ...
    @property
    def n_free(self) -> int:
        """Entries still free (``capacity - n_tokens``)."""
    def clear(self) -> None:
        """Empty the batch (``n_tokens = 0``); the buffers are kept."""
    def add(self, token: int, pos: int, seq_id: int | Sequence[int], logits: bool = False) -> None:
        """Append one entry; ``ValueError`` when the batch is full."""
    def add_sequence(self, tokens: _Tokens, seq_id: int, pos0: int = 0, output_all: bool = False) -> int:
        """Append a whole sequence; returns the batch index of its first token."""
    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """Read-only view of the tokens of the first ``n_tokens`` entries."""
    @property
    def pos(self) -> npt.NDArray[np.int32]:
        """Read-only view of the positions of the first ``n_tokens`` entries."""
    @property
    def n_seq_id(self) -> npt.NDArray[np.int32]:
        """Read-only view: how many seq ids each entry has."""
    @property
    def seq_ids(self) -> npt.NDArray[np.int32]:
        """Read-only view of each entry's first seq id."""
    @property
    def seq_ids_all(self) -> npt.NDArray[np.int32]:
        """Read-only view, shape ``(n_tokens, n_seq_max)``; row i is valid up to n_seq_id[i]."""
    @property
    def logits(self) -> npt.NDArray[np.int8]:
        """Read-only view of the output flags of the first ``n_tokens`` entries."""
    def entries(self) -> list[tuple[int, int, int | tuple[int, ...], bool]]:
        """The entries as ``(token, pos, seq_id, logits)``; ``seq_id`` is a tuple for several."""
    def __len__(self) -> int: ...

class BatchPool:
    """Lends preallocated batches of capacity ``n_batch`` (seq ids per token: ``n_seq_max``)."""

    @property
    def n_batch(self) -> int: ...
    @property
    def n_seq_max(self) -> int: ...
    @property
    def n_acquired(self) -> int: ...
    @property
    def n_released(self) -> int: ...
    @property
    def n_allocated(self) -> int: ...
    def __init__(self, n_batch: int = 512, n_seq_max: int = 1, prealloc: int = 1) -> None: ...
    def acquire(self) -> Batch:
        """Lend an empty batch (``n_tokens == 0``)."""
    def release(self, batch: Batch) -> None:
        """Take back a batch lent by this pool; ``ValueError`` on a foreign or double release."""
    @property
    def n_outstanding(self) -> int:
        """Batches acquired and not yet released (0 when nothing leaks)."""
    @property
    def n_free(self) -> int: ...
