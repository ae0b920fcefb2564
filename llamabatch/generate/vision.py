"""Prompts with images: their tokens, their encoder cache, and computing their image positions.

A prompt with images (``{"prompt": text, "multi_modal_data": {"image": ...}}``, or a chat
message's ``image_url`` parts) is split by libmtmd (``_ffi/mtmd.py``) into text runs and
images; each image takes ``n_tokens`` positions, computed from its embeddings rather than from
token ids. The slot table still sees one id per position (:class:`MediaPrompt` ``.tokens``):
an image's positions hold stand-in ids, negative (never a vocabulary id), drawn from the
image's content hash and the projector file. So the prefix cache matches an image's positions
only for the same image after the same text, and never for another image.

When the core admits such a request (``EngineCore._start``, after ``KVCache.place`` chose its
slot and reused what it could), :meth:`Vision.prefill` computes the rest of the prompt up to
its last image into that slot: text runs as token batches, images as input-vector batches
(``_ffi/embd_batch.py``; a ``llama_batch`` holds token ids or vectors, never both) in slices
of ``n_batch``, an image that needs bidirectional attention (Gemma 3) in one batch with the
causal mask off, as llama.cpp's mtmd-helper decodes it. It records those positions as cached
in the slot table; the slot table then computes the text after the last image as any prompt.

Embeddings are kept in an encoder cache keyed by the image's hash (LRU, bounded in bytes):
the same image again skips the encoder.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamabatch._ffi.context import Context, check_decode
from llamabatch._ffi.embd_batch import EmbdBatch
from llamabatch._ffi.mtmd import ImageChunk, MtmdContext, TextChunk
from llamabatch.errors import PromptTooLong
from llamabatch.prompts.images import ImageLimits, image_key, load_image

__all__ = ["DEFAULT_ENCODER_CACHE_MB", "MediaPrompt", "Vision", "VisionCounters", "is_media_prompt"]

logger = logging.getLogger("llamabatch")

DEFAULT_ENCODER_CACHE_MB = 64


def is_media_prompt(prompt: object) -> bool:
    """Whether ``prompt`` is a dict with ``multi_modal_data`` (vLLM's form of a prompt with images)."""
    return isinstance(prompt, Mapping) and "multi_modal_data" in prompt


@dataclass(frozen=True)
class MediaPrompt:
    """A tokenized prompt with images: ``tokens`` (one id per position; stand-ins, negative,
    at an image's positions), ``images`` (each image's first position and its chunk) and
    ``end`` (the position after the last image)."""

    text: str
    tokens: list[int]
    images: list[tuple[int, ImageChunk]]
    end: int


@dataclass
class VisionCounters:
    """The encoder's running totals (``LLM.stats().vision``)."""

    images: int = 0
    encoded: int = 0
    cache_hits: int = 0
    cache_evictions: int = 0
    cache_bytes: int = 0
    image_positions: int = 0
    encode_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "images": self.images,
            "encoded": self.encoded,
            "cache_hits": self.cache_hits,
            "cache_evictions": self.cache_evictions,
            "cache_bytes": self.cache_bytes,
            "image_positions": self.image_positions,
            "encode_seconds": round(self.encode_seconds, 6),
        }


