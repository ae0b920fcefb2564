"""``Embedder``: many texts, from many callers, packed into few ``llama_decode`` calls.

How a call flows:

1. ``embed(texts)`` (any thread), ``encode(sentences)`` or ``await aembed(texts)`` tokenizes
   on the caller's thread (so tokenization runs in parallel and a bad input raises at the
   call), checks every text against the per-text limit (error or truncation), and enqueues
   a job: its sequences go to the back of one FIFO shared by all callers, and their tokens to
   ``pending_tokens``. ``encode`` enqueues one job per ``batch_size`` texts, so the worker
   starts on the first texts while the caller tokenizes the rest.
2. One worker thread (``llamabatch.worker.Worker``) owns the llama.cpp context. It takes a
   *pack* from the front of the queue — whole sequences of any callers, at most ``capacity``
   tokens (sized by the pending work: everything pending when that is less, a full pack
   otherwise) and ``pack_seq_max`` sequences — writes it into the one preallocated batch
   (every token an output, sequence ``k`` of the pack as ``seq_id`` k, positions from 0),
   clears the memory and decodes once. llama.cpp pools each sequence
   (``llama_get_embeddings_seq``) and the worker routes each vector to its caller's row.
3. A decode that fails for lack of memory is retried with the first half of the pack,
   halving down to a single sequence (``worker.halve_and_retry``); a sequence that cannot be
   decoded even alone fails its own call with a clear error, the rest of the pack — other
   callers included — carries on.
4. When a job's last vector arrives its future resolves; the caller normalises its rows.

Limits that keep llama.cpp from aborting the process (not only from failing):

- Models without KV memory (BERT and other encoders) compute a batch in one shot: the whole
  pack must fit in one ubatch, so such models get ``n_ubatch = n_batch``.
- With mean/CLS/rank pooling a sequence split across two ubatches is pooled wrongly, so a
  pack never exceeds ``n_ubatch`` tokens for those poolings either; and without a unified KV
  cache (one stream per sequence) llama.cpp cuts every sequence of a multi-sequence batch
  apart, so such packs then hold one sequence.
- llama.cpp's graph reservation for mean pooling asserts that ``n_ubatch`` (and ``n_ctx``
  when smaller) is a multiple of ``n_seq_max``; the context's sizes are rounded up to
  multiples of ``n_seq_max`` (packs still respect the sizes asked for).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Literal, overload

import numpy as np

from llamabatch._core.batch import BatchPool
from llamabatch._ffi.context import Context, DecodeCode
from llamabatch._ffi.model import Model
from llamabatch.errors import DecodeError, EngineClosed, KVCacheFull, PromptTooLong
from llamabatch.params import INT32_MAX, check_positive_int
from llamabatch.telemetry import EmbedderCounters, EmbedderStats, EmbedPackEvent, Listener, Telemetry
from llamabatch.worker import RetryOutcome, Worker, halve_and_retry

__all__ = ["NORMALIZATIONS", "POOLINGS", "PRECISIONS", "Embedder", "pack_budget"]

logger = logging.getLogger("llamabatch")

#: Pooling modes ``Embedder`` accepts (``None`` means: what the GGUF declares).
POOLINGS = ("mean", "cls", "last", "rank", "none")
#: Normalisation modes (``True`` means ``"l2"``, ``False`` means ``"none"``).
NORMALIZATIONS = ("l2", "none", "max_abs")
#: ``encode(precision=...)`` values, as sentence-transformers names them.
PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")

#: Poolings whose result is wrong if a sequence is split across ubatches.
_WHOLE_UBATCH_POOLINGS = ("mean", "cls", "rank")

#: One text's vector, and the rows of many texts (float32).
Vector = np.ndarray[tuple[int], np.dtype[np.float32]]
Matrix = np.ndarray[tuple[int, int], np.dtype[np.float32]]


def pack_budget(pending_tokens: int, capacity: int) -> int:
    """Tokens the next pack may hold (seed 000, "intelligent batch sizing").

    Under light load (``pending_tokens < capacity``) the pack is sized to the pending work;
    under heavy load it is a full ``capacity``. The context's memory is cleared per pack, so
    there is never an in-flight pack to leave room for.
    """
    return max(0, min(pending_tokens, capacity))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _normalize_mode(normalize: Any) -> str:
    if normalize is True:
        return "l2"
    if normalize is False or normalize is None:
        return "none"
    if isinstance(normalize, str) and normalize in NORMALIZATIONS:
        return normalize
    raise ValueError(f"normalize must be one of {NORMALIZATIONS} (or True/False), got {normalize!r}")


def _normalize_rows(x: np.ndarray, mode: str) -> np.ndarray:
    """Normalise the last axis of ``x`` in place; all-zero rows stay zero."""
    if mode == "none" or x.size == 0:
        return x
    if mode == "l2":
        scale = np.sqrt(np.einsum("...i,...i->...", x, x))[..., None]
    else:  # max_abs
        scale = np.abs(x).max(axis=-1, keepdims=True)
    np.divide(x, scale, out=x, where=scale > 0)
    return x


def _quantize(x: np.ndarray, precision: str) -> np.ndarray:
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


def _as_texts(texts: Any) -> tuple[bool, list[str]]:
    """``(single, texts)``: a lone string becomes a list of one."""
    if isinstance(texts, str):
        return True, [texts]
    if isinstance(texts, (bytes, bytearray)):
        raise TypeError("texts must be a str or a sequence of str, not bytes: decode them first")
    if isinstance(texts, np.ndarray):
        return False, texts.tolist()
    try:
        return False, list(texts)
    except TypeError:
        raise TypeError(f"texts must be a str or a sequence of str, got {type(texts).__name__}") from None


def _cancel_submitted(submit: asyncio.Future[Any]) -> None:
    """Cancel the job an abandoned ``aembed`` submitted (its texts are then not packed)."""
    if not submit.cancelled() and submit.exception() is None:
        submit.result().future.cancel()


def _show_progress(show_progress_bar: bool | None) -> bool:
    """sentence-transformers' default: a bar when its logger (here ``llamabatch``) is at
    INFO or DEBUG."""
    if show_progress_bar is None:
        return logger.getEffectiveLevel() in (logging.INFO, logging.DEBUG)
    return bool(show_progress_bar)


class _ProgressBar:
    """A tqdm bar on stderr advanced per text by the worker thread; ``close`` on the caller's."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._lock = threading.Lock()
        self._bar: Any = tqdm(total=total, desc="Embedding", unit="text", file=sys.stderr)

    def update(self, n: int) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(n)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class _Job:
    """Texts of one call (or of one ``batch_size`` chunk of it): the rows they fill, the
    future that resolves when they are all in, and the progress bar they advance."""

    __slots__ = ("future", "n_done", "n_reported", "out", "progress", "remaining", "t_submit")

    def __init__(self, out: Any, remaining: int, progress: _ProgressBar | None) -> None:
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.out = out  # shared by the jobs of one call: each writes its own rows
        self.remaining = remaining
        self.progress = progress
        self.n_done = 0
        self.n_reported = 0
        self.t_submit = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.future.done()

    def store(self, index: int, value: np.ndarray) -> None:
        """One text's result (worker thread); ``deliver`` publishes it."""
        self.out[index] = value
        self.remaining -= 1
        self.n_done += 1

    def deliver(self) -> None:
        """Advance the bar, then resolve the job when its last text is in (the bar must
        move before the caller wakes and closes it)."""
        if self.progress is not None and self.n_done > self.n_reported:
            self.progress.update(self.n_done - self.n_reported)
            self.n_reported = self.n_done
        if self.remaining == 0:
            try:
                self.future.set_result(None)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass

    def fail(self, error: BaseException) -> None:
        """End the job with ``error`` unless it has ended already (exactly once)."""
        try:
            self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass


