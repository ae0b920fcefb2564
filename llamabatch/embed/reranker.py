"""``Reranker``: a cross-encoder scoring (query, document) pairs, on the embedding core.

The pairs of all callers are packed into shared ``llama_encode`` calls exactly as
:class:`~llamabatch.Embedder` packs texts (one FIFO, token-budget packs, halving on memory
exhaustion, one worker thread owning the context): ``Reranker`` drives the embedding core
(``EmbedCore``, with rank pooling) on its own worker thread, and its inputs are pairs. Two
things differ from an embedding:

- each pair is built as the model's own tokenizer builds it (``[CLS] q [SEP] d [SEP]`` for
  BERT), with Hugging Face's ``longest_first`` truncation (:mod:`llamabatch.embed.reranker_inputs`);
- the document segment gets its own token type: the packs carry input vectors
  (``llama_batch.embd``) instead of token ids, because llama.cpp's BERT graph adds only the
  first token-type row. The scores are then transformers' ``AutoModelForSequenceClassification``
  logits (checked to 1e-3 by the tests), not llama-server's.

The API follows sentence-transformers' ``CrossEncoder``: ``predict(pairs)`` and
``rank(query, documents)``, with its activation rule.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from llamabatch._ffi.embd_batch import EmbdBatch
from llamabatch.embed.config import EmbedderConfig
from llamabatch.embed.core import EmbedCore
from llamabatch.embed.jobs import Job, ProgressBar, run_jobs, show_progress
from llamabatch.embed.reranker_inputs import InputTable, truncate_pair
from llamabatch.errors import EngineClosed, PromptTooLong
from llamabatch.gguf.convert_head import ACTIVATION_KEY
from llamabatch.gguf.reader import tensor_names
from llamabatch.runtime.facade import ThreadedFacade
from llamabatch.runtime.telemetry import EmbedderStats, Listener
from llamabatch.validate import check_positive_int

__all__ = ["ACTIVATIONS", "Reranker"]

#: Activations by name (``activation_fn=``); a callable on a numpy array works too.
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "identity": lambda x: x,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "tanh": np.tanh,
    "softmax": lambda x: _softmax(x),
}

#: an activation: a name of ``ACTIVATIONS``, a callable, or None (the default)
Activation = str | Callable[[np.ndarray], np.ndarray] | None


def _cancel_job(submit: asyncio.Future[Any]) -> None:
    if not submit.cancelled() and submit.exception() is None:
        submit.result().future.cancel()


def _softmax(x: np.ndarray) -> np.ndarray:
    if x.ndim < 2:
        return x
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class _PairCore(EmbedCore):
    """The embedding core of a reranker: its sequences are ``(n, 2)`` int32 arrays (token id,
    token type), decoded from input vectors (the token-embedding rows plus the type row)."""

    def __init__(self, model_path: str | os.PathLike[str], config: EmbedderConfig) -> None:
        EmbedCore.__init__(self, model_path, config)
        try:
            self.table = InputTable(self.model.path)
            if self.table.n_embd != self.n_embd:
                raise ValueError(
                    f"token_embd.weight rows have {self.table.n_embd} values, the model {self.n_embd}"
                )
            self.embd_batch = EmbdBatch(self.capacity, self.n_embd)
        except BaseException:
            self.on_close()
            raise

    def decode(self, part: list[Any]) -> int:
        """Decode ``part`` from input vectors: each pair's token rows plus its type rows."""
        batch = self.embd_batch
        batch.clear()
        for seq_id, seq in enumerate(part):
            batch.add(self.table.vectors(seq.tokens[:, 0], seq.tokens[:, 1]), seq_id)
        if self.context.has_memory:
            self.context.memory_clear(False)
        return self.forward(batch.address)


