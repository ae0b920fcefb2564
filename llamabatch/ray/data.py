"""Ray Data callables: :class:`Generate` and :class:`Embed` for ``Dataset.map_batches``.

Each Ray actor built from one of these classes owns one :class:`~llamabatch.LLM` or
:class:`~llamabatch.Embedder` and submits every row of a batch to it at once, so the rows are
batched together inside the actor (continuous batching for generation, packed decodes for
embeddings). ``__call__`` is a coroutine: Ray Data then feeds an actor several batches at a
time (4 by default), which keeps its slots busy while one batch's last rows finish.

A row that cannot be processed (an empty or missing prompt, a prompt longer than the context,
a text longer than the embedder's limit) does not fail the job: its error message lands in the
error column and the other rows carry on. ``on_error="raise"`` fails the batch (and so the job)
with a :class:`RowError` instead.

Batches may be Ray's default format (a dict of numpy arrays), pandas DataFrames or pyarrow
Tables; the result has the same format, with the input columns kept and the output columns
added.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamabatch.errors import EngineClosed, LlamaBatchError, PromptTooLong, QueueFull
from llamabatch.params import SamplingParams
from llamabatch.ray.common import (
    OnError,
    RowError,
    RowWorker,
    actor_pool,
    check_model_path,
    column_values,
    error_text,
    is_missing,
    object_array,
    with_assigned_threads,
    with_columns,
)

__all__ = ["Embed", "Generate", "OnError", "RowError", "embed", "generate"]


# -- generation --------------------------------------------------------------------------------


@dataclass
class _Generated:
    """One row's completions (``n`` of them), or its error."""

    completions: list[Any]
    error: str | None = None