class _Seq:
    """One text of a job, tokenized, waiting in the queue or in a pack."""

    __slots__ = ("index", "job", "n", "tokens")

    def __init__(self, job: _Job, index: int, tokens: np.ndarray) -> None:
        self.job = job
        self.index = index  # the text's index in its call
        self.tokens = tokens
        self.n = int(tokens.shape[0])


class _PackDecode:
    """The decodes of one pack: which part was tried last, and the counts for telemetry."""

    __slots__ = ("decode_time", "decodes", "embedder", "pack", "part", "start")

    def __init__(self, embedder: Embedder, pack: list[_Seq]) -> None:
        self.embedder = embedder
        self.pack = pack
        self.start = 0  # the first sequence not done yet
        self.part: list[_Seq] = []
        self.decodes = 0
        self.decode_time = 0.0

    def attempt(self, budget: int) -> tuple[int, int]:
        """Decode the sequences from ``start`` that fit in ``budget`` tokens (at least one);
        ``(code, tokens)`` for ``halve_and_retry``."""
        pack = self.pack
        part = [pack[self.start]]
        tokens = part[0].n
        for seq in pack[self.start + 1 :]:
            if tokens + seq.n > budget:
                break
            part.append(seq)
            tokens += seq.n
        self.part = part
        t0 = time.perf_counter()
        code = self.embedder._decode(part)
        self.decode_time += time.perf_counter() - t0
        self.decodes += 1
        return code, tokens


