"""Embeddings of prompts with images (``Embedder(model, mmproj=...)``).

A vision-language model used as an embedding model (a decoder with KV memory, pooled by the
last token or the mean, as GME or VLM2Vec) reads a prompt of text and images: libmtmd splits
it at its markers (``<__media__>``) into text runs and images, as for generation
(``generate/vision.py``, whose tokenizing and encoder cache this reuses). A ``llama_batch``
holds token ids or input vectors, never both, so such a prompt is computed alone, in
decodes of at most one micro-batch each (text runs as tokens, images as their embeddings,
a bidirectional image whole with the causal mask off), into sequence 0 of the cleared
memory; the text packs of other callers wait meanwhile.

llama.cpp pools within one micro-batch, so the pooled vector of the whole prompt is built
from the decodes' own: ``"mean"`` weighs each decode's mean by its rows (exact), ``"cls"``
keeps the first decode's (position 0), ``"last"`` the last decode's (its last token attends
over the whole prompt in the KV cache), ``"none"`` joins every row (an image gives one row per
embedding). ``"rank"`` (a classification head over text pairs) is refused with images.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from llamabatch._ffi.context import Context, check_decode
from llamabatch._ffi.embd_batch import EmbdBatch
from llamabatch._ffi.model import Model
from llamabatch._ffi.mtmd import MROPE_SECTIONS, ImageChunk, MtmdContext
from llamabatch.errors import ImageError, PromptTooLong
from llamabatch.generate.vision import MediaPrompt, Vision
from llamabatch.prompts.images import limits_of

__all__ = ["MediaEmbedder"]


class MediaEmbedder:
    """Tokenizes prompts with images (the callers' threads) and embeds them (the worker).

    Raises ValueError at construction when the model cannot embed images: an encoder without
    KV memory (BERT). (``EmbedderConfig`` refuses ``"rank"`` pooling with ``mmproj``.)"""

    def __init__(self, model: Model, config: Any, context: Context, pooling: str, n_ubatch: int) -> None:
        if not context.has_memory:
            raise ValueError(
                f"mmproj needs a decoder model (with KV memory) to embed images; {model.path.name} is an "
                "encoder without one"
            )
        self.mtmd = MtmdContext(model, config.mmproj, n_threads=context.n_threads_batch)
        #: the most rows of one decode: llama.cpp pools within one micro-batch
        self.n_ubatch = n_ubatch
        self.vision = Vision(self.mtmd, limits_of(config), n_ubatch, overlap=False, n_ubatch=n_ubatch)
        self.pooling = pooling
        self._image_batch: EmbdBatch | None = None

    # -- callers' side --------------------------------------------------------------------

    def prompt(self, index: int, item: Any, max_cells: int) -> MediaPrompt:
        """The :class:`MediaPrompt` of ``item`` (``{"prompt": text, "multi_modal_data":
        {"image": ...}}``), at most ``max_cells`` KV cells. Raises ImageError, ValueError or
        PromptTooLong, naming the input's index."""
        if isinstance(item, MediaPrompt):
            media = item
        else:
            try:
                media = self.vision.media_prompt(item, 2**31 - 1, 0)
            except ImageError as exc:
                raise ImageError(f"texts[{index}].{exc.part}", exc.reason) from None
            except PromptTooLong:
                raise
            except ValueError as exc:
                raise ValueError(f"texts[{index}]: {exc}") from None
        cells = len(media.tokens) + sum(max(chunk.n_tokens - chunk.n_pos, 0) for _, chunk in media.images)
        if cells > max_cells:
            raise PromptTooLong(
                f"text {index} takes {cells} KV cells (its images included), more than the {max_cells} "
                "of one sequence: raise n_ctx"
            )
        return media

    # -- worker side ----------------------------------------------------------------------

    def embed(self, context: Context, batch: Any, media: MediaPrompt, n_out: int) -> tuple[np.ndarray, int]:
        """Compute ``media`` into sequence 0 of the cleared memory, with ``batch`` (the
        embedder's token batch) for its text; its pooled vector (``"none"``: its rows) and the
        decodes it took. Raises DecodeError, KVCacheFull or RuntimeError (the encoder)."""
        context.memory_clear(False)
        counters = self.vision.counters
        counters.images += len(media.images)
        pooled = _Pooled(self.pooling, n_out)
        decodes, pos, tokens = 0, 0, media.tokens
        for first, chunk in [*media.images, (len(tokens), None)]:
            while pos < first:  # the text before the image (or the end)
                n = min(first - pos, self.n_ubatch)
                batch.clear()
                batch.add_sequence(np.asarray(tokens[pos : pos + n], dtype=np.int32), 0, pos, True)
                check_decode(context.decode_address(batch.address), "llama_decode (embedding)")
                pooled.add(context, n)
                decodes += 1
                pos += n
            if chunk is None:
                break
            decodes += self._image(context, chunk, first, pooled)
            pos = first + chunk.n_pos
        return pooled.result(), decodes

    def _image(self, context: Context, chunk: ImageChunk, first: int, pooled: _Pooled) -> int:
        """Decode the image at position ``first``, every embedding an output; the decodes."""
        mtmd = self.mtmd
        embd = self.vision.embeddings(chunk)
        sections = MROPE_SECTIONS if mtmd.mrope else 1
        batch = self._image_batch
        if batch is None or batch.n_embd != embd.shape[1] or batch.n_pos_per_embd != sections:
            batch = self._image_batch = EmbdBatch(self.n_ubatch, int(embd.shape[1]), sections)
        positions = mtmd.mrope_positions(chunk, first) if mtmd.mrope else None
        non_causal = mtmd.non_causal(chunk)  # one decode (``Vision.tokenize`` checked its size)
        if non_causal:
            mtmd.set_causal_attn(context, False)
        decodes, t0 = 0, time.perf_counter()
        try:
            for i in range(0, chunk.n_tokens, self.n_ubatch):
                j = min(chunk.n_tokens, i + self.n_ubatch)
                batch.clear()
                if positions is not None:
                    batch.add(embd[i:j], 0, outputs=True, positions=positions[:, i:j])
                else:
                    batch.add(embd[i:j], 0, pos0=first + i, outputs=True)
                check_decode(context.decode_address(batch.address), "llama_decode (image embedding)")
                pooled.add(context, j - i)
                decodes += 1
        finally:
            if non_causal:
                mtmd.set_causal_attn(context, True)
            counters = self.vision.counters
            counters.image_decode_seconds += time.perf_counter() - t0
        counters.image_positions += chunk.n_pos
        return decodes


class _Pooled:
    """One prompt's pooled vector, built from its decodes' (see the module's docstring)."""

    def __init__(self, pooling: str, n_out: int) -> None:
        self.pooling = pooling
        self.n_out = n_out
        self.rows: list[np.ndarray] = []
        self.total: np.ndarray | None = None
        self.n = 0

    def add(self, context: Context, n: int) -> None:
        """The decode just done, of ``n`` rows of sequence 0."""
        if self.pooling == "none":
            self.rows.extend(context.embeddings_ith(i) for i in range(n))
            return
        vector = context.embeddings_seq(0, self.n_out)
        if vector is None:  # pragma: no cover - the context was created with pooling
            raise RuntimeError("llama.cpp returned no pooled embedding")
        if self.pooling == "mean":
            self.total = vector * n if self.total is None else self.total + vector * n
        elif self.pooling == "last" or self.total is None:  # "cls": the first decode's
            self.total = vector
        self.n += n

    def result(self) -> np.ndarray:
        if self.pooling == "none":
            return np.stack(self.rows).astype(np.float32, copy=False)
        assert self.total is not None
        return (self.total / self.n if self.pooling == "mean" else self.total).astype(np.float32)