class _PairTokens:
    """(query, document) pairs as the model's tokenizer builds them: ``(n, 2)`` int32 arrays of
    token id and token type, at most ``max_length`` rows (truncated when ``truncate_pairs``)."""

    def __init__(self, core: _PairCore) -> None:
        self.model = core.model
        #: the token-embedding and token-type rows the pairs are decoded from
        self.table = core.table
        self.truncate_pairs = True
        self.max_length = core.max_tokens
        self._prefix, self._mid, self._suffix_ids = self._pair_layout()

    def _pair_layout(self) -> tuple[list[int], list[int], list[int]]:
        """The special tokens around and between the two segments, as the tokenizer puts them."""
        plain = self.model.tokenize("a", add_special=False)
        full = self.model.tokenize("a", add_special=True)
        n = len(plain)
        for start in range(len(full) - n + 1):
            if full[start : start + n] == plain:
                prefix, suffix = full[:start], full[start + n :]
                break
        else:  # pragma: no cover - a tokenizer that changes the text when adding specials
            raise ValueError(f"{self.model.path.name}: cannot tell the tokenizer's special tokens apart")
        if self.meta_tokenizer() == "bert" or not suffix:
            return prefix, suffix, suffix  # [CLS] q [SEP] d [SEP]
        return prefix, suffix + suffix, suffix  # <s> q </s></s> d </s>

    def meta_tokenizer(self) -> str:
        return self.model.meta("tokenizer.ggml.model") or ""

    def pair_tokens(self, index: int, pair: Any) -> np.ndarray:
        """The ``(n, 2)`` ids and types of pair ``index`` (truncated or refused when too long);
        an array (from ``Reranker.tokenize_pairs``) is checked and taken as it is."""
        if isinstance(pair, np.ndarray):
            return self._checked_pair(index, pair)
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"pairs[{index}] must be a (query, document) pair of strings, got {pair!r:.80}")
        query, document = pair
        if not isinstance(query, str) or not isinstance(document, str):
            raise TypeError(
                f"pairs[{index}] must hold two strings, "
                f"got ({type(query).__name__}, {type(document).__name__})"
            )
        return self.join_pair(index, self.segment_tokens(query), document)

    def segment_tokens(self, text: str) -> list[int]:
        """One segment's token ids (no special tokens)."""
        return self.model.tokenize(text, add_special=False) if text else []

    def _checked_pair(self, index: int, pair: np.ndarray) -> np.ndarray:
        if (
            pair.ndim != 2
            or pair.shape[1] != 2
            or pair.dtype.kind not in "iu"
            or not 0 < len(pair) <= self.max_length
        ):
            raise ValueError(
                f"pairs[{index}] must be an (n, 2) int array of token ids and types with 1 to "
                f"{self.max_length} rows (as tokenize_pairs makes them)"
            )
        ids, types = pair[:, 0], pair[:, 1]
        if (
            ids.min() < 0
            or ids.max() >= self.table.n_vocab
            or types.min() < 0
            or types.max() >= self.table.n_types
        ):
            raise ValueError(f"pairs[{index}] holds a token id or type out of range")
        return np.ascontiguousarray(pair, dtype=np.int32)

    def join_pair(self, index: int, q: list[int], document: str) -> np.ndarray:
        """Pair ``index`` from its query's token ids ``q`` and its document's text."""
        d = self.segment_tokens(document)
        # an empty document is still a second segment, as CrossEncoder's batched tokenizer call
        # makes it ([CLS] q [SEP] [SEP]); a lone tokenizer(q, "") would drop it
        n_special = len(self._prefix) + len(self._mid) + len(self._suffix_ids)
        total = n_special + len(q) + len(d)
        if total > self.max_length:
            if not self.truncate_pairs:
                error = PromptTooLong(
                    f"pair {index} has {total} tokens, more than the {self.max_length} one pair may have; "
                    "pass truncate=True to cut it (longest segment first)"
                )
                error.index = index  # type: ignore[attr-defined]
                error.n_tokens = total  # type: ignore[attr-defined]
                error.limit = self.max_length  # type: ignore[attr-defined]
                raise error
            nq, nd = truncate_pair(len(q), len(d), max(self.max_length - n_special, 0))
            q, d = q[:nq], d[:nd]
        first = self._prefix + q + self._mid
        second = d + self._suffix_ids
        out = np.zeros((len(first) + len(second), 2), dtype=np.int32)
        out[:, 0] = first + second
        if self.table.n_types > 1:
            out[len(first) :, 1] = 1
        return out


