"""Prompts with images: their tokens, their encoder cache, and computing their image positions.

A prompt with images (``{"prompt": text, "multi_modal_data": {"image": ...}}``, or a chat
message's ``image_url`` parts) is split by libmtmd (``_ffi/mtmd.py``) into text runs and
images; each image takes ``n_tokens`` positions, computed from its embeddings rather than from
token ids. The slot table still sees one id per position (:class:`MediaPrompt` ``.tokens``):
an image's positions hold stand-in ids, negative (never a vocabulary id), drawn from the
image's content hash and the projector file. So the prefix cache matches an image's positions
only for the same image after the same text, and never for another image.

When the core admits such a request (``EngineCore._start``, after ``KVCache.place`` chose its
slot and reused what it could), :meth:`Vision.prefill` holds its slot: the slot table does not
plan it (:class:`HoldStrategy` wraps the engine's strategy) while :meth:`Vision.tick`, at the
start of every tick, computes the prompt up to its last image into that slot: text runs as
token batches, images as input-vector batches (``_ffi/embd_batch.py``; a ``llama_batch``
holds token ids or vectors, never both). While other streams decode, a tick computes one
slice of the held prompts (at most ``chunk_size`` positions, as a text prompt's chunk) and the
streams decode after it, so they never wait for a whole image; with none decoding, the held
prompts are computed whole. An image that needs bidirectional attention (Gemma 3) is never
sliced: it goes into one batch with the causal mask off, as llama.cpp's mtmd-helper decodes
it. Then the slot table records those positions as cached and computes the text after the
last image as any prompt. An image that fails (encoder, decode) ends its request only.

Positions are llama.cpp's (what ``seq_rm``/``seq_cp`` and the slot table count), not KV
cells. An M-RoPE model (Qwen-VL) places an image's ``n_tokens`` embeddings at 4-value
positions (temporal, height, width: libmtmd's grid) sharing one temporal position, and the
text after it continues ``n_pos`` positions on (the larger side of the grid): such an image
takes ``n_pos`` table positions for its ``n_tokens`` cells. As its cells share one temporal
position, a slice in progress is counted in rows (:attr:`ImageHold.row`) and the image's
positions enter the table only whole; a prefix that ends inside it restarts it.

The image encoder runs on a thread of its own (one at a time), which then gives back its
OpenMP workers (``_ffi/openmp.py``: kept, they made the engine's later decodes 2.7x slower on
2 cores). While other streams decode, a held prompt whose image is being encoded waits for it
without holding up their ticks; with none decoding, the engine thread waits for it. The
encoder cache keeps embeddings by the image's hash (LRU, bounded in bytes): the same image
again skips the encoder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from llamabatch._core.slots import SlotState
from llamabatch._ffi.context import Context, check_decode
from llamabatch._ffi.embd_batch import EmbdBatch
from llamabatch._ffi.mtmd import MROPE_SECTIONS, ImageChunk, MtmdContext, TextChunk
from llamabatch._ffi.openmp import release_openmp_threads
from llamabatch.errors import KVCacheFull, PromptTooLong
from llamabatch.generate.image_cells import ImageCells, prompt_cells
from llamabatch.generate.image_hold import HoldStrategy, ImageHold
from llamabatch.prompts.images import ImageLimits, image_key, load_image

__all__ = [
    "DEFAULT_ENCODER_CACHE_MB",
    "MIN_SLICE",
    "HoldStrategy",
    "ImageHold",
    "MediaPrompt",
    "Vision",
    "VisionCounters",
    "is_media_prompt",
]

logger = logging.getLogger("llamabatch")

DEFAULT_ENCODER_CACHE_MB = 64
#: the fewest image positions a tick computes while other streams decode (images progress
#: even under a tight latency budget)
MIN_SLICE = 16


def is_media_prompt(prompt: object) -> bool:
    """Whether ``prompt`` is a dict with ``multi_modal_data`` (vLLM's form of a prompt with
    images) or a :class:`MediaPrompt` (a chat's with ``image_url`` parts)."""
    return isinstance(prompt, MediaPrompt) or (isinstance(prompt, Mapping) and "multi_modal_data" in prompt)


@dataclass(frozen=True, eq=False)
class MediaPrompt(Mapping[str, Any]):
    """A tokenized prompt with images: ``tokens`` (one id per position; stand-ins, negative,
    at an image's ``n_pos`` positions), ``images`` (each image's first position and its
    chunk) and ``end`` (the position after the last image). A prompt as ``generate`` takes one: read as a
    mapping it is vLLM's form, ``{"prompt": text, "multi_modal_data": {"image": chunks}}``."""

    text: str
    tokens: list[int]
    images: list[tuple[int, ImageChunk]]
    end: int

    def __getitem__(self, key: str) -> Any:
        if key == "prompt":
            return self.text
        if key == "multi_modal_data":
            return {"image": [chunk for _, chunk in self.images]}
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("prompt", "multi_modal_data"))

    def __len__(self) -> int:
        return 2


