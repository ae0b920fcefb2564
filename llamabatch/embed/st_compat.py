"""sentence-transformers' ``SentenceTransformer.encode`` on an ``Embedder``: its options, the
order of its steps (truncate, normalise, quantize) and its output types. ``Embedder.encode`` is
this module's ``encode``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, Protocol, overload

import numpy as np

from llamabatch.embed.jobs import Matrix, Vector, as_texts, normalize_rows, show_progress
from llamabatch.validate import check_positive_int

__all__ = ["PRECISIONS", "Encoder", "encode", "quantize"]


class Encoder(Protocol):
    """What :func:`encode` needs of an ``Embedder``."""

    @property
    def pooling(self) -> str: ...

    def encode_rows(self, texts: list[str], batch_size: int, show: bool) -> Any: ...


#: ``encode(precision=...)`` values, as sentence-transformers names them.
PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def quantize(x: np.ndarray, precision: str) -> np.ndarray:
    """sentence-transformers' ``precision`` on float32 rows: scalar (u)int8 with per-dimension
    ranges taken from ``x`` itself, or 1 bit per dimension packed 8 to a byte."""
    if precision == "float32":
        return x
    if precision in ("binary", "ubinary"):
        packed = np.packbits(x > 0, axis=-1)
        return (packed.astype(np.int16) - 128).astype(np.int8) if precision == "binary" else packed
    low = x.min(axis=0)
    step = (x.max(axis=0) - low) / 255
    # A dimension with one value (a single text) has no range: it maps to the lowest bucket.
    buckets = np.divide(x - low, step, out=np.zeros_like(x), where=step > 0)
    if precision == "uint8":
        return np.clip(buckets, 0, 255).astype(np.uint8)
    return np.clip(buckets - 128, -128, 127).astype(np.int8)


@overload
def encode(  # type: ignore[overload-overlap]  # str is also an Iterable[str]
    self: Encoder,
    sentences: str,
    *,
    prompt_name: str | None = ...,
    prompt: str | None = ...,
    batch_size: int = ...,
    show_progress_bar: bool | None = ...,
    output_value: Literal["sentence_embedding"] = ...,
    precision: Literal["float32"] = ...,
    convert_to_numpy: Literal[True] = ...,
    convert_to_tensor: Literal[False] = ...,
    device: str | None = ...,
    normalize_embeddings: bool = ...,
    truncate_dim: int | None = ...,
    pool: None = ...,
    chunk_size: None = ...,
) -> Vector: ...


@overload
def encode(
    self: Encoder,
    sentences: Iterable[str],
    *,
    prompt_name: str | None = ...,
    prompt: str | None = ...,
    batch_size: int = ...,
    show_progress_bar: bool | None = ...,
    output_value: Literal["sentence_embedding"] = ...,
    precision: Literal["float32"] = ...,
    convert_to_numpy: Literal[True] = ...,
    convert_to_tensor: Literal[False] = ...,
    device: str | None = ...,
    normalize_embeddings: bool = ...,
    truncate_dim: int | None = ...,
    pool: None = ...,
    chunk_size: None = ...,
) -> Matrix: ...


@overload
def encode(
    self: Encoder,
    sentences: str | Iterable[str],
    *,
    prompt_name: str | None = ...,
    prompt: str | None = ...,
    batch_size: int = ...,
    show_progress_bar: bool | None = ...,
    output_value: str | None = ...,
    precision: str = ...,
    convert_to_numpy: bool = ...,
    convert_to_tensor: bool = ...,
    device: str | None = ...,
    normalize_embeddings: bool = ...,
    truncate_dim: int | None = ...,
    pool: None = ...,
    chunk_size: None = ...,
) -> Any: ...


def encode(
    self: Encoder,
    sentences: str | Iterable[str],
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    batch_size: int = 32,
    show_progress_bar: bool | None = None,
    output_value: str | None = "sentence_embedding",
    precision: str = "float32",
    convert_to_numpy: bool = True,
    convert_to_tensor: bool = False,
    device: str | None = None,
    normalize_embeddings: bool = False,
    truncate_dim: int | None = None,
    pool: None = None,
    chunk_size: None = None,
) -> Any:
    """sentence-transformers' ``SentenceTransformer.encode``, on this Embedder.

    A single string gives a 1-D array, a sequence of strings a 2-D array (rows in input
    order). The texts are packed by tokens as ``embed`` packs them; ``batch_size`` only
    sets how many texts are tokenized and queued at a time (the worker starts on the
    first ones while the rest are tokenized), so any value gives the same vectors.

    Vectors are what the Embedder's ``normalize`` makes of the model's pooled output
    (L2 by default, as sentence-transformers' pipelines with a ``Normalize`` module give,
    e.g. all-MiniLM-L6-v2), then cut to ``truncate_dim`` dimensions, then L2-normalised
    when ``normalize_embeddings``, then quantized to ``precision`` (``"int8"``/``"uint8"``
    with per-dimension ranges from these embeddings, ``"binary"``/``"ubinary"`` 1 bit per
    dimension), as sentence-transformers orders these steps.

    Args:
        sentences: a string or a sequence of strings (a numpy array of strings too).
        prompt: a text put in front of every sentence (``"query: "``).
        prompt_name: named prompts are not configured on an Embedder: given without
            ``prompt`` it raises ``ValueError`` (with ``prompt``, it is ignored, as
            sentence-transformers ignores it).
        batch_size: texts queued at a time (> 0); see above.
        show_progress_bar: a tqdm bar on stderr advancing per text; default: shown when
            the ``llamabatch`` logger is at INFO or DEBUG (sentence-transformers' rule).
        output_value: ``"sentence_embedding"``; ``"token_embeddings"`` (a list of
            ``(n_tokens, n_embd)`` numpy arrays) needs ``Embedder(pooling="none")``.
        precision: ``"float32"``, ``"int8"``, ``"uint8"``, ``"binary"`` or ``"ubinary"``.
        convert_to_numpy: False gives a list of 1-D torch tensors (needs torch).
        convert_to_tensor: True gives one torch tensor (needs torch); wins over
            ``convert_to_numpy``.
        device: accepted for compatibility and ignored: the Embedder's device is fixed at
            construction (``n_gpu_layers``). A list of devices (multi-process) is refused.
        normalize_embeddings: L2-normalise the (truncated) vectors.
        truncate_dim: keep the first ``truncate_dim`` dimensions (Matryoshka models).
        pool, chunk_size: sentence-transformers' multi-process encoding; not supported
            (one Embedder already uses every core): must be None.

    Raises:
        ValueError: an unsupported option (the message names it).
        ImportError: torch output asked for and torch is not installed.
        and what ``embed`` raises.
    """
    show = show_progress(show_progress_bar)
    check_positive_int("batch_size", batch_size)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if pool is not None or chunk_size is not None or isinstance(device, (list, tuple)):
        raise ValueError(
            "multi-process encoding (pool, chunk_size, a list of devices) is not supported: one "
            "Embedder packs every caller's texts into one context that uses every core"
        )
    if truncate_dim is not None:
        check_positive_int("truncate_dim", truncate_dim)
    if prompt is None and prompt_name is not None:
        raise ValueError(
            f"prompt_name={prompt_name!r}: an Embedder has no named prompts; pass the text itself, "
            "e.g. prompt='query: '"
        )
    if output_value == "token_embeddings":
        if self.pooling != "none":
            raise ValueError(
                "output_value='token_embeddings' needs per-token outputs: create the Embedder with "
                f"pooling='none' (this one pools with {self.pooling!r})"
            )
        if precision != "float32":
            raise ValueError(
                "output_value='token_embeddings' gives float32 arrays: precision must be 'float32'"
            )
    elif output_value != "sentence_embedding":
        raise ValueError(
            f"output_value must be 'sentence_embedding' or 'token_embeddings', got {output_value!r}"
        )
    elif self.pooling == "none":
        raise ValueError(
            "this Embedder has pooling='none' (per-token outputs): use "
            "output_value='token_embeddings', or create it with a pooling"
        )
    if self.pooling == "rank" and (
        normalize_embeddings or truncate_dim is not None or precision != "float32"
    ):
        raise ValueError("rank scores take no normalize_embeddings, truncate_dim or precision")

    single, items = as_texts(sentences)
    if prompt:
        items = [prompt + text if isinstance(text, str) else text for text in items]
    rows = self.encode_rows(items, batch_size, show)
    if output_value == "token_embeddings":  # sentence-transformers returns these unconverted
        return rows[0] if single else rows
    if truncate_dim is not None and rows.ndim == 2:
        rows = np.ascontiguousarray(rows[:, :truncate_dim])
    if normalize_embeddings:
        rows = normalize_rows(rows, "l2")
    rows = quantize(rows, precision)
    if convert_to_tensor or not convert_to_numpy:
        torch = import_torch("convert_to_tensor=True" if convert_to_tensor else "convert_to_numpy=False")
        tensor = torch.from_numpy(rows)
        if convert_to_tensor:
            return tensor[0] if single else tensor
        return tensor[0] if single else list(tensor)
    return rows[0] if single else rows


def import_torch(option: str) -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(f"encode({option}) returns torch tensors, and torch is not installed") from None
    return torch
