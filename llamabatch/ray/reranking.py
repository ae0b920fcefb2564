"""Ray Data callable :class:`Rerank` (beside :class:`~llamabatch.ray.data.Embed`): scores the
(query, document) pair of every row with one :class:`~llamabatch.Reranker` per actor.

All the rows of a batch go to the reranker in one ``predict`` call, so they are packed into
shared encodes. A row that cannot be scored (a missing or non-string query or document, or a
pair over the limit with ``truncate=False``) gets a NaN score and its message in the error
column; ``on_error="raise"`` fails the batch with :class:`~llamabatch.ray.data.RowError`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from llamabatch.errors import EngineClosed, LlamaBatchError
from llamabatch.ray.common import (
    OnError,
    RowWorker,
    actor_pool,
    check_model_path,
    column_values,
    error_text,
    is_missing,
    with_assigned_threads,
    with_columns,
)

__all__ = ["Rerank", "rerank"]


class Rerank(RowWorker):
    """A ``map_batches`` callable that scores the (query, document) pair of every row.

    Use it as a class, so that Ray builds one model per actor::

        ds = ds.map_batches(
            Rerank,
            fn_constructor_kwargs={"model": "/models/reranker.gguf"},
            concurrency=4, num_cpus=4, batch_size=1024,
        )

    Args:
        model: path of the reranker GGUF; every node that runs an actor must read it at this path.
        query_column, document_column: the input columns of strings.
        output_column: the scores (float32; ``(num_labels,)`` per row for a multi-label head),
            with the Reranker's activation (``activation_fn`` below). A failed row has NaN.
        error_column: where a row's error message goes (None for rows that succeeded).
        on_error: ``"row"`` (default) records row errors; ``"raise"`` fails the batch.
        **reranker_options: passed to :class:`~llamabatch.Reranker` (``activation_fn``,
            ``truncate``, ``max_length``, ``n_batch``, ``n_threads``, ...). ``n_threads``
            defaults to the CPUs Ray assigned the actor.
    """

    _model_attr = "reranker"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        query_column: str = "query",
        document_column: str = "document",
        output_column: str = "score",
        error_column: str | None = "error",
        on_error: OnError = "row",
        **reranker_options: Any,
    ) -> None:
        from llamabatch import Reranker

        super().__init__(on_error, error_column, threads=16)
        self.query_column = query_column
        self.document_column = document_column
        self.output_column = output_column
        options = with_assigned_threads(reranker_options)
        self.reranker = Reranker(check_model_path(model), **options)

    def _pair(self, query: Any, document: Any) -> tuple[str, str]:
        for name, value in ((self.query_column, query), (self.document_column, document)):
            if is_missing(value):
                raise ValueError(f"the row has no {name!r}")
            if not isinstance(value, str):
                raise TypeError(f"{name!r} is a {type(value).__name__}, not a str")
        return str(query), str(document)

    def process(self, batch: Any) -> Any:
        """Score every row of ``batch`` (any thread; blocks until all rows are done)."""
        queries = column_values(batch, self.query_column)
        documents = column_values(batch, self.document_column)
        n_rows = len(queries)
        errors: list[str | None] = [None] * n_rows
        rows: list[int] = []
        pairs: list[tuple[str, str]] = []
        for i in range(n_rows):
            try:
                pairs.append(self._pair(queries[i], documents[i]))
            except (ValueError, TypeError) as exc:
                self.row_failed(i, error_text(exc), errors)
                continue
            rows.append(i)
        scores = self._scores(rows, pairs, errors)
        width = self.reranker.num_labels
        out = np.full((n_rows, width), np.nan, dtype=np.float32)
        for i, score in scores.items():
            out[i] = score
        column = out[:, 0] if width == 1 else out
        return with_columns(batch, {self.output_column: column, **self.error_columns(errors)})

    def _scores(
        self, rows: list[int], pairs: list[tuple[str, str]], errors: list[str | None]
    ) -> dict[int, Any]:
        """Scores of ``rows``: one ``predict`` call; if it fails, one call per pair (still
        packed together) so that only the pairs at fault fail."""
        if not pairs:
            return {}
        r = self.reranker
        try:
            return dict(zip(rows, r.predict(pairs).reshape(len(pairs), -1), strict=True))
        except EngineClosed:
            raise
        except (ValueError, TypeError, LlamaBatchError):
            pass

        async def each() -> list[Any]:
            return await asyncio.gather(*(r.apredict([pair]) for pair in pairs), return_exceptions=True)

        out: dict[int, Any] = {}
        for i, result in zip(rows, asyncio.run(each()), strict=True):
            if isinstance(result, EngineClosed):
                raise result
            if isinstance(result, BaseException):
                self.row_failed(i, error_text(result), errors)
            else:
                out[i] = np.asarray(result).reshape(-1)
        return out


def rerank(
    dataset: Any,
    model: str | os.PathLike[str],
    *,
    concurrency: int | tuple[int, int] = 1,
    num_cpus: float = 1,
    batch_size: int | None = 1024,
    batch_format: str = "default",
    rerank_options: Mapping[str, Any] | None = None,
    **map_batches_options: Any,
) -> Any:
    """``dataset.map_batches(Rerank, ...)``: ``concurrency`` actors (or an autoscaling
    ``(min, max)``) of ``num_cpus`` cores, each holding one ``Reranker``. ``rerank_options`` go
    to :class:`Rerank` (columns, ``on_error``, ``Reranker`` options)."""
    kwargs = {"model": str(model), **(rerank_options or {})}
    return dataset.map_batches(
        Rerank,
        fn_constructor_kwargs=kwargs,
        compute=actor_pool(concurrency),
        num_cpus=num_cpus,
        batch_size=batch_size,
        batch_format=batch_format,
        **map_batches_options,
    )