@dataclass
class VisionCounters:
    """The encoder's running totals (``LLM.stats().vision``)."""

    images: int = 0
    encoded: int = 0
    cache_hits: int = 0
    cache_evictions: int = 0
    cache_bytes: int = 0
    image_positions: int = 0
    image_slices: int = 0
    encode_seconds: float = 0.0
    image_decode_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "encode_seconds": round(self.encode_seconds, 6),
            "image_decode_seconds": round(self.image_decode_seconds, 6),
        }


class Vision:
    """The image side of one engine: turns prompts with images into :class:`MediaPrompt`s (on
    callers' threads) and computes their image positions at admission (on the engine thread).

    Args:
        mtmd: the projector bound to the text model.
        limits: what a request's images may be.
        n_batch: the most positions of one decode.
        cache_mb: the encoder cache's bound (MiB of embeddings; 0: no cache).
        n_ubatch: the most tokens of one micro-batch (default ``n_batch``): a bidirectional image's bound.
    """

    def __init__(
        self,
        mtmd: MtmdContext,
        limits: ImageLimits,
        n_batch: int,
        cache_mb: int = DEFAULT_ENCODER_CACHE_MB,
        overlap: bool = True,
        n_ubatch: int | None = None,
    ) -> None:
        self.mtmd = mtmd
        #: whether encodes run beside the streams' decodes (else the engine thread waits for
        #: them): only where the cores hold both thread pools (see :func:`vision_for`)
        self.overlap = overlap
        self.limits = limits
        self.n_batch = n_batch
        self.n_ubatch = n_batch if n_ubatch is None else min(n_ubatch, n_batch)
        self.cache_bytes = cache_mb * 1024 * 1024
        self.counters = VisionCounters()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._batch: EmbdBatch | None = None
        self._holds: dict[int, ImageHold] = {}
        #: the M-RoPE images prompts carry: the KV cells the slot table's positions miss
        self.cells = ImageCells()
        #: encodes running beside the engine thread's decodes, by image key
        self._encoding: dict[str, Future[np.ndarray]] = {}
        self._encoder: ThreadPoolExecutor | None = None
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
        extra_cells = 0  # an M-RoPE image holds more KV cells than positions
        for chunk in chunks:
            if isinstance(chunk, TextChunk):
                tokens.extend(chunk.tokens)
            else:
                if chunk.n_pos < 1 or (chunk.n_pos != chunk.n_tokens and not self.mtmd.mrope):
                    raise ValueError(
                        f"libmtmd gave an image {chunk.n_pos} positions for {chunk.n_tokens} embeddings"
                    )
                extra_cells += max(chunk.n_tokens - chunk.n_pos, 0)
                if chunk.n_tokens > self.n_ubatch and self.mtmd.non_causal(chunk):
                    # llama.cpp computes a non-causal batch in one micro-batch (it aborts otherwise)
                    raise ValueError(
                        f"an image of {chunk.n_tokens} embeddings needs one micro-batch with bidirectional "
                        f"attention, more than n_ubatch={self.n_ubatch} (n_batch={self.n_batch}): raise them"
                    )
                spans.append((len(tokens), chunk))
                tokens.extend(self.stand_ins(chunk.key, chunk.n_pos))
        end = spans[-1][0] + spans[-1][1].n_pos if spans else 0
        if end >= len(tokens):
            raise ValueError("a prompt must have text after its last image (the answer starts from text)")
        if len(tokens) + extra_cells + max_tokens > n_ctx_seq:
            raise PromptTooLong(
                f"prompt of {len(tokens) + extra_cells} KV cells (images included) + max_tokens {max_tokens} "
                f"exceeds the per-request context of {n_ctx_seq} tokens"
            )
        media = MediaPrompt(text, tokens, spans, end)
        self.cells.note(media)
        return media

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
        t0 = time.perf_counter()
        embd = self.mtmd.encode(chunk)
        self._store(chunk.key, embd, time.perf_counter() - t0)
        return embd

    def _store(self, key: str, embd: np.ndarray, seconds: float) -> None:
        """Count an encode of ``seconds`` and cache its embeddings (LRU, bounded)."""
        with self._lock:
            self.counters.encoded += 1
            self.counters.encode_seconds += seconds
            if 0 < embd.nbytes <= self.cache_bytes:
                self._cache[key] = embd
                self.counters.cache_bytes += embd.nbytes
                while self.counters.cache_bytes > self.cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self.counters.cache_bytes -= old.nbytes
                    self.counters.cache_evictions += 1

    def _encode_group(self, group: list[ImageChunk], futures: list[Future[np.ndarray]]) -> None:
        """On the encoder thread: encode ``group`` (held prompts' images, several requests')
        in ``mtmd_batch`` runs, each future answered as its run is done. When a run fails, its
        images and the rest are encoded one by one, so an image's error reaches only the
        requests that have it. A lone image takes :meth:`embeddings`' path."""
        try:
            self._encode_all(group, futures)
        finally:
            release_openmp_threads()  # (the module docstring says why)

    def _encode_all(self, group: list[ImageChunk], futures: list[Future[np.ndarray]]) -> None:
        done = 0
        try:
            t0 = time.perf_counter()
            for run in self.mtmd.encode_runs(group) if len(group) > 1 else ():
                share = (time.perf_counter() - t0) / max(len(run), 1)
                for embd in run:
                    self._store(group[done].key, embd, share)
                    futures[done].set_result(embd)
                    done += 1
                t0 = time.perf_counter()
        except Exception:
            pass  # the images not answered yet go one by one below
        for chunk, future in zip(group[done:], futures[done:], strict=True):
            try:
                future.set_result(self.embeddings(chunk))
            except Exception as exc:
                future.set_exception(exc)

    def _pending_images(self, first: ImageChunk) -> list[ImageChunk]:
        """``first`` and the held prompts' images still to compute that no encode runs for and
        the cache does not hold, once each: one group for the encoder thread."""
        group = [first]
        seen = {first.key}
        with self._lock:
            cached = set(self._cache)
        for hold in self._holds.values():
            for at, chunk in hold.request.media.images:
                key = chunk.key
                if at + chunk.n_pos > hold.pos and key not in seen and key not in cached:
                    if key not in self._encoding:
                        group.append(chunk)
                        seen.add(key)
        return group

    def ready_embeddings(self, chunk: ImageChunk, wait: bool) -> np.ndarray | None:
        """The image's embeddings from the encoder cache, or from its encode on the encoder
        thread (started here when none runs): None while it runs, unless ``wait``. The text
        streams decode on the engine thread meanwhile. Raises the encoder's error."""
        future = self._encoding.get(chunk.key)
        if future is None:
            with self._lock:
                cached = self._cache.get(chunk.key)
                if cached is not None:
                    self._cache.move_to_end(chunk.key)
                    self.counters.cache_hits += 1
                    return cached
            if self._encoder is None:
                self._encoder = ThreadPoolExecutor(1, thread_name_prefix="llamabatch-image-encoder")
            group = self._pending_images(chunk)
            futures: list[Future[np.ndarray]] = [Future() for _ in group]
            for image, pending in zip(group, futures, strict=True):
                self._encoding[image.key] = pending
            self._encoder.submit(self._encode_group, group, futures)
            future = futures[0]
        if not wait and not future.done():
            return None
        del self._encoding[chunk.key]
        return future.result()

    def prefill(self, core: Any, slot: int, request: Any, reused: int) -> int:
        """At admission into the idle ``slot`` (holding the first ``reused`` positions of
        ``request``'s prompt): the positions the slot holds for the slot table's ``start``.
        A prompt with images to compute is held (:class:`ImageHold`): the slot table does not
        plan it while :meth:`tick` computes its positions up to its last image, slice by
        slice. An image that needs bidirectional attention, or M-RoPE positions, restarts at
        its first position when ``reused`` falls inside it."""
        self._holds.pop(slot, None)
        media: MediaPrompt | None = request.media
        if media is None:
            return reused
        start = reused
        for first, chunk in media.images:
            if first < start < first + chunk.n_pos and (self.mtmd.mrope or self.mtmd.non_causal(chunk)):
                start = first
        self.counters.images += len(media.images)
        if start >= media.end:
            return reused
        if start < reused:
            core.context.seq_rm(slot, start, -1)
            core.table.trim(slot, start)
        self._holds[slot] = ImageHold(request, slot, start, start)
        return start

    def extra_cells(self, core: Any, media: MediaPrompt | None, kept: int) -> int:
        """The KV cells admitting ``media`` (None: a prompt without images) from position
        ``kept`` takes beyond the positions the slot table counts, with those the sequences
        and held prompts take beyond theirs (``image_cells.py``; 0 without M-RoPE)."""
        if not self.mtmd.mrope:
            return 0
        held = [(hold.request.media, hold.start) for hold in self._holds.values()]
        return self.cells.beyond_positions(core.table, held, media, kept)

    def state_cells(self, core: Any, tokens: Sequence[int]) -> int:
        """The KV cells loading a saved state of ``tokens`` takes beyond their positions,
        with those the sequences and held prompts take beyond theirs (0 without M-RoPE)."""
        return self.cells.in_tokens(tokens) + self.extra_cells(core, None, 0) if self.mtmd.mrope else 0

    @property
    def holds(self) -> dict[int, ImageHold]:
        """The slots whose prompts' images are being computed, by slot."""
        return self._holds

    def tick(self, core: Any, budget: int) -> int:
        """At the start of a tick (``core``: a ``TickContext`` with ``slots`` and ``kv``):
        compute the held prompts' next positions, and return the token budget left to the
        text batch. With other streams to decode, the images take a slice of the budget
        (at most ``chunk_size`` positions, at least :data:`MIN_SLICE`) and the streams
        decode after it; with none, the held prompts are computed whole. A request whose
        image fails (encoder, decode) ends with that error; the others go on."""
        holds = self._holds
        if not holds:
            self._plan_around(core, False)
            if self._encoding:  # encodes of requests that ended meanwhile (their results are cached)
                self._encoding = {k: f for k, f in self._encoding.items() if not f.done()}
            return budget
        table = core.table
        running = core.slots.requests
        for slot, hold in list(holds.items()):
            if running[slot] is not hold.request or table.state(slot) != SlotState.PREFILL:
                del holds[slot]  # ended, preempted or cancelled meanwhile
        others = [
            s
            for s, _ in core.slots.busy()
            if s not in holds and table.state(s) in (SlotState.DECODE, SlotState.PREFILL)
        ]
        n_decode = sum(1 for s in others if table.state(s) == SlotState.DECODE)
        room = (
            max(budget - n_decode, MIN_SLICE, 1) if others else -1
        )  # -1: no stream waits, compute everything now
        if others:
            room = min(room, table.chunk_size, self.n_batch)
        used = 0
        for slot in list(holds):
            if 0 <= room <= used:
                break
            hold = holds[slot]
            try:
                used += self._advance(core, hold, -1 if room < 0 else room - used)
            except Exception as exc:
                if getattr(core, "stopping", False):
                    return budget  # the driver is closing: it ends every request next
                logger.warning("llamabatch: request %s: %s", hold.request.request_id, exc)
                del holds[slot]
                core.finish(slot, "error", error=exc)
                continue
            if hold.pos >= hold.request.media.end:
                del holds[slot]
                self._release(core, hold)
        self.counters.image_slices += 1 if used else 0
        self._plan_around(core, bool(holds))
        return max(budget - used, n_decode, 1) if others else budget

    def _advance(self, core: Any, hold: ImageHold, room: int) -> int:
        """Compute up to ``room`` (-1: all) of ``hold``'s next positions; how many it did."""
        media: MediaPrompt = hold.request.media
        context: Context = core.context
        done = 0
        for first, chunk in media.images:
            if room >= 0 and done >= room:
                break
            if first + chunk.n_pos <= hold.pos:
                continue
            if hold.pos < first:  # the text before this image
                n = first - hold.pos if room < 0 else min(first - hold.pos, room - done)
                for i in range(0, n, self.n_batch):
                    part = media.tokens[hold.pos + i : hold.pos + min(n, i + self.n_batch)]
                    self._decode(
                        core,
                        hold,
                        hold.pos + i,
                        lambda p=part, i=i: context.decode_tokens(p, pos0=hold.pos + i, seq_id=hold.slot),
                    )
                hold.pos += n
                done += n
                if hold.pos < first:
                    break  # the room is spent
            if room >= 0 and done >= room and not self.mtmd.non_causal(chunk):
                break
            if hold.embd is None or hold.embd[0] != chunk.key:
                ready = self.ready_embeddings(chunk, wait=room < 0 or not self.overlap)
                if ready is None:
                    break  # encoding: the streams decode meanwhile
                hold.embd = (chunk.key, ready)
            embd = hold.embd[1]
            non_causal = self.mtmd.non_causal(chunk)
            mrope = self.mtmd.mrope
            row = hold.row if mrope else hold.pos - first
            left = chunk.n_tokens - row
            # a bidirectional image goes whole into one decode: it is never sliced
            n = left if room < 0 or non_causal else min(left, room - done)
            self._decode_image(core, hold, first, chunk, embd, row, row + n, non_causal)
            done += n
            if not mrope:
                hold.pos += n
            elif row + n < chunk.n_tokens:
                hold.row = row + n
            else:  # the image is whole: the text after it starts n_pos positions on
                hold.pos, hold.row = first + chunk.n_pos, 0
        return done

    def _decode(self, core: Any, hold: ImageHold, pos0: int, decode: Any) -> None:
        """Run ``decode`` (of ``hold``'s positions from ``pos0``); when the KV cache has no
        room, evict idle cached prefixes and retry."""

        t0 = time.perf_counter()
        while True:
            try:
                decode()
                break
            except KVCacheFull as full:
                self._make_room(core, hold, pos0, full)
        self.counters.image_decode_seconds += time.perf_counter() - t0

    @staticmethod
    def _make_room(core: Any, hold: ImageHold, pos0: int, full: KVCacheFull) -> None:
        """After a decode found the KV cache full (``full``): drop ``hold``'s positions from
        ``pos0`` (a failed decode may have kept its first micro-batches) and evict an idle
        cached prefix; raise ``full`` when there is none."""
        core.context.seq_rm(hold.slot, pos0, -1)
        if not core.kv.evict_one():
            raise full
        core.counters.evictions += 1

    def _image_positions(self, hold: ImageHold, first: int, chunk: ImageChunk) -> np.ndarray:
        """The M-RoPE positions of the image at ``first`` (kept while it is computed)."""
        if hold.mrope is None or hold.mrope[0] != first:
            hold.mrope = (first, self.mtmd.mrope_positions(chunk, first))
        return hold.mrope[1]

    def _decode_image(
        self,
        core: Any,
        hold: ImageHold,
        first: int,
        chunk: ImageChunk,
        embd: np.ndarray,
        lo: int,
        hi: int,
        non_causal: bool,
    ) -> None:
        """Decode the image's embedding rows ``[lo, hi)`` (the image starts at position
        ``first``) into ``hold``'s slot, in batches of at most ``n_batch``. With M-RoPE the
        rows carry the grid's positions and all share one temporal position, so a KV cache
        found full drops the image's rows decoded so far and computes them again."""
        context: Context = core.context
        mrope = self.mtmd.mrope
        sections = MROPE_SECTIONS if mrope else 1
        batch = self._batch
        if batch is None or batch.n_embd != embd.shape[1] or batch.n_pos_per_embd != sections:
            batch = self._batch = EmbdBatch(self.n_batch, int(embd.shape[1]), sections)
        positions = self._image_positions(hold, first, chunk) if mrope else None
        if non_causal:
            self.mtmd.set_causal_attn(context, False)
        t0 = time.perf_counter()
        try:
            i = lo
            while i < hi:
                j = min(hi, i + self.n_batch)
                batch.clear()
                if positions is not None:
                    batch.add(embd[i:j], hold.slot, outputs=False, positions=positions[:, i:j])
                else:
                    batch.add(embd[i:j], hold.slot, pos0=first + i, outputs=False)
                try:
                    check_decode(context.decode_address(batch.address), "llama_decode (image)")
                except KVCacheFull as full:
                    self._make_room(core, hold, first if mrope else first + i, full)
                    if mrope:
                        i = 0
                    continue
                i = j
        finally:
            self.counters.image_decode_seconds += time.perf_counter() - t0
            if non_causal:
                self.mtmd.set_causal_attn(context, True)

    def _release(self, core: Any, hold: ImageHold) -> None:
        """The held prompt's positions are computed up to its last image: the slot table
        records them and prefills the text after them as any prompt's."""
        media: MediaPrompt = hold.request.media
        table = core.table
        table.finish(hold.slot, keep=True)
        table.record_cached(hold.slot, media.tokens[: media.end])
        table.start(hold.slot, hold.request.tokens_to_compute(), media.end)
        self.counters.image_positions += media.end - hold.start

    def _plan_around(self, core: Any, holding: bool) -> None:
        """While prompts are held, the engine's strategy plans the other slots only."""
        strategy = core.strategy
        if holding and not isinstance(strategy, HoldStrategy):
            core.strategy = HoldStrategy(strategy, self._holds)
        elif not holding and isinstance(strategy, HoldStrategy):
            core.strategy = strategy.inner