class Embedder(Worker):
    """Embeddings from one GGUF model, packing the texts of all callers into shared decodes.

    Args:
        model_path: the ``.gguf`` file (an embedding model such as a converted BERT, or any
            decoder used as an embedding model).
        n_batch: packing capacity: the most tokens in one decode. Also the per-text limit
            (``max_tokens``), lowered to the KV cells of one sequence with
            ``kv_unified=False`` and to the model's ``n_ctx_train`` for encoders.
        n_ubatch: llama.cpp's physical micro-batch (default ``n_batch``; must be <= n_batch).
            Models without KV memory (BERT-like encoders) always get ``n_ubatch = n_batch``;
            with mean, CLS or rank pooling a pack never exceeds ``n_ubatch`` tokens.
        n_seq_max: the most sequences (texts) in one decode (<= llama.cpp's limit, 256).
        n_ctx: KV cache size for models with memory (default: ``n_batch``); encoders ignore it.
        pooling: ``"mean"``, ``"cls"``, ``"last"``, ``"rank"`` or ``"none"``; default: what the
            GGUF declares, or ``"mean"`` when it declares nothing. ``"none"`` makes ``embed``
            return one ``(n_tokens, n_embd)`` array per text; ``"rank"`` returns the scores of
            a reranker's classification head (no normalisation) and needs a model that has one.
        normalize: ``"l2"`` (default), ``"none"`` or ``"max_abs"`` (also ``True``/``False``);
            applied to every vector returned (with pooling ``"none"``: every token's), never to
            rank scores. All-zero vectors stay zero. ``embed(normalize=...)`` overrides it.
        truncate: cut texts longer than the per-text limit (keeping the model's trailing special
            token, e.g. BERT's ``[SEP]``) instead of raising ``PromptTooLong``.
        n_threads: CPU threads for llama.cpp (default: all cores).
        flash_attn: ``"auto"`` (default: llama.cpp enables it where the backend supports it,
            as the CPU does), ``True``, ``False``; ``None`` means ``"auto"``. On CPU flash
            attention skips the masked-out pairs of a pack: about 3x the texts/s of ``False``.
        n_gpu_layers: layers to offload to a GPU (-1: all; needs a GPU build).
        kv_unified: one KV buffer for all sequences (default). ``False`` gives each sequence
            only ``n_ctx / n_seq_max`` cells (llama.cpp pads them to 256; ``context.n_ctx_seq``),
            which then caps ``max_tokens``, and, with mean/CLS/rank pooling, packs of one text
            (llama.cpp would split the texts of a pack across ubatches).
        load_mode: how the weights are loaded (``"mmap"``, ``"none"``, ...).
        validate: check the GGUF file before llama.cpp reads it (``False`` skips the check).

    Empty strings are embedded like any other text: they still get the model's special tokens
    (BERT: ``[CLS] [SEP]``; Llama: ``<s>``). A text that tokenizes to no token at all (only
    with models that add no special token) gets an all-zero vector (pooling ``"none"``: a
    ``(0, n_embd)`` array) without a decode.

    Raises:
        ValueError: an invalid parameter (the message names it), or ``pooling="rank"`` on a
            model without a classification head.
        FileNotFoundError, ModelLoadError: the model file cannot be loaded.
        ContextError: llama.cpp could not create the context.
    """

    _kind = "embedder"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_seq_max: int = 64,
        n_ctx: int | None = None,
        pooling: str | None = None,
        normalize: str | bool = "l2",
        truncate: bool = False,
        n_threads: int | None = None,
        flash_attn: bool | str | None = "auto",
        n_gpu_layers: int = 0,
        kv_unified: bool = True,
        load_mode: str = "mmap",
        validate: bool = True,
    ) -> None:
        Worker.__init__(self, "llamabatch-embedder")
        self._queue: deque[_Seq] = deque()
        self._pack: list[_Seq] = []  # the pack being decoded (ended by _fail_pending on a crash)
        # Context checks the other parameters; these four are rounded here before it sees them.
        check_positive_int("n_batch", n_batch)
        check_positive_int("n_ubatch", n_ubatch, allow_none=True)
        check_positive_int("n_seq_max", n_seq_max)
        check_positive_int("n_ctx", n_ctx, allow_none=True)
        if n_ubatch is not None and n_ubatch > n_batch:  # rounding could hide it
            raise ValueError(f"n_ubatch ({n_ubatch}) must be <= n_batch ({n_batch})")
        for name, value in (("n_batch", n_batch), ("n_ctx", n_ctx)):
            if value is not None and _round_up(value, n_seq_max) > INT32_MAX:
                raise ValueError(
                    f"{name} ({value}) rounded up to a multiple of n_seq_max ({n_seq_max}) exceeds "
                    f"{INT32_MAX}, the most llama.cpp takes"
                )
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS} or None, got {pooling!r}")
        self.normalize: str = _normalize_mode(normalize)
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate must be True or False, got {truncate!r}")
        self.truncate = truncate

        self.model = Model(model_path, n_gpu_layers=n_gpu_layers, load_mode=load_mode, validate=validate)
        try:
            declared = self.model.pooling_type
            self.pooling: str = pooling or (declared if declared in POOLINGS else "mean")
            if self.pooling == "rank" and not self.model.has_classifier_head:
                raise ValueError(
                    f"pooling='rank' needs a classification head (tensor cls.weight or cls.output.weight), "
                    f"and {self.model.path.name} has none: it is not a reranker; use pooling 'mean', "
                    "'cls' or 'last' for embeddings"
                )
            self.context = self._make_context(
                n_batch, n_batch if n_ubatch is None else n_ubatch, n_seq_max, n_ctx,
                n_threads=n_threads, flash_attn=flash_attn, kv_unified=kv_unified,
            )  # fmt: skip
            ctx = self.context
            self.n_batch: int = n_batch
            self.n_ubatch: int = n_batch if not ctx.has_memory else min(n_ubatch or n_batch, ctx.n_ubatch)
            self.n_seq_max: int = n_seq_max
            self.n_ctx: int = ctx.n_ctx
            #: the most tokens in one pack
            self.capacity: int = min(n_batch, ctx.n_batch)
            if not ctx.has_memory or self.pooling in _WHOLE_UBATCH_POOLINGS:
                self.capacity = min(self.capacity, self.n_ubatch, ctx.n_ubatch)
            #: the most sequences in one pack
            self.pack_seq_max: int = n_seq_max
            if ctx.has_memory and not ctx.kv_unified and self.pooling in _WHOLE_UBATCH_POOLINGS:
                # One KV stream per sequence: llama.cpp splits such a batch into ubatches with
                # equal tokens per sequence, cutting sequences apart; pool one at a time.
                self.pack_seq_max = 1
            #: the most tokens one text may have (special tokens included)
            self.max_tokens: int = self.capacity
            if ctx.has_memory:  # without a unified KV cache a text gets one stream's cells
                self.max_tokens = min(self.max_tokens, ctx.n_ctx_seq)
            else:  # absolute position embeddings end at n_ctx_train
                self.max_tokens = min(self.max_tokens, self.model.n_ctx_train)
            self.n_embd: int = self.model.n_embd
            self.n_out: int = self.model.n_cls_out if self.pooling == "rank" else self.model.n_embd
            self._suffix = self._special_suffix()
            self.telemetry = Telemetry()
            self._pool = BatchPool(self.capacity, 1)
            self._batch: Any = self._pool.acquire()
            self._forward = ctx.decode_address if ctx.has_memory else ctx.encode_address
        except BaseException:
            self.close()  # the worker never started: frees what was made
            raise

        self._pending_tokens = 0
        self._pending_at_take = 0
        self._counters = EmbedderCounters()  # the worker thread's, written under _cond
        self._n_calls = 0  # calls and texts are counted by the callers, under _cond
        self._n_texts = 0
        logger.info(
            "Embedder %s: pooling=%s capacity=%d tokens/pack, n_seq_max=%d, n_batch=%d, n_ubatch=%d, "
            "n_ctx=%d, kv memory=%s, max %d tokens/text",
            self.model.path.name, self.pooling, self.capacity, n_seq_max, ctx.n_batch, ctx.n_ubatch,
            ctx.n_ctx, ctx.has_memory, self.max_tokens,
        )  # fmt: skip
        self._start()

    # -- construction helpers -------------------------------------------------------------

    def _make_context(
        self, n_batch: int, n_ubatch: int, n_seq_max: int, n_ctx: int | None, **kwargs: Any
    ) -> Context:
        """The context, sized so that llama.cpp's own checks cannot abort the process."""

        def make(ubatch: int, ctx_size: int) -> Context:
            try:
                # Multiples of n_seq_max: llama.cpp's mean-pooling graph reservation asserts it.
                return Context(
                    self.model,
                    n_ctx=_round_up(ctx_size, n_seq_max),
                    n_batch=_round_up(n_batch, n_seq_max),
                    n_ubatch=_round_up(ubatch, n_seq_max),
                    n_seq_max=n_seq_max,
                    embeddings=True,
                    pooling=self.pooling,
                    **kwargs,
                )
            except ValueError as exc:
                if n_ctx is not None or "n_ctx" not in str(exc).partition("\n")[0]:
                    raise
                # The caller left n_ctx to us: it is n_batch's, so n_batch is what to change.
                raise ValueError(
                    f"n_batch ({n_batch}) is too large: n_ctx defaults to it, and {exc}"
                ) from None

        context = make(n_ubatch, n_ctx or n_batch)
        if not context.has_memory and (context.n_ubatch < n_batch or context.n_ctx < n_batch):
            # No KV memory: a pack is computed in one shot, so it must fit in one ubatch.
            logger.info("%s keeps no KV memory: using n_ubatch = n_batch = %d", self.model.path.name, n_batch)
            context.close()
            context = make(n_batch, max(n_ctx or 0, n_batch))
        return context

    def _special_suffix(self) -> list[int]:
        """The special tokens the tokenizer appends (BERT: ``[SEP]``), kept when truncating."""
        plain = self.model.tokenize("a", add_special=False)
        full = self.model.tokenize("a", add_special=True)
        for start in range(len(full) - len(plain) + 1):
            if plain and full[start : start + len(plain)] == plain:
                return full[start + len(plain) :]
        return []

    # -- public API -----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """The tokens ``embed`` computes for ``text`` (with the model's special tokens)."""
        with self._using_resources():
            return self.model.tokenize(text)

    @overload
    def embed(  # type: ignore[overload-overlap]  # str is also an Iterable[str]
        self, texts: str, *, normalize: str | bool | None = None, show_progress_bar: bool | None = None
    ) -> Vector: ...

    @overload
    def embed(
        self,
        texts: Iterable[str],
        *,
        normalize: str | bool | None = None,
        show_progress_bar: bool | None = None,
    ) -> Matrix: ...

    def embed(
        self,
        texts: str | Iterable[str],
        *,
        normalize: str | bool | None = None,
        show_progress_bar: bool | None = None,
    ) -> Any:
        """Embed ``texts``; returns float32 ``(len(texts), n_embd)`` rows in input order, or
        one ``(n_embd,)`` vector for a single string.

        Safe to call from many threads at once: all callers' texts are packed together.
        With pooling ``"none"`` returns a list of ``(n_tokens, n_embd)`` arrays (one array
        for a single string); with ``"rank"`` the scores, shape ``(len(texts),)`` (or
        ``(len(texts), n_cls_out)``; a single string gives its score).

        Args:
            normalize: this call's normalisation (``"l2"``, ``"none"``, ``"max_abs"``,
                ``True``/``False``); default: the Embedder's ``normalize``.
            show_progress_bar: a tqdm bar on stderr advancing per text; default: shown when
                the ``llamabatch`` logger is at INFO or DEBUG (sentence-transformers' rule).

        Raises:
            PromptTooLong: a text exceeds ``max_tokens`` and ``truncate`` is off (the
                message names its index and token count).
            KVCacheFull, DecodeError: a text could not be decoded even alone.
            EngineClosed: the embedder is (or gets) closed.
            TypeError: ``texts`` is bytes or holds a non-string.
            RuntimeError: called from the worker thread (a listener): it would wait for itself.
        """
        single, items = _as_texts(texts)
        mode = self.normalize if normalize is None else _normalize_mode(normalize)
        out = self._finish(self._embed_rows(items, len(items), _show_progress(show_progress_bar)), mode)
        return out[0] if single else out

    @overload
    async def aembed(  # type: ignore[overload-overlap]  # str is also an Iterable[str]
        self, texts: str, *, normalize: str | bool | None = None, show_progress_bar: bool | None = None
    ) -> Vector: ...

    @overload
    async def aembed(
        self,
        texts: Iterable[str],
        *,
        normalize: str | bool | None = None,
        show_progress_bar: bool | None = None,
    ) -> Matrix: ...

    async def aembed(
        self,
        texts: str | Iterable[str],
        *,
        normalize: str | bool | None = None,
        show_progress_bar: bool | None = None,
    ) -> Any:
        """``embed`` for asyncio: the texts join the shared packs; the event loop keeps running.

        Tokenization happens in a worker thread, so long texts do not stall the event loop.
        Cancelling the awaiting task drops the call's texts that were not packed yet.
        """
        single, items = _as_texts(texts)
        mode = self.normalize if normalize is None else _normalize_mode(normalize)
        out = self._new_rows(len(items))
        bar = _ProgressBar(len(items)) if _show_progress(show_progress_bar) else None
        try:
            submit = asyncio.ensure_future(asyncio.to_thread(self._submit, items, 0, out, bar, True))
            try:
                job = await asyncio.shield(submit)
            except asyncio.CancelledError:  # the texts are (being) queued: drop them
                submit.add_done_callback(_cancel_submitted)
                raise
            await asyncio.wrap_future(job.future)
        finally:
            if bar is not None:
                bar.close()
        result = self._finish(out, mode)
        return result[0] if single else result

    @overload
    def encode(  # type: ignore[overload-overlap]  # str is also an Iterable[str]
        self,
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
        self,
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
        self,
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
        self,
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
        show = _show_progress(show_progress_bar)
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

        single, items = _as_texts(sentences)
        if prompt:
            items = [prompt + text if isinstance(text, str) else text for text in items]
        rows = self._finish(self._embed_rows(items, batch_size, show), self.normalize)
        if output_value == "token_embeddings":  # sentence-transformers returns these unconverted
            return rows[0] if single else rows
        if truncate_dim is not None and rows.ndim == 2:
            rows = np.ascontiguousarray(rows[:, :truncate_dim])
        if normalize_embeddings:
            rows = _normalize_rows(rows, "l2")
        rows = _quantize(rows, precision)
        if convert_to_tensor or not convert_to_numpy:
            torch = _import_torch("convert_to_tensor=True" if convert_to_tensor else "convert_to_numpy=False")
            tensor = torch.from_numpy(rows)
            if convert_to_tensor:
                return tensor[0] if single else tensor
            return tensor[0] if single else list(tensor)
        return rows[0] if single else rows

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(EmbedPackEvent)`` after every pack (on the worker thread: be quick)."""
        self.telemetry.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        self.telemetry.remove_listener(listener)

    def stats(self) -> EmbedderStats:
        """Running totals and what is queued: packs, tokens per pack, pack utilisation, queue
        wait, retries, texts/s, ...

        Raises:
            EngineClosed: the embedder is closed.
        """
        with self._cond:
            self._raise_if_closed()
            c = replace(self._counters)
            calls, texts = self._n_calls, self._n_texts
            pending_tokens, queue_depth = self._pending_tokens, len(self._queue)
        packs, sequences, tokens = c.packs, c.sequences, c.tokens
        return EmbedderStats(
            pooling=self.pooling,
            capacity=self.capacity,
            n_seq_max=self.n_seq_max,
            calls=calls,
            texts=texts,
            packs=packs,
            decodes=c.decodes,
            sequences=sequences,
            failed_sequences=c.failed_sequences,
            tokens=tokens,
            decode_retries=c.decode_retries,
            tokens_per_pack=tokens / packs if packs else 0.0,
            sequences_per_pack=sequences / packs if packs else 0.0,
            utilisation=tokens / (packs * self.capacity) if packs else 0.0,
            queue_wait_mean_s=c.queue_wait / sequences if sequences else 0.0,
            queue_wait_max_s=c.queue_wait_max,
            decode_time_s=c.decode_time,
            pack_time_s=c.pack_time,
            texts_per_s=(sequences - c.failed_sequences) / c.pack_time if c.pack_time else 0.0,
            tokens_per_s=tokens / c.pack_time if c.pack_time else 0.0,
            pending_tokens=pending_tokens,
            queue_depth=queue_depth,
        )

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker and free the model; calls still queued or in a pack end with
        ``EngineClosed``. Idempotent. From a listener (the worker thread) it takes effect
        when the current pack ends."""
        super().close(timeout)

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closing", True):
                self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pooling={self.pooling} capacity={self.capacity}"
        return f"<llamabatch.Embedder {self.model.path.name} {state}>"

    # -- caller side ----------------------------------------------------------------------

    def _new_rows(self, n: int) -> Any:
        """The output of ``n`` texts: zero rows (texts without tokens keep them)."""
        if self.pooling == "none":
            return [np.zeros((0, self.n_embd), dtype=np.float32) for _ in range(n)]
        return np.zeros((n, self.n_out), dtype=np.float32)

    def _embed_rows(self, texts: list[str], chunk: int, show: bool) -> Any:
        """Queue ``texts`` in jobs of ``chunk`` texts, wait for them all; the raw rows."""
        if self.on_worker_thread:
            raise RuntimeError("an Embedder cannot be called from its own worker thread (a listener)")
        if self._closing:
            raise EngineClosed("the embedder is closed")
        out = self._new_rows(len(texts))
        bar = _ProgressBar(len(texts)) if show else None
        jobs: list[_Job] = []
        try:
            for start in range(0, len(texts), max(chunk, 1)):
                jobs.append(self._submit(texts[start : start + chunk], start, out, bar, new_call=not jobs))
            for job in jobs:
                job.future.result()
        except BaseException:
            for job in jobs:  # their texts not decoded yet are dropped
                job.future.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()
        return out

    def _submit(
        self, texts: list[str], offset: int, out: Any, bar: _ProgressBar | None, new_call: bool
    ) -> _Job:
        """Tokenize and check ``texts`` (the call's texts from ``offset``) on the caller's
        thread, then enqueue them as one job filling ``out[offset:]``."""
        with self._using_resources():  # EngineClosed once closing; close() waits for it
            tokens = [self._tokens_of(offset + i, text) for i, text in enumerate(texts)]
        seqs: list[_Seq] = []
        job = _Job(out, 0, bar)
        for i, t in enumerate(tokens):
            if t.shape[0]:
                seqs.append(_Seq(job, offset + i, t))
            else:  # no token at all: the zero row stands
                job.n_done += 1
        job.remaining = len(seqs)
        if not seqs:
            job.deliver()
            return job
        n_tokens = sum(s.n for s in seqs)
        with self._cond:
            self._raise_if_closed()
            self._queue.extend(seqs)
            self._pending_tokens += n_tokens
            self._n_calls += new_call
            self._n_texts += len(texts)
            self._cond.notify()
        return job

    def _tokens_of(self, index: int, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] is a {type(text).__name__}, not a str")
        tokens = self.model.tokenize(text)
        n = len(tokens)
        if n > self.max_tokens:
            if not self.truncate:
                error = PromptTooLong(
                    f"text {index} has {n} tokens, more than the {self.max_tokens} one text may have "
                    f"({self._limit_reason()}); pass truncate=True to cut it"
                )
                error.index = index  # type: ignore[attr-defined]
                error.n_tokens = n  # type: ignore[attr-defined]
                error.limit = self.max_tokens  # type: ignore[attr-defined]
                raise error
            suffix = self._suffix
            if suffix and tokens[-len(suffix) :] == suffix:
                tokens = tokens[: self.max_tokens - len(suffix)] + suffix
            else:
                tokens = tokens[: self.max_tokens]
        return np.asarray(tokens, dtype=np.int32)

    def _limit_reason(self) -> str:
        """What sets ``max_tokens``, and how to raise it."""
        ctx = self.context
        if self.max_tokens == self.capacity:
            return f"the pack capacity, {self.capacity} tokens: raise n_batch"
        if ctx.has_memory:
            return (
                f"the {ctx.n_ctx_seq} KV cells of one sequence: without a unified KV cache each of the "
                f"{ctx.n_seq_max} sequences gets n_ctx / n_seq_max; raise n_ctx or use kv_unified=True"
            )
        return f"the model's n_ctx_train, {self.model.n_ctx_train}: its position embeddings end there"

    def _finish(self, out: Any, mode: str) -> Any:
        """Normalise a completed call's rows with ``mode`` (on the caller's thread)."""
        if self.pooling == "rank":
            return out[:, 0] if self.n_out == 1 else out
        if self.pooling == "none":
            return [_normalize_rows(rows, mode) for rows in out]
        return _normalize_rows(out, mode)

    # -- worker thread (Worker's hooks) ---------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._queue)

    def _run_once(self) -> None:
        with self._cond:
            pack = self._take_pack()
        if pack:
            self._pack = pack  # what _fail_pending ends if the worker stops in the middle
            self._process(pack)

    def _interrupt(self) -> None:
        context = getattr(self, "context", None)
        if context is not None:
            context.abort()  # an in-flight decode returns 2 at its next graph node

    def _fail_pending(self, error: BaseException) -> None:
        with self._cond:
            rest = list(self._queue)
            self._queue.clear()
            self._pending_tokens = 0
        for seq in [*self._pack, *rest]:
            seq.job.fail(error)
        self._pack = []

    def _on_close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            self._pool.release(self._batch)
            self._batch = None
        if getattr(self, "context", None) is not None:
            self.context.close()
        if getattr(self, "model", None) is not None:
            self.model.close()

    def _take_pack(self) -> list[_Seq]:
        """Whole sequences from the front of the queue (caller holds ``_cond``)."""
        budget = pack_budget(self._pending_tokens, self.capacity)
        queue = self._queue
        pack: list[_Seq] = []
        tokens = 0
        while queue and len(pack) < self.pack_seq_max:
            seq = queue[0]
            if seq.job.done:  # its call failed or was cancelled: drop the rest of it
                queue.popleft()
                self._pending_tokens -= seq.n
                continue
            if tokens + seq.n > budget:
                break
            queue.popleft()
            pack.append(seq)
            tokens += seq.n
        self._pending_tokens -= tokens
        self._pending_at_take = self._pending_tokens
        return pack

    def _process(self, pack: list[_Seq]) -> None:
        """Decode ``pack``, retrying in halves on memory exhaustion; deliver every result."""
        t_start = time.perf_counter()
        waits = [t_start - seq.job.t_submit for seq in pack]
        run = _PackDecode(self, pack)
        retries = failed = 0
        limit = sum(seq.n for seq in pack)
        what = "llama_decode" if self.context.has_memory else "llama_encode"
        try:
            while run.start < len(pack):
                outcome = halve_and_retry(run.attempt, limit, floor=pack[run.start].n, what=what)
                retries += outcome.retries
                limit = outcome.budget  # memory stays short: the rest of the pack keeps the smaller budget
                part = run.part
                if outcome.ok:
                    self._collect(part)
                elif outcome.code is DecodeCode.ABORTED and self._closing:
                    self._pack = pack[run.start :]  # closing: these end with EngineClosed (_fail_pending)
                    return
                else:
                    self.context.clear_abort()
                    error = self._failure(outcome, part, retries)
                    for seq in part:
                        seq.job.fail(error)
                    failed += len(part)
                run.start += len(part)
            self._pack = []
        finally:
            self._account(pack, waits, run, retries, failed, time.perf_counter() - t_start)

    def _decode(self, part: list[_Seq]) -> int:
        batch = self._batch
        batch.clear()
        for seq_id, seq in enumerate(part):
            batch.add_sequence(seq.tokens, seq_id, 0, True)
        if self.context.has_memory:
            self.context.memory_clear(False)
        return self._forward(batch.address)

    def _collect(self, part: list[_Seq]) -> None:
        context = self.context
        if self.pooling == "none":
            row = 0
            for seq in part:
                rows = np.empty((seq.n, self.n_embd), dtype=np.float32)
                for j in range(seq.n):
                    rows[j] = context.embeddings_ith(row + j)
                row += seq.n
                if not seq.job.done:
                    seq.job.store(seq.index, rows)
        else:
            for seq_id, seq in enumerate(part):
                if seq.job.done:
                    continue
                vector = context.embeddings_seq(seq_id, self.n_out)
                if vector is None:  # pragma: no cover - the context was created with pooling
                    seq.job.fail(DecodeError(0, f"llama.cpp returned no pooled embedding for seq {seq_id}"))
                    continue
                seq.job.store(seq.index, vector)
        for job in dict.fromkeys(seq.job for seq in part):
            if not job.done:
                job.deliver()

    def _failure(self, outcome: RetryOutcome, part: list[_Seq], retries: int) -> DecodeError:
        """The error for the texts of ``part`` that could not be decoded."""
        context = self.context
        code = outcome.raw
        if outcome.code.retryable:
            seq = part[0]  # retried down to this single sequence
            if outcome.code is DecodeCode.NO_KV_SLOT:
                return KVCacheFull(
                    code,
                    f"text {seq.index} ({seq.n} tokens) does not fit in the KV cache even alone "
                    f"(n_ctx={context.n_ctx}, {context.n_ctx_seq} cells per sequence) after {retries} "
                    "retries with halved packs; raise n_ctx (or use kv_unified=True)",
                )
            return DecodeError(
                code,
                f"llama.cpp could not allocate memory to embed text {seq.index} ({seq.n} tokens) even "
                f"alone, after {retries} retries with halved packs (code {code}); lower n_batch",
            )
        indices = ", ".join(str(seq.index) for seq in part[:8]) + (", ..." if len(part) > 8 else "")
        base = outcome.code.error("llama_encode" if not context.has_memory else "llama_decode", code)
        return DecodeError(code, f"{base} while embedding texts {indices} ({len(part)} in the pack)")

    def _account(
        self,
        pack: list[_Seq],
        waits: list[float],
        run: _PackDecode,
        retries: int,
        failed: int,
        pack_time: float,
    ) -> None:
        tokens = sum(seq.n for seq in pack)
        with self._cond:  # stats() copies the counters under the lock: a consistent set
            c = self._counters
            c.packs += 1
            c.decodes += run.decodes
            c.sequences += len(pack)
            c.failed_sequences += failed
            c.tokens += tokens
            c.decode_retries += retries
            c.queue_wait += sum(waits)
            c.queue_wait_max = max(c.queue_wait_max, max(waits))
            c.decode_time += run.decode_time
            c.pack_time += pack_time
            pack_number = c.packs
        if self.telemetry.has_listeners:
            self.telemetry.emit(
                EmbedPackEvent(
                    pack=pack_number,
                    sequences=len(pack),
                    tokens=tokens,
                    capacity=self.capacity,
                    utilisation=tokens / self.capacity,
                    queue_wait=sum(waits) / len(waits),
                    decode_time=run.decode_time,
                    decode_retries=retries,
                    callers=len({id(seq.job) for seq in pack}),
                    decodes=run.decodes,
                    failed_sequences=failed,
                    pending_tokens=self._pending_at_take,
                )
            )


def _import_torch(option: str) -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(f"encode({option}) returns torch tensors, and torch is not installed") from None
    return torch
