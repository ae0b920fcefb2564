"""The embedding core: the worker side of an ``Embedder`` (see ``embedder.py`` for a call's
whole flow).

``EmbedCore`` owns the model, the context (sized here so that llama.cpp's own checks cannot
abort the process), the one preallocated batch and the FIFO of tokenized sequences shared by
all callers. On the worker thread it takes a *pack* from the front of the queue, decodes it
(halving on memory exhaustion, ``runtime``'s ``halve_and_retry``), routes each pooled vector to
its caller's row and keeps the counters. It is the task a ``Worker`` thread drives
(``has_work`` / ``run_once`` / ``fail_pending`` / ``on_close`` / ``interrupt``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from llamabatch._core.batch import BatchPool
from llamabatch._ffi.context import Context, DecodeCode
from llamabatch._ffi.model import Model
from llamabatch.embed.config import POOLINGS, EmbedderConfig, round_up
from llamabatch.embed.images import MediaEmbedder
from llamabatch.embed.jobs import Job, ProgressBar, Seq
from llamabatch.errors import DecodeError, KVCacheFull
from llamabatch.generate.vision import MediaPrompt, vision_stats
from llamabatch.runtime.telemetry import EmbedderCounters, EmbedderStats, EmbedPackEvent, Telemetry
from llamabatch.runtime.worker import RetryOutcome, Worker, halve_and_retry

__all__ = ["WHOLE_UBATCH_POOLINGS", "EmbedCore", "pack_budget"]

logger = logging.getLogger("llamabatch")

#: Poolings whose result is wrong if a sequence is split across ubatches.
WHOLE_UBATCH_POOLINGS = ("mean", "cls", "rank")


def pack_budget(pending_tokens: int, capacity: int) -> int:
    """Tokens the next pack may hold (seed 000, "intelligent batch sizing").

    Under light load (``pending_tokens < capacity``) the pack is sized to the pending work;
    under heavy load it is a full ``capacity``. The context's memory is cleared per pack, so
    there is never an in-flight pack to leave room for.
    """
    return max(0, min(pending_tokens, capacity))


class PackDecode:
    """The decodes of one pack: which part was tried last, and the counts for telemetry."""

    __slots__ = ("core", "decode_time", "decodes", "pack", "part", "start")

    def __init__(self, core: EmbedCore, pack: list[Seq]) -> None:
        self.core = core
        self.pack = pack
        self.start = 0  # the first sequence not done yet
        self.part: list[Seq] = []
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
        code = self.core.decode(part)
        self.decode_time += time.perf_counter() - t0
        self.decodes += 1
        return code, tokens


class EmbedCore:
    """The model, the context, the queue and the pack/decode/collect loop of one embedder.

    Made on the caller's thread by ``Embedder``; from then on ``queue``, ``pending_tokens``
    and ``counters`` are shared under ``cond`` (the worker's condition, set by ``bind``), and
    the context is used by the worker thread only.
    """

    def __init__(self, model_path: str | os.PathLike[str], config: EmbedderConfig) -> None:
        self.cond: threading.Condition = threading.Condition()  # the worker's, once bound
        self.closing: Callable[[], bool] = lambda: False  # the worker's ``closed``, once bound
        self.queue: deque[Seq] = deque()
        self.pack: list[Seq] = []  # the pack being decoded (ended by fail_pending on a crash)
        self.batch: Any = None
        self.pending_tokens = 0
        self.pending_at_take = 0
        self.counters = EmbedderCounters()  # the worker thread's, written under cond
        self.n_calls = 0  # calls and texts are counted by the callers, under cond
        self.n_texts = 0
        c = config
        n_batch, n_ubatch, n_seq_max, n_ctx = c.n_batch, c.n_ubatch, c.n_seq_max, c.n_ctx
        self.model = Model(
            model_path, n_gpu_layers=c.n_gpu_layers, load_mode=c.load_mode, validate=c.validate
        )
        try:
            declared = self.model.pooling_type
            self.pooling: str = c.pooling or (declared if declared in POOLINGS else "mean")
            if self.pooling == "rank" and not self.model.has_classifier_head:
                raise ValueError(
                    f"pooling='rank' needs a classification head (tensor cls.weight or cls.output.weight), "
                    f"and {self.model.path.name} has none: it is not a reranker; use pooling 'mean', "
                    "'cls' or 'last' for embeddings"
                )
            self.context = self.make_context(
                n_batch, n_batch if n_ubatch is None else n_ubatch, n_seq_max, n_ctx,
                n_threads=c.n_threads, flash_attn=c.flash_attn, kv_unified=c.kv_unified,
            )  # fmt: skip
            ctx = self.context
            self.n_batch: int = n_batch
            self.n_ubatch: int = n_batch if not ctx.has_memory else min(n_ubatch or n_batch, ctx.n_ubatch)
            self.n_seq_max: int = n_seq_max
            self.n_ctx: int = ctx.n_ctx
            #: the most tokens in one pack
            self.capacity: int = min(n_batch, ctx.n_batch)
            if not ctx.has_memory or self.pooling in WHOLE_UBATCH_POOLINGS:
                self.capacity = min(self.capacity, self.n_ubatch, ctx.n_ubatch)
            #: the most sequences in one pack
            self.pack_seq_max: int = n_seq_max
            if ctx.has_memory and not ctx.kv_unified and self.pooling in WHOLE_UBATCH_POOLINGS:
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
            self.suffix = self.special_suffix()
            self.telemetry = Telemetry()
            self.pool = BatchPool(self.capacity, 1)
            self.batch = self.pool.acquire()
            self.forward = ctx.decode_address if ctx.has_memory else ctx.encode_address
            #: prompts with images (``mmproj``): tokenized by the callers, embedded one at a time
            self.media: MediaEmbedder | None = None
            if c.mmproj is not None:
                self.media = MediaEmbedder(
                    self.model, c, ctx, self.pooling, min(self.capacity, self.n_ubatch, ctx.n_ubatch)
                )
        except BaseException:
            self.on_close()  # frees what was made
            raise
        logger.info(
            "Embedder %s: pooling=%s capacity=%d tokens/pack, n_seq_max=%d, n_batch=%d, n_ubatch=%d, "
            "n_ctx=%d, kv memory=%s, max %d tokens/text",
            self.model.path.name, self.pooling, self.capacity, n_seq_max, ctx.n_batch, ctx.n_ubatch,
            ctx.n_ctx, ctx.has_memory, self.max_tokens,
        )  # fmt: skip

    def bind(self, cond: threading.Condition, closing: Callable[[], bool]) -> None:
        """Share the worker's condition and its ``closed`` flag (before the thread starts)."""
        self.cond = cond
        self.closing = closing

    # -- sizing ---------------------------------------------------------------------------

    def make_context(
        self, n_batch: int, n_ubatch: int, n_seq_max: int, n_ctx: int | None, **kwargs: Any
    ) -> Context:
        """The context, sized so that llama.cpp's own checks cannot abort the process."""

        def make(ubatch: int, ctx_size: int) -> Context:
            try:
                # Multiples of n_seq_max: llama.cpp's mean-pooling graph reservation asserts it.
                return Context(
                    self.model,
                    n_ctx=round_up(ctx_size, n_seq_max),
                    n_batch=round_up(n_batch, n_seq_max),
                    n_ubatch=round_up(ubatch, n_seq_max),
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

    def special_suffix(self) -> list[int]:
        """The special tokens the tokenizer appends (BERT: ``[SEP]``), kept when truncating."""
        plain = self.model.tokenize("a", add_special=False)
        full = self.model.tokenize("a", add_special=True)
        for start in range(len(full) - len(plain) + 1):
            if plain and full[start : start + len(plain)] == plain:
                return full[start + len(plain) :]
        return []

    # -- the callers' side of the queue ---------------------------------------------------

    def enqueue(self, seqs: list[Seq], n_texts: int, new_call: bool) -> None:
        """Queue one job's sequences (caller holds ``cond`` and checked the worker is open)."""
        self.queue.extend(seqs)
        self.pending_tokens += sum(s.n for s in seqs)
        self.n_calls += new_call
        self.n_texts += n_texts
        self.cond.notify()

    def submit(
        self,
        worker: Worker,
        tokens_of: Callable[[int, Any], np.ndarray | MediaPrompt],
        items: list[Any],
        offset: int,
        out: Any,
        bar: ProgressBar | None,
        new_call: bool,
    ) -> Job:
        """Tokenize and check ``items`` (a call's items from ``offset``) on the caller's thread
        with ``tokens_of(index, item)`` (a prompt with images gives its ``MediaPrompt``), then
        enqueue them as one job filling ``out[offset:]``."""
        with worker.using_resources():  # EngineClosed once closing; close() waits for it
            made = [tokens_of(offset + i, item) for i, item in enumerate(items)]
        seqs: list[Seq] = []
        job = Job(out, 0, bar)
        tokens = [np.asarray(t.tokens, dtype=np.int32) if isinstance(t, MediaPrompt) else t for t in made]
        job.n_tokens = sum(t.shape[0] for t in tokens)
        for i, t in enumerate(tokens):
            if t.shape[0]:
                media = made[i] if isinstance(made[i], MediaPrompt) else None
                seqs.append(Seq(job, offset + i, t, media))
            else:  # no token at all: the zero row stands
                job.n_done += 1
        job.remaining = len(seqs)
        if not seqs:
            job.deliver()
            return job
        with worker.cond:
            worker.raise_if_closed()
            self.enqueue(seqs, len(items), new_call)
        return job

    def stats(self, worker: Worker) -> EmbedderStats:
        """Running totals and what is queued (``Embedder.stats``); ``EngineClosed`` once closed."""
        with worker.cond:
            worker.raise_if_closed()
            c = replace(self.counters)
            calls, texts = self.n_calls, self.n_texts
            pending_tokens, queue_depth = self.pending_tokens, len(self.queue)
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
            **vision_stats(self.media.vision if self.media else None),
        )

    def limit_reason(self) -> str:
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

    # -- worker thread (the Worker's task) ------------------------------------------------

    def has_work(self) -> bool:
        """Whether texts wait in the queue (``cond`` held)."""
        return bool(self.queue)

    def run_once(self) -> None:
        """Take one pack and decode it (the worker thread)."""
        with self.cond:
            pack = self.take_pack()
        if pack:
            self.pack = pack  # what fail_pending ends if the worker stops in the middle
            self.process(pack)

    def interrupt(self) -> None:
        """Make a running decode end early (``Context.abort``); safe from any thread."""
        context = getattr(self, "context", None)
        if context is not None:
            context.abort()  # an in-flight decode returns 2 at its next graph node

    def fail_pending(self, error: BaseException) -> None:
        """End every queued text and the pack in flight with ``error`` (exactly once each)."""
        with self.cond:
            rest = list(self.queue)
            self.queue.clear()
            self.pending_tokens = 0
        for seq in [*self.pack, *rest]:
            seq.job.fail(error)
        self.pack = []

    def on_close(self) -> None:
        """Free the batch, the context and the model (after ``fail_pending``)."""
        if getattr(self, "batch", None) is not None:
            self.pool.release(self.batch)
            self.batch = None
        if getattr(self, "context", None) is not None:
            self.context.close()
        if getattr(self, "model", None) is not None:
            self.model.close()

    def take_pack(self) -> list[Seq]:
        """Whole sequences from the front of the queue (caller holds ``cond``)."""
        budget = pack_budget(self.pending_tokens, self.capacity)
        queue = self.queue
        pack: list[Seq] = []
        tokens = 0
        while queue and len(pack) < self.pack_seq_max:
            seq = queue[0]
            if seq.job.done:  # its call failed or was cancelled: drop the rest of it
                queue.popleft()
                self.pending_tokens -= seq.n
                continue
            if seq.media is not None and pack:
                break  # computed alone, in decodes of its own (embed/images.py)
            if seq.media is None and tokens + seq.n > budget:
                break
            queue.popleft()
            pack.append(seq)
            tokens += seq.n
            if seq.media is not None:
                break
        self.pending_tokens -= tokens
        self.pending_at_take = self.pending_tokens
        return pack

    def process(self, pack: list[Seq]) -> None:
        """Decode ``pack``, retrying in halves on memory exhaustion; deliver every result."""
        t_start = time.perf_counter()
        waits = [t_start - seq.job.t_submit for seq in pack]
        run = PackDecode(self, pack)
        if pack[0].media is not None:
            failed = self.process_media(pack[0], run)
            self.account(pack, waits, run, 0, failed, time.perf_counter() - t_start)
            return
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
                    self.collect(part)
                elif outcome.code is DecodeCode.ABORTED and self.closing():
                    self.pack = pack[run.start :]  # closing: these end with EngineClosed (fail_pending)
                    return
                else:
                    self.context.clear_abort()
                    error = self.failure(outcome, part, retries)
                    for seq in part:
                        seq.job.fail(error)
                    failed += len(part)
                run.start += len(part)
            self.pack = []
        finally:
            self.account(pack, waits, run, retries, failed, time.perf_counter() - t_start)

    def process_media(self, seq: Seq, run: PackDecode) -> int:
        """Embed the prompt with images ``seq`` alone (a pack of its own); 1 when it failed."""
        assert self.media is not None
        t0 = time.perf_counter()
        try:
            vector, run.decodes = self.media.embed(self.context, self.batch, seq.media, self.n_out)
        except Exception as exc:
            if self.closing():
                return 0  # still in self.pack: fail_pending ends it with EngineClosed
            self.context.clear_abort()
            self.pack = []
            seq.job.fail(exc)
            return 1
        finally:
            run.decode_time = time.perf_counter() - t0
        self.pack = []
        if not seq.job.done:
            seq.job.store(seq.index, vector)
            seq.job.deliver()
        return 0

    def decode(self, part: list[Seq]) -> int:
        """Write ``part`` into the batch (sequence ``k`` as ``seq_id`` k, every token an output) and
        decode it once; the raw return code."""
        batch = self.batch
        batch.clear()
        for seq_id, seq in enumerate(part):
            batch.add_sequence(seq.tokens, seq_id, 0, True)
        if self.context.has_memory:
            self.context.memory_clear(False)
        return self.forward(batch.address)

    def collect(self, part: list[Seq]) -> None:
        """Route each decoded sequence's vector (or token rows) to its job, and deliver the jobs."""
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

    def failure(self, outcome: RetryOutcome, part: list[Seq], retries: int) -> DecodeError:
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

    def account(
        self,
        pack: list[Seq],
        waits: list[float],
        run: PackDecode,
        retries: int,
        failed: int,
        pack_time: float,
    ) -> None:
        """Add one pack to the counters (under ``cond``) and tell the listeners."""
        tokens = sum(seq.n for seq in pack)
        with self.cond:  # stats() copies the counters under the lock: a consistent set
            c = self.counters
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
                    pending_tokens=self.pending_at_take,
                )
            )