def vision_for(model: Any, config: Any, context: Context) -> Vision | None:
    """The :class:`Vision` of an engine whose config names an ``mmproj`` (else None)."""
    if config.mmproj is None:
        return None
    from llamabatch.prompts.images import limits_of

    mtmd = MtmdContext(model, config.mmproj, n_threads=context.n_threads_batch)
    # an encode beside a decode on cores that cannot hold both thread pools makes ggml's
    # spinning threads take turns: bulk captioning ran at 0.85x llama-server's serial pace
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    overlap = context.n_threads + context.n_threads_batch <= cores
    return Vision(mtmd, limits_of(config), context.n_batch, overlap=overlap, n_ubatch=context.n_ubatch)


def vision_stats(vision: Vision | None) -> dict[str, Any]:
    """``GenerationStats``' ``encoder_*`` fields (empty without an ``mmproj``: the defaults)."""
    if vision is None:
        return {}
    c = vision.counters
    return {
        "encoder_images": c.images,
        "encoder_encoded": c.encoded,
        "encoder_cache_hits": c.cache_hits,
        "encoder_cache_evictions": c.cache_evictions,
        "encoder_cache_bytes": c.cache_bytes,
        "encoder_image_positions": c.image_positions,
        "encoder_image_slices": c.image_slices,
        "encoder_encode_time_s": c.encode_seconds,
        "encoder_image_decode_time_s": c.image_decode_seconds,
    }


def media_prompt(
    vision: Vision | None, prompt: object, n_ctx_seq: int, max_tokens: int
) -> MediaPrompt | None:
    """``prompt``'s :class:`MediaPrompt` when it carries images (``multi_modal_data``), else
    None; ValueError when it does and the engine has no ``mmproj``."""
    if not is_media_prompt(prompt):
        return None
    if vision is None:
        raise ValueError("this prompt has images (multi_modal_data), but the engine has no mmproj (--mmproj)")
    if isinstance(prompt, MediaPrompt):  # tokenized already (a chat's images)
        n_cells = prompt_cells(prompt, len(prompt.tokens))
        if n_cells + max_tokens > n_ctx_seq:
            raise PromptTooLong(
                f"prompt of {n_cells} KV cells (images included) + max_tokens {max_tokens} "
                f"exceeds the per-request context of {n_ctx_seq} tokens"
            )
        return prompt
    assert isinstance(prompt, Mapping)
    return vision.media_prompt(prompt, n_ctx_seq, max_tokens)
