"""What the Ray Data callables share (``Generate`` and ``Embed`` in ``data.py``, ``Rerank`` in
``reranking.py``): row errors, the batch formats (a dict of numpy arrays, a pandas DataFrame or
a pyarrow Table), the actor's resources and the base of the actors, ``RowWorker``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from llamabatch.errors import LlamaBatchError

__all__ = [
    "ON_ERROR",
    "OnError",
    "RowError",
    "RowWorker",
    "actor_pool",
    "assigned_cpus",
    "check_model_path",
    "column_values",
    "count_rows",
    "error_text",
    "is_missing",
    "with_columns",
]

#: What a row error does: ``"row"`` records it in the error column, ``"raise"`` fails the batch.
OnError = Literal["row", "raise"]

ON_ERROR = ("row", "raise")


class RowError(LlamaBatchError):
    """A row could not be processed and ``on_error="raise"`` was asked for.

    ``row`` is the row's index within its batch, ``reason`` the row's error message."""

    def __init__(self, row: int, reason: str) -> None:
        self.row = row
        self.reason = reason
        super().__init__(f"row {row} of the batch failed: {reason}")


# -- batches: dict of numpy arrays, pandas.DataFrame or pyarrow.Table --------------------------


def batch_kind(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return "numpy"
    module = type(batch).__module__
    if module.startswith("pandas"):
        return "pandas"
    if module.startswith("pyarrow"):
        return "pyarrow"
    raise TypeError(
        f"a batch must be a dict of numpy arrays, a pandas.DataFrame or a pyarrow.Table, "
        f"got {type(batch).__name__}"
    )


def column_names(batch: Any, kind: str) -> list[str]:
    if kind == "numpy":
        return list(batch)
    if kind == "pandas":
        return [str(c) for c in batch.columns]
    return list(batch.column_names)


def column_values(batch: Any, name: str) -> list[Any]:
    """The values of column ``name``, one per row; ``KeyError`` naming the columns there are."""
    kind = batch_kind(batch)
    if name not in column_names(batch, kind):
        raise KeyError(f"the batch has no column {name!r}; its columns: {column_names(batch, kind)}")
    if kind == "numpy":
        return list(batch[name])
    if kind == "pandas":
        return list(batch[name])
    return batch.column(name).to_pylist()


def count_rows(batch: Any) -> int:
    kind = batch_kind(batch)
    if kind == "numpy":
        return len(next(iter(batch.values()))) if batch else 0
    return len(batch)


def object_array(values: Sequence[Any]) -> np.ndarray:
    # Filled item by item: np.array(list_of_lists) would make a 2-D array of equal-length rows.
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def with_columns(batch: Any, columns: Mapping[str, Any]) -> Any:
    """``batch`` (same format) with ``columns`` added or replaced. A value is a 1-D or 2-D
    numpy array (one row per batch row) or a list of per-row Python objects."""
    kind = batch_kind(batch)
    if kind == "numpy":
        out = dict(batch)
        for name, values in columns.items():
            out[name] = values if isinstance(values, np.ndarray) else object_array(values)
        return out
    if kind == "pandas":
        out = batch.copy(deep=False)
        for name, values in columns.items():
            if isinstance(values, np.ndarray) and values.ndim > 1:
                values = list(values)  # one array per cell
            out[name] = values if isinstance(values, np.ndarray) else object_array(values)
        return out
    import pyarrow as pa

    out = batch
    for name, values in columns.items():
        if isinstance(values, np.ndarray) and values.ndim == 2:
            flat = pa.array(values.reshape(-1))
            array = pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
        elif isinstance(values, np.ndarray) and values.dtype != object:
            array = pa.array(values)
        else:
            array = pa.array([v.tolist() if isinstance(v, np.ndarray) else v for v in values])
        if name in out.column_names:
            out = out.set_column(out.column_names.index(name), name, array)
        else:
            out = out.append_column(name, array)
    return out


def is_missing(value: Any) -> bool:
    """None, or the NaN pandas and Arrow use for a missing value in an object column."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def plain_value(value: Any) -> Any:
    """A cell as plain Python for ``pyarrow.array`` (numpy arrays and scalars converted)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [plain_value(v) for v in value]
    if isinstance(value, float) and math.isnan(value):  # pandas' missing value
        return None
    return value


def typed_block(batch: Any, types: Mapping[str, Any]) -> Any:
    """``batch`` as an Arrow table whose columns named in ``types`` have exactly those types.

    Left to inference, a column's type would depend on the block: ``null`` where every value
    is None (a block without a failed row has an all-None error column), ``large_string``
    from pandas, a tensor type from numpy arrays. Ray reconciles such blocks, but the Parquet
    files it writes would then disagree, and other readers (pyarrow datasets, pandas) refuse
    them. The other columns are converted as Ray converts them."""
    import pyarrow as pa
    from ray.data.block import BlockAccessor, BlockType

    kind = batch_kind(batch)
    names = column_names(batch, kind)
    ours = {name: [plain_value(v) for v in column_values(batch, name)] for name in names if name in types}
    if kind == "numpy":
        rest: Any = {k: v for k, v in batch.items() if k not in ours}
    elif kind == "pandas":
        rest = batch.drop(columns=list(ours))
    else:
        rest = batch.drop_columns(list(ours))
    if column_names(rest, kind):
        table = rest if kind == "pyarrow" else BlockAccessor.batch_to_block(rest, block_type=BlockType.ARROW)
        if not isinstance(table, pa.Table):  # Ray could not make Arrow of the rest: leave it all to Ray
            return batch
    else:
        table = pa.table({"_": pa.nulls(count_rows(batch))}).drop_columns(["_"])
    for name in names:
        if name in ours:
            table = table.append_column(name, pa.array(ours[name], type=types[name]))
    return table


# -- the actor's resources ---------------------------------------------------------------------


def with_assigned_threads(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``n_threads`` defaulting to the CPUs Ray assigned this actor."""
    options = dict(options)
    if options.get("n_threads") is None:
        cpus = assigned_cpus()
        if cpus is not None:
            options["n_threads"] = cpus
    return options


