"""``Embedder``: many texts, from many callers, packed into few ``llama_decode`` calls.

This module is the facade (the caller's side: tokenizing, checking, queueing, waiting,
normalising); ``core.py`` is the worker side and the context sizing, ``jobs.py`` a call's jobs,
``st_compat.py`` sentence-transformers' ``encode``, ``config.py`` the options.

How a call flows:

1. ``embed(texts)`` (any thread), ``encode(sentences)`` or ``await aembed(texts)`` tokenizes
   on the caller's thread (so tokenization runs in parallel and a bad input raises at the
   call), checks every text against the per-text limit (error or truncation), and enqueues
   a job: its sequences go to the back of one FIFO shared by all callers, and their tokens to
   ``pending_tokens``. ``encode`` enqueues one job per ``batch_size`` texts, so the worker
   starts on the first texts while the caller tokenizes the rest.
2. One worker thread (``llamabatch.runtime.worker.Worker``) drives the embedding core
   (``embed/core.py``, ``EmbedCore``), which owns the llama.cpp context. It takes a
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
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, overload

import numpy as np

from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch.embed import st_compat
from llamabatch.embed.config import (
    NORMALIZATIONS,
    POOLINGS,
    EmbedderConfig,
    normalize_mode,
    with_config_signature,
)
from llamabatch.embed.core import EmbedCore, pack_budget
from llamabatch.embed.jobs import (
    Job,
    Matrix,
    ProgressBar,
    Vector,
    as_texts,
    cancel_submitted,
    normalize_rows,
    run_jobs,
    show_progress,
)
from llamabatch.embed.st_compat import PRECISIONS
from llamabatch.errors import EngineClosed, PromptTooLong
from llamabatch.generate.vision import MediaPrompt, is_media_prompt
from llamabatch.prompts.images import ImageLimits
from llamabatch.runtime.facade import ThreadedFacade
from llamabatch.runtime.telemetry import EmbedderStats, Listener, Telemetry

__all__ = ["NORMALIZATIONS", "POOLINGS", "PRECISIONS", "Embedder", "EmbedderConfig", "pack_budget"]

logger = logging.getLogger("llamabatch")


class Embedder(ThreadedFacade):
    """Embeddings from one GGUF model, packing the texts of all callers into shared decodes.

    ``Embedder(path, config=EmbedderConfig(...))`` and ``Embedder(path, n_batch=...)`` are the
    same; keywords given with a config override its fields.

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
        mmproj: an image encoder + projector GGUF for a vision-language model used as an
            embedding model (a decoder): ``embed`` then also takes prompts with images,
            ``{"prompt": text, "multi_modal_data": {"image": ...}}`` (``embed/images.py``),
            each computed alone, up to ``n_ctx_seq`` KV cells. ``allow_remote_images``,
            ``max_image_bytes``, ``max_image_pixels`` and ``max_images_per_request`` bound the
            images as ``LLM``'s do.

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

    @with_config_signature
    def __init__(
        self, model_path: str | os.PathLike[str], *, config: EmbedderConfig | None = None, **options: Any
    ) -> None:
        self.config = EmbedderConfig.from_options(config, **options)
        self.normalize: str = str(self.config.normalize)
        self.truncate: bool = self.config.truncate
        self._core = core = EmbedCore(model_path, self.config)
        worker = self.attach("llamabatch-embedder", core, kind="embedder")
        core.bind(worker.cond, lambda: worker.closed)
        self.model: Model = core.model
        self.context: Context = core.context
        self.pooling: str = core.pooling
        #: the limits on images (``mmproj`` given), else None: this Embedder embeds text only
        self.image_limits: ImageLimits | None = core.media.vision.limits if core.media else None
        self.n_batch, self.n_ubatch, self.n_seq_max, self.n_ctx = (
            core.n_batch, core.n_ubatch, core.n_seq_max, core.n_ctx,
        )  # fmt: skip
        self.capacity: int = core.capacity
        self.pack_seq_max: int = core.pack_seq_max
        self.max_tokens: int = core.max_tokens
        self.n_embd: int = core.n_embd
        self.n_out: int = core.n_out
        self.telemetry: Telemetry = core.telemetry
        self.start()

    def tokenize(self, text: str) -> list[int]:
        """The tokens ``embed`` computes for ``text`` (with the model's special tokens)."""
        with self.worker.using_resources():
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
        one ``(n_embd,)`` vector for a single string. With ``mmproj``, an item may be a
        prompt with images (``{"prompt": text, "multi_modal_data": {"image": ...}}``).

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
            ImageError, ValueError: a prompt's image is refused, or it has images and this
                Embedder no ``mmproj``.
            RuntimeError: called from the worker thread (a listener): it would wait for itself.
        """
        single, items = as_texts(texts)
        mode = self.normalize if normalize is None else normalize_mode(normalize)
        out = self._finish(self._embed_rows(items, len(items), show_progress(show_progress_bar)), mode)
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
        return (await self.aembed_counted(texts, normalize=normalize, show_progress_bar=show_progress_bar))[0]

    async def aembed_counted(
        self,
        texts: str | Iterable[str],
        *,
        normalize: str | bool | None = None,
        show_progress_bar: bool | None = None,
        offload: Callable[..., Awaitable[Any]] | None = None,
    ) -> tuple[Any, int]:
        """``aembed``'s result and the tokens it embedded (every text's, after truncation):
        an API's usage, from the one tokenization the texts get.

        ``offload(fn, *args)`` runs the tokenizing step and returns its result: a server's
        bounded pool (``llamabatch serve`` tokenizes in its prepare pool, which a disconnect
        abandons), so long texts never fill asyncio's default executor; ``None``:
        ``asyncio.to_thread``."""
        single, items = as_texts(texts)
        mode = self.normalize if normalize is None else normalize_mode(normalize)
        out = self._new_rows(len(items))
        bar = ProgressBar(len(items)) if show_progress(show_progress_bar) else None
        run = asyncio.to_thread if offload is None else offload
        try:
            submit = asyncio.ensure_future(run(self._submit, items, 0, out, bar, True))
            try:
                job = await asyncio.shield(submit)
            except asyncio.CancelledError:  # the texts are (being) queued: drop them
                submit.add_done_callback(cancel_submitted)
                raise
            await asyncio.wrap_future(job.future)
        finally:
            if bar is not None:
                bar.close()
        result = self._finish(out, mode)
        return (result[0] if single else result), job.n_tokens

    encode = st_compat.encode

    def encode_rows(self, texts: list[str], batch_size: int, show: bool) -> Any:
        """``encode``'s rows: ``texts`` tokenized and queued ``batch_size`` at a time (the
        worker starts on the first while the rest are tokenized), normalised as this Embedder
        normalises; ``show`` draws a progress bar."""
        return self._finish(self._embed_rows(texts, batch_size, show), self.normalize)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(EmbedPackEvent)`` after every pack (on the worker thread: be quick)."""
        self._core.telemetry.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        self._core.telemetry.remove_listener(listener)

    def stats(self) -> EmbedderStats:
        """Running totals and what is queued: packs, tokens per pack, pack utilisation, queue
        wait, retries, texts/s, ...

        Raises:
            EngineClosed: the embedder is closed.
        """
        return self._core.stats(self.worker)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pooling={self.pooling} capacity={self.capacity}"
        return f"<llamabatch.Embedder {self.model.path.name} {state}>"

    def _new_rows(self, n: int) -> Any:
        """The output of ``n`` texts: zero rows (texts without tokens keep them)."""
        if self.pooling == "none":
            return [np.zeros((0, self.n_embd), dtype=np.float32) for _ in range(n)]
        return np.zeros((n, self.n_out), dtype=np.float32)

    def _embed_rows(self, texts: list[str], chunk: int, show: bool) -> Any:
        """Queue ``texts`` in jobs of ``chunk`` texts, wait for them all; the raw rows."""
        if self.on_worker_thread:
            raise RuntimeError("an Embedder cannot be called from its own worker thread (a listener)")
        if self.worker.closed:
            raise EngineClosed("the embedder is closed")
        return run_jobs(self._submit, texts, chunk, self._new_rows(len(texts)), show)

    def _submit(
        self, texts: list[str], offset: int, out: Any, bar: ProgressBar | None, new_call: bool
    ) -> Job:
        """Tokenize and check ``texts`` (the call's texts from ``offset``) on the caller's
        thread, then enqueue them as one job filling ``out[offset:]``."""
        return self._core.submit(self.worker, self._tokens_of, texts, offset, out, bar, new_call)

    def _tokens_of(self, index: int, text: Any) -> np.ndarray | MediaPrompt:
        if is_media_prompt(text):
            media = self._core.media
            if media is None:
                raise ValueError(f"texts[{index}] has images and this Embedder has no mmproj")
            return media.prompt(index, text, self.context.n_ctx_seq)  # decoded in parts: KV-bound
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] is a {type(text).__name__}, not a str")
        tokens = self.model.tokenize(text)
        n = len(tokens)
        if n > self.max_tokens:
            if not self.truncate:
                error = PromptTooLong(
                    f"text {index} has {n} tokens, more than the {self.max_tokens} one text may have "
                    f"({self._core.limit_reason()}); pass truncate=True to cut it"
                )
                error.index = index  # type: ignore[attr-defined]
                error.n_tokens = n  # type: ignore[attr-defined]
                error.limit = self.max_tokens  # type: ignore[attr-defined]
                raise error
            suffix = self._core.suffix
            if suffix and tokens[-len(suffix) :] == suffix:
                tokens = tokens[: self.max_tokens - len(suffix)] + suffix
            else:
                tokens = tokens[: self.max_tokens]
        return np.asarray(tokens, dtype=np.int32)

    def _finish(self, out: Any, mode: str) -> Any:
        """Normalise a completed call's rows with ``mode`` (on the caller's thread)."""
        if self.pooling == "rank":
            return out[:, 0] if self.n_out == 1 else out
        if self.pooling == "none":
            return [normalize_rows(rows, mode) for rows in out]
        return normalize_rows(out, mode)