class Vision:
    """The image side of one engine: turns prompts with images into :class:`MediaPrompt`s (on
    callers' threads) and computes their image positions at admission (on the engine thread).

    Args:
        mtmd: the projector bound to the text model.
        limits: what a request's images may be.
        n_batch: the most positions of one decode.
        cache_mb: the encoder cache's bound (MiB of embeddings; 0: no cache).
    """

    def __init__(
        self, mtmd: MtmdContext, limits: ImageLimits, n_batch: int, cache_mb: int = DEFAULT_ENCODER_CACHE_MB
    ) -> None:
        self.mtmd = mtmd
        self.limits = limits
        self.n_batch = n_batch
        self.cache_bytes = cache_mb * 1024 * 1024
        self.counters = VisionCounters()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._batch: EmbdBatch | None = None
        stat = mtmd.path.stat()
        #: the projector's identity in the stand-in ids: another file gives other ids
        self._salt = f"{mtmd.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()

    # -- callers' side --------------------------------------------------------------------

    def media_prompt(self, prompt: Mapping[str, Any], n_ctx_seq: int, max_tokens: int) -> MediaPrompt:
        """The :class:`MediaPrompt` of ``{"prompt": text, "multi_modal_data": {"image": ...}}``
        (one image or a list: bytes, a data URL, an RGB array or a PIL image). The text holds
        one marker (``mtmd.marker``, ``<__media__>``) per image; without any, the images go
        first, each marker on a line of its own. Raises ImageError naming the image at fault,
        ValueError or PromptTooLong."""
        unknown = set(prompt) - {"prompt", "multi_modal_data"}
        if unknown:
            raise ValueError(
                f"a prompt with images takes 'prompt' and 'multi_modal_data', not {sorted(unknown)}"
            )
        text = prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError("a prompt with images needs its text as a non-empty str under 'prompt'")
        data = prompt["multi_modal_data"]
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            raise ValueError("multi_modal_data takes one key, 'image' (one image or a list of them)")
        images = data.get("image", [])
        if not isinstance(images, (list, tuple)):
            images = [images]
        marker = self.mtmd.marker
        if images and marker not in text:
            text = (marker + "\n") * len(images) + text
        return self.tokenize(
            text,
            list(images),
            n_ctx_seq,
            max_tokens,
            [f"multi_modal_data.image[{i}]" for i in range(len(images))],
        )

    def tokenize(
        self, text: str, images: Sequence[Any], n_ctx_seq: int, max_tokens: int, parts: Sequence[str]
    ) -> MediaPrompt:
        """Decode ``images`` (``parts`` name them in errors) and split ``text`` at its markers."""
        self.limits.check_count(len(images), "images")
        decoded = [
            (pixels, image_key(pixels))
            for pixels in (
                load_image(img, self.limits, part) for img, part in zip(images, parts, strict=True)
            )
        ]
        chunks = self.mtmd.tokenize(text, decoded)
        tokens: list[int] = []
        spans: list[tuple[int, ImageChunk]] = []
        for chunk in chunks:
            if isinstance(chunk, TextChunk):
                tokens.extend(chunk.tokens)
            else:
                if chunk.n_pos != chunk.n_tokens:
                    raise ValueError(
                        "an image whose positions differ from its embeddings (M-RoPE) is not supported"
                    )
                if chunk.n_tokens > self.n_batch and self.mtmd.non_causal(chunk):
                    raise ValueError(
                        f"an image of {chunk.n_tokens} embeddings needs one decode with bidirectional "
                        f"attention, more than n_batch={self.n_batch}: raise n_batch"
                    )
                spans.append((len(tokens), chunk))
                tokens.extend(self.stand_ins(chunk.key, chunk.n_tokens))
        end = spans[-1][0] + spans[-1][1].n_tokens if spans else 0
        if end >= len(tokens):
            raise ValueError("a prompt must have text after its last image (the answer starts from text)")
        if len(tokens) + max_tokens > n_ctx_seq:
            raise PromptTooLong(
                f"prompt of {len(tokens)} positions (images included) + max_tokens {max_tokens} exceeds the "
                f"per-request context of {n_ctx_seq} tokens"
            )
        return MediaPrompt(text, tokens, spans, end)

    def stand_ins(self, key: str, n: int) -> list[int]:
        """The ids an image's ``n`` positions hold in the slot table: negative, from its key."""
        seed = int.from_bytes(hashlib.sha256(self._salt + b"\0" + key.encode()).digest()[:8], "little")
        rng = np.random.Generator(np.random.PCG64(seed))
        return (-rng.integers(1, 2**31 - 1, size=n, dtype=np.int64)).tolist()

    # -- engine side ----------------------------------------------------------------------

    def embeddings(self, chunk: ImageChunk) -> np.ndarray:
        """The image's embeddings: from the encoder cache, or encoded (and cached)."""
        with self._lock:
            cached = self._cache.get(chunk.key)
            if cached is not None:
                self._cache.move_to_end(chunk.key)
                self.counters.cache_hits += 1
                return cached
        import time

        t0 = time.perf_counter()
        embd = self.mtmd.encode(chunk)
        with self._lock:
            self.counters.encoded += 1
            self.counters.encode_seconds += time.perf_counter() - t0
            if 0 < embd.nbytes <= self.cache_bytes:
                self._cache[chunk.key] = embd
                self.counters.cache_bytes += embd.nbytes
                while self.counters.cache_bytes > self.cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self.counters.cache_bytes -= old.nbytes
                    self.counters.cache_evictions += 1
        return embd

    def prefill(self, core: Any, slot: int, request: Any, reused: int) -> int:
        """Compute the positions of ``request``'s media prompt from ``reused`` to its last
        image's end into the idle ``slot`` of ``core`` (the slot holds the first ``reused``),
        record them in the slot table as cached, and return the positions the slot now holds
        (``reused`` for a request without images). An image that needs bidirectional
        attention restarts at its first position when ``reused`` falls inside it."""
        media: MediaPrompt | None = request.media
        if media is None:
            return reused
        context: Context = core.context
        table = core.table
        tokens = media.tokens
        start = reused
        for first, chunk in media.images:
            if first < start < first + chunk.n_tokens and self.mtmd.non_causal(chunk):
                start = first
        if start >= media.end:
            return reused
        if start < reused:
            context.seq_rm(slot, start, -1)
            table.trim(slot, start)
        pos = start
        try:
            for first, chunk in media.images:
                if first + chunk.n_tokens <= pos:
                    continue
                if pos < first:
                    self._decode_text(context, tokens[pos:first], pos, slot)
                    pos = first
                self._decode_image(context, chunk, first, pos, slot)
                pos = first + chunk.n_tokens
        except BaseException:
            context.seq_rm(slot, start, -1)
            raise
        table.record_cached(slot, tokens[: media.end])
        self.counters.images += len(media.images)
        self.counters.image_positions += media.end - start
        return media.end

    def _decode_text(self, context: Context, tokens: list[int], pos0: int, slot: int) -> None:
        for i in range(0, len(tokens), self.n_batch):
            context.decode_tokens(tokens[i : i + self.n_batch], pos0=pos0 + i, seq_id=slot)

    def _decode_image(self, context: Context, chunk: ImageChunk, first: int, pos: int, slot: int) -> None:
        embd = self.embeddings(chunk)
        batch = self._batch
        if batch is None or batch.n_embd != embd.shape[1]:
            batch = self._batch = EmbdBatch(self.n_batch, int(embd.shape[1]))
        non_causal = self.mtmd.non_causal(chunk)
        step = chunk.n_tokens if non_causal else self.n_batch
        if non_causal:
            self.mtmd.set_causal_attn(context, False)
        try:
            for i in range(pos - first, chunk.n_tokens, step):
                rows = embd[i : i + step]
                batch.clear()
                batch.add(rows, slot, pos0=first + i, outputs=False)
                check_decode(context.decode_address(batch.address), "llama_decode (image)")
        finally:
            if non_causal:
                self.mtmd.set_causal_attn(context, True)


def vision_for(model: Any, config: Any, context: Context) -> Vision | None:
    """The :class:`Vision` of an engine whose config names an ``mmproj`` (else None)."""
    if config.mmproj is None:
        return None
    from llamabatch.prompts.images import limits_of

    mtmd = MtmdContext(model, config.mmproj, n_threads=context.n_threads_batch)
    return Vision(mtmd, limits_of(config), context.n_batch)


def media_prompt(
    vision: Vision | None, prompt: object, n_ctx_seq: int, max_tokens: int
) -> MediaPrompt | None:
    """``prompt``'s :class:`MediaPrompt` when it carries images (``multi_modal_data``), else
    None; ValueError when it does and the engine has no ``mmproj``."""
    if not is_media_prompt(prompt):
        return None
    if vision is None:
        raise ValueError("this prompt has images (multi_modal_data), but the engine has no mmproj (--mmproj)")
    assert isinstance(prompt, Mapping)
    return vision.media_prompt(prompt, n_ctx_seq, max_tokens)