def assigned_cpus() -> int | None:
    """The CPUs Ray gave this actor (``num_cpus`` of ``map_batches``), or None outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # not in a Ray worker, or an API change: fall back to the default
        return None
    return max(1, int(cpus)) if cpus else None


def node_description() -> str:
    try:
        import ray

        if ray.is_initialized():
            return f" on node {ray.util.get_node_ip_address()}"
    except Exception:
        pass
    return ""


def check_model_path(model: str | os.PathLike[str]) -> str:
    path = Path(model).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model file {str(path)!r} not found{node_description()}: every node that runs an actor "
            "must read the model at this path (put it on storage all nodes mount, or copy it to the "
            "same path on every node)"
        )
    return str(path)


class RowWorker:
    """What ``Generate``, ``Embed`` and ``Rerank`` share: batch plumbing, threads, the error policy
    and closing the model they own."""

    _executor: concurrent.futures.ThreadPoolExecutor | None = None

    def __init__(self, on_error: str, error_column: str | None, threads: int) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if on_error == "row" and not error_column:
            raise ValueError('on_error="row" needs an error_column to record row errors in')
        self.on_error = on_error
        self.error_column = error_column
        self._threads = threads
        self._lock = threading.Lock()

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # Our own pool, not asyncio's default one: that one has only cpu_count + 4 threads, and a
        # blocked batch holds its thread until every row is done.
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self._threads, thread_name_prefix="llamabatch-ray"
                )
            return self._executor

    async def __call__(self, batch: Any) -> Any:
        """Process one batch for Ray Data (several batches may be in flight at once); the
        result is an Arrow table whose output columns have the same types in every block."""
        return typed_block(await self.run(batch), self.arrow_types())

    async def run(self, batch: Any) -> Any:
        """``process(batch)`` on the worker's threads, awaited (batch in its own format)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(), self.process, batch)

    def process(self, batch: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def arrow_types(self) -> dict[str, Any]:
        """The Arrow type of each output column that may be all null in a block."""
        import pyarrow as pa

        return {self.error_column: pa.string()} if self.error_column else {}

    def row_failed(self, row: int, reason: str, errors: list[str | None]) -> None:
        """Record that ``row`` failed for ``reason`` (``RowError`` with ``on_error="raise"``)."""
        if self.on_error == "raise":
            raise RowError(row, reason)
        errors[row] = reason

    def error_columns(self, errors: list[str | None]) -> dict[str, Any]:
        """The error column of a block's output (none without ``error_column``)."""
        return {self.error_column: errors} if self.error_column else {}

    def _shutdown_pool(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    #: the attribute holding the model this worker owns (``llm``, ``embedder``, ``reranker``)
    _model_attr = ""

    def close(self) -> None:
        """Stop the model and the batch threads."""
        self._shutdown_pool()
        model = getattr(self, self._model_attr, None)
        if model is not None:
            model.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def actor_pool(concurrency: int | tuple[int, int]) -> Any:
    """Ray Data's actor pool: ``n`` actors, or an autoscaling ``(min, max)``."""
    from ray.data import ActorPoolStrategy

    if isinstance(concurrency, tuple):
        low, high = concurrency
        return ActorPoolStrategy(min_size=low, max_size=high)
    return ActorPoolStrategy(size=concurrency)