class Generate(RowWorker):
    """A ``map_batches`` callable that generates a completion for every row.

    Use it as a class, so that Ray builds one model per actor::

        ds = ds.map_batches(
            Generate,
            fn_constructor_kwargs={"model": "/models/m.gguf", "sampling_params": {"max_tokens": 64}},
            concurrency=4,   # actors
            num_cpus=8,      # cores per actor (the LLM's n_threads unless given)
            batch_size=256,
        )

    Args:
        model: path of the GGUF file; every node that runs an actor must read it at this path.
        sampling_params: ``SamplingParams`` or a dict of its fields, for every row.
        prompt_column: the input column: text, token ids (a list or integer array), or chat
            messages (a list of ``{"role": ..., "content": ...}``, formatted with the model's
            chat template).
        output_column: the generated text (with ``n > 1``: a list of ``n`` texts).
        params_column: optional column of per-row ``SamplingParams`` overrides (dicts, or None
            for the defaults), merged over ``sampling_params``.
        error_column: where a row's error message goes (None for rows that succeeded).
        on_error: ``"row"`` (default) records row errors; ``"raise"`` fails the batch with
            :class:`RowError`.
        return_token_ids: add a ``token_ids`` column (always there when logprobs are asked for).
        **llm_options: passed to :class:`~llamabatch.LLM` (``n_ctx``, ``n_parallel``,
            ``n_threads``, ...). ``n_threads`` defaults to the CPUs Ray assigned the actor.

    Output columns, besides ``output_column`` and ``error_column``: ``finish_reason``
    (``"stop"``, ``"length"`` or ``"error"``), ``prompt_tokens``, ``completion_tokens``; with
    ``SamplingParams(logprobs=k)`` also ``token_ids``, ``logprobs`` (the log-probability of each
    generated token) and, for ``k > 0``, ``top_logprobs`` (per token, the ``k`` most likely
    ``{"token_id", "logprob"}``). With ``n > 1`` every one of these holds a list of ``n`` values.
    """

    _model_attr = "llm"

    def __init__(
        self,
        model: str | os.PathLike[str],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        prompt_column: str = "prompt",
        output_column: str = "generated_text",
        params_column: str | None = None,
        error_column: str | None = "error",
        on_error: OnError = "row",
        return_token_ids: bool = False,
        **llm_options: Any,
    ) -> None:
        from llamabatch import LLM

        super().__init__(on_error, error_column, threads=64)
        self.params = SamplingParams.coerce(sampling_params)
        self.prompt_column = prompt_column
        self.output_column = output_column
        self.params_column = params_column
        self.return_token_ids = bool(return_token_ids) or self.params.logprobs is not None
        options = with_assigned_threads(llm_options)
        self.llm = LLM(check_model_path(model), **options)

    # -- rows -> prompts

    def _prompt(self, value: Any) -> Any:
        """A row's prompt as ``LLM`` takes it; ``ValueError``/``TypeError`` for a bad one."""
        if is_missing(value):
            raise ValueError(f"the row has no prompt ({self.prompt_column!r} is missing)")
        if isinstance(value, str):
            return str(value)  # numpy.str_ -> str
        if isinstance(value, np.ndarray):
            if value.dtype.kind in "iu":
                return [int(t) for t in value]
            value = list(value)  # an object array: of messages, or of mixed values
        if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
            return self.llm.apply_chat_template([dict(m) for m in value])
        if isinstance(value, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value
        ):
            return [int(t) for t in value]
        return value  # LLM says what is wrong with it

    def _row_params(self, value: Any) -> SamplingParams:
        if is_missing(value):
            return self.params
        if not isinstance(value, Mapping):
            raise TypeError(f"{self.params_column!r} must hold dicts of SamplingParams fields")
        overrides = {k: v for k, v in value.items() if not is_missing(v)}  # Arrow fills absent keys
        params = SamplingParams.from_dict({**self.params.to_dict(), **overrides})
        if (params.n > 1) != (self.params.n > 1):
            raise ValueError(
                "a row's n must be > 1 exactly when sampling_params' n is (the columns hold lists then)"
            )
        return params

    # -- the batch

    def process(self, batch: Any) -> Any:
        """Generate for every row of ``batch`` (any thread; blocks until all rows are done)."""
        values = column_values(batch, self.prompt_column)
        params_values = column_values(batch, self.params_column) if self.params_column else None
        n_rows = len(values)
        errors: list[str | None] = [None] * n_rows
        prompts: list[Any] = [None] * n_rows
        row_params: list[SamplingParams] = [self.params] * n_rows
        valid: list[int] = []
        for i, value in enumerate(values):
            try:
                prompts[i] = self._prompt(value)
                if params_values is not None:
                    row_params[i] = self._row_params(params_values[i])
            except (ValueError, TypeError, LlamaBatchError) as exc:
                self.row_failed(i, error_text(exc), errors)
                continue
            valid.append(i)
        generated = self._generate(valid, prompts, row_params, errors)
        columns = self._columns(n_rows, generated, row_params)
        return with_columns(batch, {**columns, **self.error_columns(errors)})

    def _generate(
        self, rows: list[int], prompts: list[Any], params: list[SamplingParams], errors: list[str | None]
    ) -> dict[int, _Generated]:
        """Completions of ``rows``: all in one ``generate`` call; if a prompt is refused, one
        request per row so that only that row fails."""
        if not rows:
            return {}
        shared = self.params_column is None  # one SamplingParams for all rows
        try:
            batch_params = self.params if shared else [params[i] for i in rows]
            results = self.llm.generate([prompts[i] for i in rows], batch_params, use_tqdm=False)
        except EngineClosed:
            raise
        except (ValueError, TypeError, LlamaBatchError):
            results = None  # some row was refused (generate checks all before it starts)
        if results is None:  # find which: one request per row
            return self._generate_per_row(rows, prompts, params, errors)
        return {i: self._checked(i, r.outputs, errors) for i, r in zip(rows, results, strict=True)}

    def _generate_per_row(
        self, rows: list[int], prompts: list[Any], params: list[SamplingParams], errors: list[str | None]
    ) -> dict[int, _Generated]:
        handles: dict[int, Any] = {}
        try:
            for i in rows:
                while True:
                    try:
                        handles[i] = self.llm.submit(prompts[i], params[i])
                        break
                    except QueueFull:
                        self._wait_for_room(handles)
                    except EngineClosed:
                        raise
                    except (ValueError, TypeError, LlamaBatchError) as exc:
                        self.row_failed(i, error_text(exc), errors)
                        break
            return {i: self._checked(i, h.result().outputs, errors) for i, h in handles.items()}
        except BaseException:
            for handle in handles.values():  # nobody will read them
                handle.cancel()
            raise

    @staticmethod
    def _wait_for_room(handles: Mapping[int, Any]) -> None:
        for handle in handles.values():
            if not handle.done:
                handle.result()  # the oldest of ours still running
                return
        time.sleep(0.01)  # the queue is full of other batches' requests

    def _checked(self, row: int, completions: list[Any], errors: list[str | None]) -> _Generated:
        bad = [c for c in completions if c.finish_reason in ("error", "cancelled")]
        if bad:
            reason = bad[0].error or f"the request ended as {bad[0].finish_reason!r}"
            self.row_failed(row, reason, errors)
            return _Generated(completions, reason)
        return _Generated(completions)

    def _columns(
        self, n_rows: int, generated: Mapping[int, _Generated], params: list[SamplingParams]
    ) -> dict[str, Any]:
        # The same columns in every batch, from the default params (per-row overrides
        # cannot add columns: blocks with different columns would not stack).
        want_ids, want_top, many = self.return_token_ids, bool(self.params.logprobs), self.params.n > 1
        cols: dict[str, list[Any]] = {
            self.output_column: [],
            "finish_reason": [],
            "prompt_tokens": [],
            "completion_tokens": [],
        }
        if want_ids:
            cols["token_ids"] = []
            cols["logprobs"] = []
        if want_top:
            cols["top_logprobs"] = []
        for i in range(n_rows):
            row = generated.get(i)
            completions = row.completions if row is not None else []
            values: dict[str, list[Any]] = {name: [] for name in cols}
            for c in completions:
                values[self.output_column].append(c.text)
                values["finish_reason"].append(c.finish_reason)
                values["completion_tokens"].append(c.usage.completion_tokens)
                if want_ids:
                    values["token_ids"].append(np.asarray(c.token_ids, dtype=np.int64))
                    values["logprobs"].append(_sampled_logprobs(c))
                if want_top:
                    values["top_logprobs"].append(_top_logprobs(c))
            prompt_tokens = completions[0].usage.prompt_tokens if completions else 0
            for name, column in cols.items():
                if name == "prompt_tokens":
                    column.append(prompt_tokens)
                elif many:
                    column.append(values[name])
                elif completions:
                    column.append(values[name][0])
                else:  # the row failed before generating
                    column.append(_EMPTY.get(name))
        out: dict[str, Any] = dict(cols)
        out["prompt_tokens"] = np.asarray(cols["prompt_tokens"], dtype=np.int64)
        if not many:
            out["completion_tokens"] = np.asarray(cols["completion_tokens"], dtype=np.int64)
            out["finish_reason"] = object_array(["error" if v is None else v for v in cols["finish_reason"]])
        return out

    def arrow_types(self) -> dict[str, Any]:
        import pyarrow as pa

        top = pa.list_(pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])))
        types = {
            self.output_column: pa.string(),
            "finish_reason": pa.string(),
            "completion_tokens": pa.int64(),
            "token_ids": pa.list_(pa.int64()),
            "logprobs": pa.list_(pa.float64()),
            "top_logprobs": top,
        }
        if self.params.n > 1:
            types = {name: pa.list_(t) for name, t in types.items()}
        return {**types, "prompt_tokens": pa.int64(), **super().arrow_types()}


