"""``Embedder``: many texts, from many callers, packed into few ``llama_decode`` calls.

How a call flows:

1. ``embed(texts)`` (any thread) or ``await aembed(texts)`` tokenizes on the caller's thread
   (so tokenization runs in parallel and a bad input raises at the call), checks every text
   against the per-text limit (error or truncation), and enqueues one job: its sequences go
   to the back of one FIFO shared by all callers, and their tokens to ``pending_tokens``.
2. One worker thread owns the llama.cpp context. It takes a *pack* from the front of the
   queue — whole sequences of any callers, at most ``capacity`` tokens (sized by the pending
   work: everything pending when that is less, a full pack otherwise) and ``n_seq_max``
   sequences — writes it into the one preallocated batch (every token an output, sequence
   ``k`` of the pack as ``seq_id`` k, positions from 0), clears the memory and decodes once.
   llama.cpp pools each sequence (``llama_get_embeddings_seq``) and the worker routes each
   vector to its caller's row.
3. A decode that fails for lack of memory (code 1: no KV room; -2: a failed allocation) is
   retried with the first half of the pack, halving down to a single sequence (the floor);
   a sequence that cannot be decoded even alone fails its own call with a clear error, the
   rest of the pack — other callers included — carries on.
4. When a call's last vector arrives its future resolves; the caller normalises its rows.

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
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from llamabatch._core.batch import BatchPool
from llamabatch._ffi.context import Context, DecodeCode, decode_error
from llamabatch._ffi.context import max_parallel_sequences as _max_parallel_sequences
from llamabatch._ffi.model import Model
from llamabatch.errors import DecodeError, EngineClosed, KVCacheFull, LlamaBatchError, PromptTooLong
from llamabatch.params import check_positive_int
from llamabatch.telemetry import EmbedPackEvent, Listener, Telemetry

__all__ = ["NORMALIZATIONS", "POOLINGS", "Embedder", "pack_budget"]

logger = logging.getLogger("llamabatch")

#: Pooling modes ``Embedder`` accepts (``None`` means: what the GGUF declares).
POOLINGS = ("mean", "cls", "last", "rank", "none")
#: Normalisation modes (``True`` means ``"l2"``, ``False`` means ``"none"``).
NORMALIZATIONS = ("l2", "none", "max_abs")

#: Poolings whose result is wrong if a sequence is split across ubatches.
_WHOLE_UBATCH_POOLINGS = ("mean", "cls", "rank")


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


class _Job:
    """One ``embed``/``aembed`` call: its output rows and the future that delivers them."""

    __slots__ = ("future", "n_texts", "out", "remaining", "t_submit")

    def __init__(self, n_texts: int, out: Any, remaining: int) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.n_texts = n_texts
        self.out = out
        self.remaining = remaining
        self.t_submit = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.future.done()

    def put(self, index: int, value: np.ndarray) -> None:
        """Store one text's result (worker thread); resolve the call after the last one."""
        self.out[index] = value
        self.remaining -= 1
        if self.remaining == 0:
            try:
                self.future.set_result(self.out)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass

    def fail(self, error: BaseException) -> None:
        """End the call with ``error`` unless it has ended already (exactly once)."""
        try:
            self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass


class _Seq:
    """One text of a job, tokenized, waiting in the queue or in a pack."""

    __slots__ = ("index", "job", "n", "tokens")

    def __init__(self, job: _Job, index: int, tokens: np.ndarray) -> None:
        self.job = job
        self.index = index
        self.tokens = tokens
        self.n = int(tokens.shape[0])