class Reranker(ThreadedFacade):
    """A cross-encoder reranker from one GGUF (e.g. made by ``llamabatch convert`` from a
    ``BertForSequenceClassification`` / sentence-transformers ``CrossEncoder`` directory).

    Args:
        model_path: the ``.gguf`` file; it must hold a classification head (tensors ``cls``
            and ``cls.output``), or ``ValueError`` says it is not a reranker.
        max_length: the most tokens of one pair, special tokens included (default and upper
            bound: the model's ``n_ctx_train`` and ``n_batch``), as ``CrossEncoder``'s.
        truncate: cut over-long pairs, longest segment first, as Hugging Face's tokenizers and
            ``CrossEncoder`` do (default); ``False`` raises ``PromptTooLong`` instead.
        activation_fn: applied to the logits: ``"sigmoid"``, ``"identity"``, ``"tanh"``,
            ``"softmax"`` or a callable on a numpy array. Default, as sentence-transformers':
            the activation the converted model recorded (its ``config.json``), else sigmoid for
            a one-label model and identity for more.
        n_batch, n_seq_max, n_threads, flash_attn, n_gpu_layers, load_mode, validate: as
            :class:`~llamabatch.Embedder` (packing capacity in tokens, pairs per pack, ...).

    Thread-safe: ``predict`` / ``rank`` from many threads (and ``apredict`` / ``arank`` from
    asyncio) share the packs.

    Raises:
        ValueError: a bad parameter, or a model without a classification head.
        FileNotFoundError, ModelLoadError, ContextError: as ``Embedder``.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        max_length: int | None = None,
        truncate: bool = True,
        activation_fn: Activation = None,
        n_batch: int = 512,
        n_seq_max: int = 64,
        n_threads: int | None = None,
        flash_attn: bool | str | None = "auto",
        n_gpu_layers: int = 0,
        load_mode: str = "mmap",
        validate: bool = True,
    ) -> None:
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate must be True or False, got {truncate!r}")
        check_positive_int("max_length", max_length, allow_none=True)
        self._check_activation(activation_fn)
        names = set(tensor_names(model_path))
        if "cls.weight" not in names:
            head = "only cls.output (no pooler, cls)" if "cls.output.weight" in names else "none"
            raise ValueError(
                f"{os.fspath(model_path)!r} is not a reranker: rank pooling needs a classification head "
                f"(tensors cls and cls.output), and its head is {head}; convert a cross-encoder "
                "(BertForSequenceClassification) with `llamabatch convert`, or use Embedder for embeddings"
            )
        config = EmbedderConfig.from_options(
            pooling="rank",
            normalize="none",
            truncate=False,
            n_batch=n_batch,
            n_seq_max=n_seq_max,
            n_threads=n_threads,
            flash_attn=flash_attn,
            n_gpu_layers=n_gpu_layers,
            load_mode=load_mode,
            validate=validate,
        )
        self._core = core = _PairCore(model_path, config)
        worker = self.attach("llamabatch-embedder", core, kind="reranker")
        core.bind(worker.cond, lambda: worker.closed)
        try:
            self._pairs = pairs = _PairTokens(core)
            if max_length is not None and max_length > core.max_tokens:
                raise ValueError(
                    f"max_length ({max_length}) exceeds the {core.max_tokens} tokens one pair may have "
                    f"here (the model's n_ctx_train {core.model.n_ctx_train}, n_batch {n_batch})"
                )
        except BaseException:
            self.close()
            raise
        if max_length is not None:
            pairs.max_length = max_length
        pairs.truncate_pairs = truncate
        self.model = core.model
        #: outputs of the head (CrossEncoder's ``num_labels``)
        self.num_labels: int = core.n_out
        self.max_length: int = pairs.max_length
        self.truncate = truncate
        recorded = self.model.meta(ACTIVATION_KEY)
        default = recorded if recorded in ACTIVATIONS else ("sigmoid" if self.num_labels == 1 else "identity")
        #: the activation ``predict`` applies unless told otherwise
        self.activation_fn: str | Callable[[np.ndarray], np.ndarray] = (
            activation_fn if activation_fn is not None else default
        )
        self.start()

    @staticmethod
    def _check_activation(activation_fn: Activation) -> None:
        if activation_fn is None or callable(activation_fn):
            return
        if not isinstance(activation_fn, str) or activation_fn not in ACTIVATIONS:
            raise ValueError(
                f"activation_fn must be one of {sorted(ACTIVATIONS)} or a callable, got {activation_fn!r}"
            )

    def _activate(self, logits: np.ndarray, activation_fn: Activation, apply_softmax: bool) -> np.ndarray:
        self._check_activation(activation_fn)
        fn = self.activation_fn if activation_fn is None else activation_fn
        scores = ACTIVATIONS[fn](logits) if isinstance(fn, str) else fn(logits)
        scores = np.asarray(scores, dtype=np.float32)
        if apply_softmax and scores.ndim == 2:
            scores = _softmax(scores).astype(np.float32)
        return scores

    # -- scoring --------------------------------------------------------------------------

    @staticmethod
    def _as_pairs(sentences: Any) -> tuple[bool, list[Any]]:
        if isinstance(sentences, (str, bytes)):
            raise TypeError("predict takes (query, document) pairs, not a string")
        if (
            isinstance(sentences, tuple)
            and len(sentences) == 2
            and all(isinstance(s, str) for s in sentences)
        ):
            return True, [sentences]
        try:
            items = list(sentences)
        except TypeError:
            raise TypeError(
                f"pairs must be a sequence of (query, document), got {type(sentences).__name__}"
            ) from None
        if len(items) == 2 and all(isinstance(s, str) for s in items):
            return True, [tuple(items)]  # CrossEncoder takes one pair as a 2-list too
        return False, items

    def _logits(self, pairs: list[Any], chunk: int, show: bool) -> np.ndarray:
        """Queue ``pairs`` in jobs of ``chunk``, wait for them all: ``(n, num_labels)`` logits."""
        if self.on_worker_thread:
            raise RuntimeError("a Reranker cannot be called from its own worker thread (a listener)")
        if self.closed:
            raise EngineClosed("the reranker is closed")
        out = np.zeros((len(pairs), self.num_labels), dtype=np.float32)
        return run_jobs(self._submit, pairs, chunk, out, show, desc="Reranking", unit="pair")

    def _submit(
        self, pairs: list[Any], offset: int, out: Any, bar: ProgressBar | None, new_call: bool
    ) -> Job:
        """Tokenize and check ``pairs`` (a call's pairs from ``offset``) on the caller's thread,
        then enqueue them as one job filling ``out[offset:]``."""
        return self._core.submit(self.worker, self._pairs.pair_tokens, pairs, offset, out, bar, new_call)

    def _shape(self, logits: np.ndarray, single: bool, activation_fn: Activation, apply_softmax: bool) -> Any:
        scores = self._activate(logits, activation_fn, apply_softmax)
        if self.num_labels == 1:
            scores = scores[:, 0]
        return scores[0] if single else scores

    def predict(
        self,
        sentences: tuple[str, str]
        | Sequence[tuple[str, str]]
        | Iterable[Sequence[str]]
        | Sequence[np.ndarray],
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Activation = None,
        apply_softmax: bool = False,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
    ) -> Any:
        """Score (query, document) pairs: float32 ``(n,)`` (``(n, num_labels)`` for a
        multi-label head) in input order, or one score for a single pair (``CrossEncoder.predict``).

        Args:
            sentences: pairs of strings (tuples or 2-lists), or one pair, or the arrays of
                ``tokenize_pairs``.
            batch_size: pairs tokenized and queued at a time (> 0); any value gives the same
                scores: the worker packs by tokens.
            show_progress_bar: a tqdm bar on stderr advancing per pair (default: when the
                ``llamabatch`` logger is at INFO or DEBUG).
            activation_fn: this call's activation (default: the Reranker's).
            apply_softmax: softmax over the labels of a multi-label head (after the activation).
            convert_to_numpy, convert_to_tensor: torch output (needs torch), as CrossEncoder.

        Raises:
            TypeError: not pairs of strings (the message names the index).
            PromptTooLong: an over-long pair with ``truncate=False``.
            EngineClosed, DecodeError: as ``Embedder.embed``.
        """
        check_positive_int("batch_size", batch_size)
        single, pairs = self._as_pairs(sentences)
        logits = self._logits(pairs, batch_size, show_progress(show_progress_bar))
        scores = self._shape(logits, single, activation_fn, apply_softmax)
        if convert_to_tensor or not convert_to_numpy:
            try:
                import torch
            except ImportError:
                raise ImportError("convert_to_tensor / convert_to_numpy=False need torch") from None
            tensor = torch.as_tensor(np.asarray(scores))
            return tensor if convert_to_tensor or single else list(tensor)
        return scores

    async def apredict(
        self,
        sentences: tuple[str, str] | Sequence[tuple[str, str]] | Sequence[np.ndarray],
        *,
        activation_fn: Activation = None,
        apply_softmax: bool = False,
    ) -> Any:
        """``predict`` for asyncio: the pairs are tokenized in a worker thread (not on the loop)
        and join the shared packs. Cancelling the awaiting task drops the pairs not packed yet."""
        single, pairs = self._as_pairs(sentences)
        out = np.zeros((len(pairs), self.num_labels), dtype=np.float32)
        submit = asyncio.ensure_future(asyncio.to_thread(self._submit, pairs, 0, out, None, True))
        try:
            job = await asyncio.shield(submit)
        except asyncio.CancelledError:  # the pairs are still being tokenized: drop them once queued
            submit.add_done_callback(_cancel_job)
            raise
        try:
            await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.future.cancel()
            raise
        return self._shape(out, single, activation_fn, apply_softmax)

    def _ranked(
        self, scores: np.ndarray, documents: list[str], top_k: int | None, return_documents: bool
    ) -> list[dict[str, Any]]:
        order = sorted(range(len(documents)), key=lambda i: float(scores[i]), reverse=True)
        if top_k is not None:
            order = order[:top_k]
        results: list[dict[str, Any]] = []
        for i in order:
            item: dict[str, Any] = {"corpus_id": i, "score": float(scores[i])}
            if return_documents:
                item["text"] = documents[i]
            results.append(item)
        return results

    def _rank_pairs(self, query: Any, documents: Any, top_k: int | None) -> tuple[list[str], list[Any]]:
        if self.num_labels != 1:
            raise ValueError(f"rank needs a one-label reranker; this head has {self.num_labels} labels")
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        if isinstance(documents, (str, bytes)):
            raise TypeError("documents must be a sequence of strings, not a single string")
        docs = list(documents)
        check_positive_int("top_k", top_k, allow_none=True)
        return docs, self.tokenize_pairs(query, docs)

    def rank(
        self,
        query: str,
        documents: Sequence[str],
        top_k: int | None = None,
        return_documents: bool = False,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Activation = None,
    ) -> list[dict[str, Any]]:
        """Score ``documents`` against ``query`` and sort them, best first (``CrossEncoder.rank``):
        ``[{"corpus_id": i, "score": s, "text": doc?}, ...]``, at most ``top_k`` of them; equal
        scores keep the documents' order."""
        docs, pairs = self._rank_pairs(query, documents, top_k)
        scores = self.predict(
            pairs, batch_size=batch_size, show_progress_bar=show_progress_bar, activation_fn=activation_fn
        )  # an empty list of documents gives an empty array
        return self._ranked(np.atleast_1d(scores), docs, top_k, return_documents)

    async def arank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_k: int | None = None,
        return_documents: bool = False,
        activation_fn: Activation = None,
    ) -> list[dict[str, Any]]:
        """``rank`` for asyncio."""
        docs, pairs = await asyncio.to_thread(self._rank_pairs, query, documents, top_k)
        if not pairs:
            return []
        scores = await self.apredict(pairs, activation_fn=activation_fn)
        return self._ranked(np.atleast_1d(scores), docs, top_k, return_documents)

    # -- the rest -------------------------------------------------------------------------

    def tokenize_pairs(
        self, query: str, documents: Sequence[str], *, max_query_tokens: int | None = None
    ) -> list[np.ndarray]:
        """Each ``(query, document)`` pair as ``predict`` builds it, an ``(n, 2)`` int32 array
        of token ids and token types; the query is tokenized once. ``predict`` / ``apredict``
        take these arrays in place of string pairs.

        Raises:
            PromptTooLong: the query has more than ``max_query_tokens`` tokens (its ``param``
                is ``"query"``), or a pair is too long with ``truncate=False``.
            TypeError: not strings.
        """
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        check_positive_int("max_query_tokens", max_query_tokens, allow_none=True)
        tokens = self._pairs
        with self.using_resources():
            q = tokens.segment_tokens(query)
            if max_query_tokens is not None and len(q) > max_query_tokens:
                error = PromptTooLong(
                    f"the query has {len(q)} tokens, more than the {max_query_tokens} it may have"
                )
                error.param = "query"  # type: ignore[attr-defined]
                raise error
            pairs = []
            for i, document in enumerate(documents):
                if not isinstance(document, str):
                    raise TypeError(f"documents[{i}] must be a str, got {type(document).__name__}")
                pairs.append(tokens.join_pair(i, q, document))
            return pairs

    def tokenize(self, query: str, document: str) -> tuple[list[int], list[int]]:
        """The token ids and token types of the pair, as ``predict`` computes it (truncated
        or refused as the Reranker is set)."""
        with self.using_resources():
            tokens = self._pairs.pair_tokens(0, (query, document))
        return tokens[:, 0].tolist(), tokens[:, 1].tolist()

    def stats(self) -> EmbedderStats:
        """Running totals (packs, pairs as ``sequences``, tokens, ...), as ``Embedder.stats``."""
        return self._core.stats(self.worker)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(EmbedPackEvent)`` after every pack (on the worker thread)."""
        self._core.telemetry.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        self._core.telemetry.remove_listener(listener)

    @property
    def max_tokens(self) -> int:
        """The most tokens of one pair (``max_length``)."""
        return self.max_length

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"labels={self.num_labels} max_length={self.max_length}"
        return f"<llamabatch.Reranker {self.model.path.name} {state}>"