#: Values of a row that failed before generating (text None: there is none).
_EMPTY: dict[str, Any] = {"completion_tokens": 0, "finish_reason": "error"}


def _sampled_logprobs(completion: Any) -> np.ndarray | None:
    if completion.logprobs is None:
        return None
    return np.asarray(
        [lp.get(t, math.nan) for t, lp in zip(completion.token_ids, completion.logprobs, strict=False)],
        dtype=np.float64,
    )


def _top_logprobs(completion: Any) -> list[list[dict[str, Any]]] | None:
    if completion.logprobs is None:
        return None
    return [
        [{"token_id": int(t), "logprob": float(v)} for t, v in sorted(lp.items(), key=lambda kv: -kv[1])]
        for lp in completion.logprobs
    ]


# -- embeddings --------------------------------------------------------------------------------


class Embed(RowWorker):
    """A ``map_batches`` callable that embeds the text of every row.

    Use it as a class, so that Ray builds one model per actor::

        ds = ds.map_batches(
            Embed,
            fn_constructor_kwargs={"model": "/models/minilm.gguf"},
            concurrency=4, num_cpus=4, batch_size=1024,
        )

    Args:
        model: path of the GGUF file; every node that runs an actor must read it at this path.
        text_column: the input column of strings.
        output_column: the vectors: a float32 column of ``n_embd`` values per row (with pooling
            ``"none"``: one ``(n_tokens, n_embd)`` array per row; ``"rank"``: the score).
        error_column: where a row's error message goes (None for rows that succeeded). A row
            that failed has an all-NaN vector.
        on_error: ``"row"`` (default) records row errors; ``"raise"`` fails the batch with
            :class:`RowError`.
        **embedder_options: passed to :class:`~llamabatch.Embedder` (``n_batch``, ``pooling``,
            ``normalize``, ``truncate``, ``n_threads``, ...). ``n_threads`` defaults to the CPUs
            Ray assigned the actor.
    """

    _model_attr = "embedder"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        text_column: str = "text",
        output_column: str = "embedding",
        error_column: str | None = "error",
        on_error: OnError = "row",
        **embedder_options: Any,
    ) -> None:
        from llamabatch import Embedder

        super().__init__(on_error, error_column, threads=16)
        self.text_column = text_column
        self.output_column = output_column
        options = with_assigned_threads(embedder_options)
        self.embedder = Embedder(check_model_path(model), **options)

    def process(self, batch: Any) -> Any:
        """Embed every row of ``batch`` (any thread; blocks until all rows are done)."""
        values = column_values(batch, self.text_column)
        n_rows = len(values)
        errors: list[str | None] = [None] * n_rows
        rows: list[int] = []
        texts: list[str] = []
        for i, value in enumerate(values):
            if isinstance(value, str):
                rows.append(i)
                texts.append(str(value))
            elif is_missing(value):
                self.row_failed(i, f"the row has no text ({self.text_column!r} is missing)", errors)
            else:
                self.row_failed(i, f"TypeError: the text is a {type(value).__name__}, not a str", errors)
        vectors = self._embed(rows, texts, errors)
        return with_columns(
            batch, {self.output_column: self._column(n_rows, rows, vectors), **self.error_columns(errors)}
        )

    def _embed(self, rows: list[int], texts: list[str], errors: list[str | None]) -> dict[int, Any]:
        """Vectors of ``rows``: one ``embed`` call; if it fails, one call per text (all packed
        together still) so that only the texts at fault fail."""
        if not texts:
            return {}
        try:
            return dict(zip(rows, self.embedder.embed(texts), strict=True))
        except EngineClosed:
            raise
        except (ValueError, TypeError, LlamaBatchError):
            pass  # some text failed: find which, one call per text (the raise mode names it)

        async def each() -> list[Any]:
            calls = [self.embedder.aembed([text]) for text in texts]
            return await asyncio.gather(*calls, return_exceptions=True)

        out: dict[int, Any] = {}
        for i, result in zip(rows, asyncio.run(each()), strict=True):
            if isinstance(result, EngineClosed):
                raise result
            if isinstance(result, BaseException):
                self.row_failed(i, _embed_error_text(result), errors)
            else:
                out[i] = result[0]
        return out

    def _column(self, n_rows: int, rows: list[int], vectors: Mapping[int, Any]) -> Any:
        emb = self.embedder
        if emb.pooling == "none":  # a (n_tokens, n_embd) array per row
            empty = np.full((0, emb.n_embd), np.nan, dtype=np.float32)
            return [vectors.get(i, empty) for i in range(n_rows)]
        width = emb.n_out
        out = np.full((n_rows, width), np.nan, dtype=np.float32)
        for i, vector in vectors.items():
            out[i] = vector
        if emb.pooling == "rank" and width == 1:
            return out[:, 0]
        return out