class Embedder:
    """Embeddings from one GGUF model, packing the texts of all callers into shared decodes.

    Args:
        model_path: the ``.gguf`` file (an embedding model such as a converted BERT, or any
            decoder used as an embedding model).
        n_batch: packing capacity: the most tokens in one decode. Also the per-text limit.
        n_ubatch: llama.cpp's physical micro-batch (default ``n_batch``; must be <= n_batch).
            Models without KV memory (BERT-like encoders) always get ``n_ubatch = n_batch``;
            with mean, CLS or rank pooling a pack never exceeds ``n_ubatch`` tokens.
        n_seq_max: the most sequences (texts) in one decode (<= llama.cpp's limit, 256).
        n_ctx: KV cache size for models with memory (default: ``n_batch``); encoders ignore it.
        pooling: ``"mean"``, ``"cls"``, ``"last"``, ``"rank"`` or ``"none"``; default: what the
            GGUF declares, or ``"mean"`` when it declares nothing. ``"none"`` makes ``embed``
            return one ``(n_tokens, n_embd)`` array per text; ``"rank"`` returns the scores of
            a reranker's classification head (no normalisation).
        normalize: ``"l2"`` (default), ``"none"`` or ``"max_abs"`` (also ``True``/``False``);
            applied to every vector returned (with pooling ``"none"``: every token's), never to
            rank scores. All-zero vectors stay zero.
        truncate: cut texts longer than the per-text limit (keeping the model's trailing special
            token, e.g. BERT's ``[SEP]``) instead of raising ``PromptTooLong``.
        n_threads: CPU threads for llama.cpp (default: all cores).
        flash_attn: ``"auto"`` (default: llama.cpp enables it where the backend supports it,
            as the CPU does), ``True``, ``False``; ``None`` means ``"auto"``. On CPU flash
            attention skips the masked-out pairs of a pack: about 3x the texts/s of ``False``.
        n_gpu_layers: layers to offload to a GPU (-1: all; needs a GPU build).
        kv_unified: one KV buffer for all sequences (default). ``False`` gives each sequence
            only ``n_ctx / n_seq_max`` cells (a text that does not fit in them fails with
            ``KVCacheFull`` after the retry-by-halving) and, with mean/CLS/rank pooling, packs
            of one text (llama.cpp would split the texts of a pack across ubatches).
        load_mode: how the weights are loaded (``"mmap"``, ``"none"``, ...).

    Empty strings are embedded like any other text: they still get the model's special tokens
    (BERT: ``[CLS] [SEP]``; Llama: ``<s>``). A text that tokenizes to no token at all (only
    with models that add no special token) gets an all-zero vector (pooling ``"none"``: a
    ``(0, n_embd)`` array) without a decode.

    Raises:
        ValueError: an invalid parameter (the message names it).
        FileNotFoundError, ModelLoadError: the model file cannot be loaded.
        ContextError: llama.cpp could not create the context.
    """

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
    ) -> None:
        self._closed = True  # until fully constructed (close() and __del__ rely on it)
        check_positive_int("n_batch", n_batch)
        check_positive_int("n_ubatch", n_ubatch, allow_none=True)
        check_positive_int("n_seq_max", n_seq_max)
        check_positive_int("n_ctx", n_ctx, allow_none=True)
        check_positive_int("n_threads", n_threads, allow_none=True)
        if n_ubatch is not None and n_ubatch > n_batch:
            raise ValueError(f"n_ubatch ({n_ubatch}) must be <= n_batch ({n_batch})")
        max_seq = _max_parallel_sequences()
        if n_seq_max > max_seq:
            raise ValueError(f"n_seq_max must be <= {max_seq} (llama.cpp's limit), got {n_seq_max}")
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS} or None, got {pooling!r}")
        self.normalize: str = _normalize_mode(normalize)
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate must be True or False, got {truncate!r}")
        if not (flash_attn is None or isinstance(flash_attn, bool) or flash_attn == "auto"):
            raise ValueError(f"flash_attn must be True, False, 'auto' or None, got {flash_attn!r}")
        if not isinstance(kv_unified, bool):
            raise ValueError(f"kv_unified must be True or False, got {kv_unified!r}")
        if not isinstance(n_gpu_layers, int) or isinstance(n_gpu_layers, bool):
            raise ValueError(f"n_gpu_layers must be an int, got {n_gpu_layers!r}")

        self.model = Model(model_path, n_gpu_layers=n_gpu_layers, load_mode=load_mode)
        try:
            declared = self.model.pooling_type
            self.pooling: str = pooling or (declared if declared in POOLINGS else "mean")
            self.truncate = truncate
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
            if ctx.has_memory and not kv_unified and self.pooling in _WHOLE_UBATCH_POOLINGS:
                # One KV stream per sequence: llama.cpp splits such a batch into ubatches with
                # equal tokens per sequence, cutting sequences apart; pool one at a time.
                self.pack_seq_max = 1
            #: the most tokens one text may have (special tokens included)
            self.max_tokens: int = self.capacity
            if not ctx.has_memory:  # absolute position embeddings end at n_ctx_train
                self.max_tokens = min(self.max_tokens, self.model.n_ctx_train)
            self.n_embd: int = self.model.n_embd
            self.n_out: int = self.model.n_cls_out if self.pooling == "rank" else self.model.n_embd
            self._suffix = self._special_suffix()
            self.telemetry = Telemetry()
            self._pool = BatchPool(self.capacity, 1)
            self._batch = self._pool.acquire()
            self._forward = ctx.decode_address if ctx.has_memory else ctx.encode_address
        except BaseException:
            if getattr(self, "context", None) is not None:
                self.context.close()
            self.model.close()
            raise

        self._queue: deque[_Seq] = deque()
        self._cond = threading.Condition()
        self._pending_tokens = 0
        self._pending_at_take = 0
        self._n_packs = 0
        self._n_calls = 0
        self._n_texts = 0
        self._queue_wait_max = 0.0
        self._closing = False
        self._closed = False
        logger.info(
            "Embedder %s: pooling=%s capacity=%d tokens/pack, n_seq_max=%d, n_batch=%d, n_ubatch=%d, "
            "n_ctx=%d, kv memory=%s, max %d tokens/text",
            self.model.path.name, self.pooling, self.capacity, n_seq_max, ctx.n_batch, ctx.n_ubatch,
            ctx.n_ctx, ctx.has_memory, self.max_tokens,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="llamabatch-embedder", daemon=True)
        self._thread.start()

    # -- construction helpers -------------------------------------------------------------

    def _make_context(
        self, n_batch: int, n_ubatch: int, n_seq_max: int, n_ctx: int | None, **kwargs: Any
    ) -> Context:
        """The context, sized so that llama.cpp's own checks cannot abort the process."""

        def make(ubatch: int, ctx_size: int) -> Context:
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
        return self.model.tokenize(text)

    def embed(self, texts: Iterable[str]) -> np.ndarray | list[np.ndarray]:
        """Embed ``texts``; returns float32 ``(len(texts), n_embd)`` rows in input order.

        Safe to call from many threads at once: all callers' texts are packed together.
        With pooling ``"none"`` returns a list of ``(n_tokens, n_embd)`` arrays; with
        ``"rank"`` the scores, shape ``(len(texts),)`` (or ``(len(texts), n_cls_out)``).

        Raises:
            PromptTooLong: a text exceeds ``max_tokens`` and ``truncate`` is off (the
                message names its index and token count).
            KVCacheFull, DecodeError: a text could not be decoded even alone.
            EngineClosed: the embedder is (or gets) closed.
            TypeError: ``texts`` is a single string or holds a non-string.
        """
        if self._thread is threading.current_thread():
            raise RuntimeError("Embedder.embed cannot be called from its own worker thread (a listener)")
        job = self._submit(texts)
        try:
            out = job.future.result()
        except BaseException:
            job.future.cancel()
            raise
        return self._finish(out)

    async def aembed(self, texts: Iterable[str]) -> np.ndarray | list[np.ndarray]:
        """``embed`` for asyncio: the texts join the shared packs; the event loop keeps running.

        Tokenization happens at the call, on the loop's thread. Cancelling the awaiting task
        drops the call's texts that were not packed yet.
        """
        job = self._submit(texts)
        out = await asyncio.wrap_future(job.future)
        return self._finish(out)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(EmbedPackEvent)`` after every pack (on the worker thread: be quick)."""
        self.telemetry.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        self.telemetry.remove_listener(listener)

    def stats(self) -> dict[str, Any]:
        """Running totals: packs, tokens per pack, pack utilisation, queue wait, retries, ..."""
        c = self.telemetry.snapshot()
        packs = c.get("packs", 0)
        sequences = c.get("sequences", 0)
        tokens = c.get("tokens", 0)
        decode_time = c.get("decode_time", 0.0)
        return {
            "pooling": self.pooling,
            "capacity": self.capacity,
            "n_seq_max": self.n_seq_max,
            "calls": self._n_calls,
            "texts": self._n_texts,
            "packs": int(packs),
            "decodes": int(c.get("decodes", 0)),
            "sequences": int(sequences),
            "tokens": int(tokens),
            "tokens_per_pack": tokens / packs if packs else 0.0,
            "sequences_per_pack": sequences / packs if packs else 0.0,
            "utilisation": tokens / c["capacity"] if c.get("capacity") else 0.0,
            "queue_wait_mean_s": c.get("queue_wait", 0.0) / sequences if sequences else 0.0,
            "queue_wait_max_s": self._queue_wait_max,
            "decode_time_s": decode_time,
            "pack_time_s": c.get("pack_time", 0.0),
            "texts_per_s": sequences / c["pack_time"] if c.get("pack_time") else 0.0,
            "tokens_per_s": tokens / c["pack_time"] if c.get("pack_time") else 0.0,
            "retries": int(c.get("retries", 0)),
            "failed_sequences": int(c.get("failed", 0)),
            "pending_tokens": self._pending_tokens,
            "queue_depth": len(self._queue),
        }

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closing or self._closed

    def close(self) -> None:
        """Stop the worker; calls still queued or in a pack end with ``EngineClosed``. Idempotent."""
        if self._closed:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.context.abort()  # an in-flight decode returns 2 at its next graph node
        if threading.current_thread() is self._thread:
            return  # called from a listener: the worker ends after this pack; gc frees the rest
        self._thread.join()
        self._closed = True
        self.context.close()
        self.model.close()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pooling={self.pooling} capacity={self.capacity}"
        return f"<llamabatch.Embedder {self.model.path.name} {state}>"

    # -- caller side ----------------------------------------------------------------------

    def _submit(self, texts: Iterable[str]) -> _Job:
        """Tokenize and check ``texts`` on the caller's thread, then enqueue one job."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be a sequence of strings, not a single string; wrap it: [text]")
        if self._closing:
            raise EngineClosed("the embedder is closed")
        texts = list(texts)
        seqs_tokens = [self._tokens_of(i, text) for i, text in enumerate(texts)]
        n = len(texts)
        if self.pooling == "none":
            out: Any = [np.zeros((0, self.n_embd), dtype=np.float32) for _ in range(n)]
        else:
            out = np.zeros((n, self.n_out), dtype=np.float32)
        job = _Job(n, out, sum(1 for t in seqs_tokens if t.shape[0]))
        seqs = [_Seq(job, i, t) for i, t in enumerate(seqs_tokens) if t.shape[0]]
        if not seqs:
            job.future.set_result(out)
            return job
        n_tokens = sum(s.n for s in seqs)
        with self._cond:
            if self._closing:
                raise EngineClosed("the embedder is closed")
            self._queue.extend(seqs)
            self._pending_tokens += n_tokens
            self._n_calls += 1
            self._n_texts += n
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
                    f"(capacity {self.capacity} tokens per pack"
                    + ("" if self.context.has_memory else f", n_ctx_train {self.model.n_ctx_train}")
                    + "); pass truncate=True to cut it, or raise n_batch"
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

    def _finish(self, out: Any) -> np.ndarray | list[np.ndarray]:
        """Normalise a completed call's rows (on the caller's thread)."""
        if self.pooling == "rank":
            return out[:, 0] if self.n_out == 1 else out
        if self.pooling == "none":
            return [_normalize_rows(rows, self.normalize) for rows in out]
        return _normalize_rows(out, self.normalize)

    # -- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException = EngineClosed("the embedder was closed")
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        break
                    pack = self._take_pack()
                if pack:
                    self._process(pack)
        except BaseException as exc:  # pragma: no cover - a bug; never leave callers hanging
            logger.critical("llamabatch embedder worker crashed", exc_info=True)
            error = LlamaBatchError(f"the embedder's worker thread crashed: {exc!r}")
            raise
        finally:
            with self._cond:
                self._closing = True
                rest = list(self._queue)
                self._queue.clear()
                self._pending_tokens = 0
            for seq in rest:
                seq.job.fail(error)
            self._pool.release(self._batch)

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
        retries = decodes = failed = 0
        decode_time = 0.0
        limit = sum(seq.n for seq in pack)
        i = 0
        try:
            while i < len(pack):
                part, tokens = self._prefix(pack, i, limit)
                t0 = time.perf_counter()
                code = self._decode(part)
                decode_time += time.perf_counter() - t0
                decodes += 1
                if code == 0:
                    self._collect(part)
                    i += len(part)
                    continue
                if self._closing and code == DecodeCode.ABORTED:
                    closed = EngineClosed("the embedder was closed during the call")
                    for seq in pack[i:]:
                        seq.job.fail(closed)
                    break
                if DecodeCode.of(code).retryable and len(part) > 1:
                    limit = max(1, tokens // 2)  # the floor: one sequence
                    retries += 1
                    logger.info("embed: decode code %d on %d texts (%d tokens); retrying with half", code,
                                len(part), tokens)  # fmt: skip
                    continue
                self.context.clear_abort()
                error = self._failure(code, part, retries)
                for seq in part:
                    seq.job.fail(error)
                failed += len(part)
                i += len(part)
        except BaseException as exc:
            for seq in pack[i:]:
                seq.job.fail(LlamaBatchError(f"embedding failed: {exc!r}"))
            raise
        finally:
            self._account(pack, waits, decodes, decode_time, retries, failed, time.perf_counter() - t_start)

    @staticmethod
    def _prefix(pack: list[_Seq], start: int, limit: int) -> tuple[list[_Seq], int]:
        """The sequences from ``start`` that fit in ``limit`` tokens (always at least one)."""
        part = [pack[start]]
        tokens = pack[start].n
        for seq in pack[start + 1 :]:
            if tokens + seq.n > limit:
                break
            part.append(seq)
            tokens += seq.n
        return part, tokens

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
                    seq.job.put(seq.index, rows)
            return
        for seq_id, seq in enumerate(part):
            if seq.job.done:
                continue
            vector = context.embeddings_seq(seq_id, self.n_out)
            if vector is None:  # pragma: no cover - the context was created with pooling
                seq.job.fail(DecodeError(0, f"llama.cpp returned no pooled embedding for seq {seq_id}"))
                continue
            seq.job.put(seq.index, vector)

    def _failure(self, code: int, part: list[_Seq], retries: int) -> DecodeError:
        """The error for the texts of ``part`` that could not be decoded."""
        context = self.context
        if DecodeCode.of(code).retryable:
            seq = part[0]  # retried down to this single sequence
            if code == DecodeCode.NO_KV_SLOT:
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
        base = decode_error(code, "llama_encode" if not context.has_memory else "llama_decode")
        return DecodeError(code, f"{base} while embedding texts {indices} ({len(part)} in the pack)")

    def _account(
        self,
        pack: list[_Seq],
        waits: list[float],
        decodes: int,
        decode_time: float,
        retries: int,
        failed: int,
        pack_time: float,
    ) -> None:
        self._n_packs += 1
        tokens = sum(seq.n for seq in pack)
        wait_max = max(waits)
        self._queue_wait_max = max(self._queue_wait_max, wait_max)
        done = len(pack) - failed
        self.telemetry.add(
            packs=1,
            decodes=decodes,
            sequences=done,
            tokens=tokens,
            capacity=self.capacity,
            queue_wait=sum(waits),
            decode_time=decode_time,
            pack_time=pack_time,
            retries=retries,
            failed=failed,
        )
        if self.telemetry.has_listeners:
            self.telemetry.emit(
                EmbedPackEvent(
                    pack=self._n_packs,
                    sequences=len(pack),
                    tokens=tokens,
                    capacity=self.capacity,
                    utilisation=tokens / self.capacity,
                    queue_wait=sum(waits) / len(waits),
                    decode_time=decode_time,
                    retries=retries,
                    callers=len({id(seq.job) for seq in pack}),
                    decodes=decodes,
                    failed=failed,
                    pending_tokens=self._pending_at_take,
                )
            )