def _embed_error_text(exc: BaseException) -> str:
    n_tokens, limit = getattr(exc, "n_tokens", None), getattr(exc, "limit", None)
    if isinstance(exc, PromptTooLong) and n_tokens is not None and limit is not None:
        # The embedder's own message names the text's index within its call: here always 0.
        return (
            f"PromptTooLong: the text has {n_tokens} tokens, more than the {limit} one text may have; "
            "pass truncate=True to cut it, or raise n_batch"
        )
    return error_text(exc)


def generate(
    dataset: Any,
    model: str | os.PathLike[str],
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    concurrency: int | tuple[int, int] = 1,
    num_cpus: float = 1,
    batch_size: int | None = 256,
    batch_format: str = "default",
    generate_options: Mapping[str, Any] | None = None,
    **map_batches_options: Any,
) -> Any:
    """``dataset.map_batches(Generate, ...)``: ``concurrency`` actors (or an autoscaling
    ``(min, max)``) of ``num_cpus`` cores, each holding one ``LLM``. ``generate_options`` go
    to :class:`Generate` (columns, ``on_error``, ``LLM`` options); ``map_batches_options`` to
    ``map_batches``."""
    kwargs = {"model": str(model), "sampling_params": sampling_params, **(generate_options or {})}
    return dataset.map_batches(
        Generate,
        fn_constructor_kwargs=kwargs,
        compute=actor_pool(concurrency),
        num_cpus=num_cpus,
        batch_size=batch_size,
        batch_format=batch_format,
        **map_batches_options,
    )


def embed(
    dataset: Any,
    model: str | os.PathLike[str],
    *,
    concurrency: int | tuple[int, int] = 1,
    num_cpus: float = 1,
    batch_size: int | None = 1024,
    batch_format: str = "default",
    embed_options: Mapping[str, Any] | None = None,
    **map_batches_options: Any,
) -> Any:
    """``dataset.map_batches(Embed, ...)``: ``concurrency`` actors (or an autoscaling
    ``(min, max)``) of ``num_cpus`` cores, each holding one ``Embedder``. ``embed_options`` go
    to :class:`Embed` (columns, ``on_error``, ``Embedder`` options); ``map_batches_options``
    to ``map_batches``."""
    kwargs = {"model": str(model), **(embed_options or {})}
    return dataset.map_batches(
        Embed,
        fn_constructor_kwargs=kwargs,
        compute=actor_pool(concurrency),
        num_cpus=num_cpus,
        batch_size=batch_size,
        batch_format=batch_format,
        **map_batches_options,
    )
