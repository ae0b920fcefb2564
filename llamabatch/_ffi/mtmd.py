"""``MtmdContext``: owner of an ``mtmd_context`` (llama.cpp's libmtmd: an image encoder and
projector, the ``--mmproj`` file, bound to a text model).

libmtmd turns a prompt with media markers plus bitmaps into chunks: runs of text token ids,
and image chunks whose embeddings its encoder computes (``encode``). The image embeddings are
then decoded by the text model's context like token embeddings (``generate/vision.py``).

The binding is a module of its own (``_mtmd``, compiled from ``_mtmd_cdefs.h``): a llama.cpp
build without libmtmd keeps its text binding and loses only this. Every call that touches the
encoder's state goes under one lock: callers tokenize on their own threads while the engine
thread encodes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llamabatch._ffi import BUILD, ensure_backend, log
from llamabatch._ffi import ffi as llama_ffi
from llamabatch._ffi import lib as llama_lib
from llamabatch._ffi.model import Model
from llamabatch.errors import ModelLoadError
from llamabatch.validate import check_positive_int

__all__ = ["MROPE_SECTIONS", "ImageChunk", "MtmdContext", "TextChunk", "mtmd_available"]

#: position values per embedding of an M-RoPE model (temporal, height, width, unused)
MROPE_SECTIONS = 4

_lock = threading.Lock()
_loaded: list[Any] = []  # (ffi, lib) once loaded
_load_error: list[str] = []


def _binding() -> tuple[Any, Any]:
    """The ``_mtmd`` module's ``ffi`` and ``lib``, loaded once (libmtmd preloaded by path, as
    ``_vendor.preload`` does for libllama, so an in-place build finds it)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        if _load_error:
            raise ImportError(_load_error[0])
        path = BUILD.library("mtmd")
        try:
            if path is None:
                raise ImportError(f"the llama.cpp build in {BUILD.lib_dir} has no libmtmd")
            ctypes.CDLL(str(path), mode=getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0))
            from llamabatch._ffi._mtmd import ffi, lib  # type: ignore[import-not-found]
        except (ImportError, OSError) as exc:
            _load_error.append(
                f"images need libmtmd and llamabatch's binding to it (llamabatch._ffi._mtmd): {exc}. "
                "Reinstall llamabatch (`pip install .`) against a llama.cpp build with libmtmd."
            )
            raise ImportError(_load_error[0]) from exc
        ensure_backend()
        # libmtmd logs through its own setter: the same callback as libllama's (the log module)
        callback = ffi.cast(
            "ggml_log_callback", int(llama_ffi.cast("uintptr_t", llama_lib._llamabatch_log_callback))
        )
        lib.mtmd_log_set(callback, ffi.NULL)
        _loaded.append((ffi, lib))
        return ffi, lib


def mtmd_available() -> bool:
    """Whether libmtmd and its binding load (images can be served)."""
    try:
        _binding()
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class TextChunk:
    """A run of text token ids of a tokenized multimodal prompt."""

    tokens: tuple[int, ...]


class ImageChunk:
    """One image of a tokenized prompt: ``n_tokens`` embeddings taking ``n_pos`` positions.

    Owns its copy of libmtmd's chunk (freed once, when garbage collected or by ``close``);
    ``key`` is the caller's content hash of the image (the encoder cache's key)."""

    def __init__(self, handle: Any, key: str, n_tokens: int, n_pos: int) -> None:
        self._handle = handle
        self.key = key
        self.n_tokens = n_tokens
        self.n_pos = n_pos

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise ValueError("the image chunk was closed")
        return self._handle

    def close(self) -> None:
        """Free the chunk now. Idempotent."""
        if self._handle is not None:
            ffi, _ = _binding()
            ffi.release(self._handle)
            self._handle = None

    def __repr__(self) -> str:
        return f"ImageChunk(key={self.key[:12]!r}, n_tokens={self.n_tokens}, n_pos={self.n_pos})"


class MtmdContext:
    """An ``mtmd_context``: the ``mmproj`` file's encoder bound to ``model``.

    Args:
        model: the text model (its ``n_embd`` must be the projector's output width).
        mmproj: the projector GGUF (``--mmproj``).
        n_threads: CPU threads of the encoder.
        warmup: run one encode at load (llama.cpp's default), so the first image is not slow.

    Raises:
        FileNotFoundError: no such file.
        ModelLoadError: libmtmd rejected the file (the reason it logged), or it has no vision
            encoder.
        ImportError: this llama.cpp build has no libmtmd.
    """

    def __init__(
        self, model: Model, mmproj: str | os.PathLike[str], *, n_threads: int = 4, warmup: bool = True
    ) -> None:
        self._ptr: Any = None
        self.path = Path(mmproj)
        n_threads = check_positive_int("n_threads", n_threads, minimum=1)
        if not self.path.is_file():
            raise FileNotFoundError(f"mmproj file not found: {self.path}")
        ffi, lib = _binding()
        self._ffi, self._lib = ffi, lib
        self._lock = threading.Lock()
        params = lib.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = n_threads
        params.warmup = bool(warmup)
        model_ptr = ffi.cast("struct llama_model *", int(llama_ffi.cast("uintptr_t", model.ptr)))
        with log.capture() as logged:
            ptr = lib.mtmd_init_from_file(os.fsencode(self.path), model_ptr, params)
            failed = ptr == ffi.NULL
            reason = (log.load_reason(logged.errors) or log.load_reason(logged.warnings)) if failed else ""
            logged.release(failed=failed)
        if failed:
            raise ModelLoadError(str(self.path), f"libmtmd rejected the file: {reason or 'no reason given'}")
        self._ptr = ffi.gc(ptr, lib.mtmd_free)
        self.model = model
        model.register_dependent(self)
        if not lib.mtmd_support_vision(ptr):
            self.close()
            raise ModelLoadError(str(self.path), "the projector has no vision encoder (audio only?)")
        #: whether the text model places image embeddings by M-RoPE (Qwen-VL): each takes
        #: :data:`MROPE_SECTIONS` position values, and an image fewer positions than embeddings
        self.mrope: bool = bool(lib.mtmd_decode_use_mrope(ptr))
        #: the media marker a prompt carries where an image goes (``<__media__>``)
        self.marker: str = ffi.string(lib.mtmd_default_marker()).decode()
        #: the width of an image embedding (the text model's input width)
        self.n_embd: int = model.n_embd

    # -- lifetime -----------------------------------------------------------------------

    @property
    def ptr(self) -> Any:
        """The ``mtmd_context *``."""
        if self._ptr is None:
            raise ValueError("the mtmd context is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        """Free the context now (before its model). Idempotent."""
        if self._ptr is not None:
            with self._lock:
                self._ffi.release(self._ptr)
                self._ptr = None

    def __enter__(self) -> MtmdContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts --------------------------------------------------------------------------

    def tokenize(
        self,
        text: str,
        images: list[tuple[np.ndarray, str]],
        *,
        add_special: bool = True,
        parse_special: bool = True,
    ) -> list[TextChunk | ImageChunk]:
        """Split ``text`` at its markers (one per image, in order) into text and image chunks.

        ``images`` are ``(pixels, key)``: RGB ``uint8`` arrays ``(height, width, 3)`` and each
        one's content hash. Raises ValueError when the markers and the images disagree in
        number, or libmtmd cannot preprocess an image."""
        ffi, lib = self._ffi, self._lib
        n_markers = text.count(self.marker)
        if n_markers != len(images):
            raise ValueError(
                f"the prompt has {n_markers} image markers ({self.marker}) for {len(images)} images"
            )
        bitmaps = []
        for pixels, key in images:
            if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
                raise ValueError("an image must be a non-empty uint8 RGB array (height, width, 3)")
            data = np.ascontiguousarray(pixels)
            height, width = int(data.shape[0]), int(data.shape[1])
            bitmap = lib.mtmd_bitmap_init(width, height, ffi.from_buffer("unsigned char[]", data))
            if bitmap == ffi.NULL:
                raise ValueError("libmtmd could not take an image")
            bitmaps.append(ffi.gc(bitmap, lib.mtmd_bitmap_free))
            lib.mtmd_bitmap_set_id(bitmap, key.encode())
        encoded = text.encode("utf-8")
        text_buf = ffi.new("char[]", encoded)
        inp = ffi.new("mtmd_input_text *")
        inp.text = text_buf
        inp.text_len = len(encoded)
        inp.add_special = add_special
        inp.parse_special = parse_special
        array = ffi.new("mtmd_bitmap *[]", bitmaps) if bitmaps else ffi.NULL
        chunks = ffi.gc(lib.mtmd_input_chunks_init(), lib.mtmd_input_chunks_free)
        with self._lock:
            code = lib.mtmd_tokenize(self.ptr, chunks, inp, array, len(bitmaps))
        if code != 0:
            reason = {
                1: "the markers and the images disagree in number",
                2: "an image could not be preprocessed",
            }
            raise ValueError(f"libmtmd could not tokenize the prompt: {reason.get(code, f'error {code}')}")
        out: list[TextChunk | ImageChunk] = []
        i_image = 0
        for i in range(lib.mtmd_input_chunks_size(chunks)):
            chunk = lib.mtmd_input_chunks_get(chunks, i)
            kind = lib.mtmd_input_chunk_get_type(chunk)
            if kind == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ffi.new("size_t *")
                tokens = lib.mtmd_input_chunk_get_tokens_text(chunk, n)
                out.append(TextChunk(tuple(tokens[0 : n[0]])))
            elif kind == lib.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                owned = ffi.gc(lib.mtmd_input_chunk_copy(chunk), lib.mtmd_input_chunk_free)
                key = images[min(i_image, len(images) - 1)][1]
                i_image += 1
                out.append(
                    ImageChunk(
                        owned,
                        key,
                        int(lib.mtmd_input_chunk_get_n_tokens(chunk)),
                        int(lib.mtmd_input_chunk_get_n_pos(chunk)),
                    )
                )
            else:
                raise ValueError("libmtmd returned a chunk that is neither text nor image")
        ffi.release(chunks)
        return out

    # -- encoding -------------------------------------------------------------------------

    def encode(self, chunk: ImageChunk) -> np.ndarray:
        """The image's embeddings, ``(n_tokens, n_embd)`` float32 (a copy). Raises
        RuntimeError when the encoder fails."""
        ffi, lib = self._ffi, self._lib
        with self._lock:
            code = lib.mtmd_encode_chunk(self.ptr, chunk.handle)
            if code != 0:
                raise RuntimeError(f"libmtmd could not encode the image (error {code})")
            out = lib.mtmd_get_output_embd(self.ptr)
            n = chunk.n_tokens * self.n_embd
            return (
                np.frombuffer(ffi.buffer(out, n * 4), dtype=np.float32)
                .reshape(chunk.n_tokens, self.n_embd)
                .copy()
            )

    def encode_many(self, chunks: list[ImageChunk]) -> list[np.ndarray]:
        """The embeddings of every chunk, as :meth:`encode` gives them, in order (see
        :meth:`encode_runs`). Raises RuntimeError when the encoder fails."""
        return [embd for run in self.encode_runs(chunks) for embd in run]

    def encode_runs(self, chunks: list[ImageChunk]) -> Iterator[list[np.ndarray]]:
        """Encode ``chunks`` in order, in ``mtmd_batch`` runs: libmtmd puts several images
        into one encoder graph where the projector supports it (up to its token budget),
        otherwise a run holds one image. Yields each run's embeddings as it is done, so a
        caller can hand out the first images before the last are encoded. Raises
        RuntimeError when the encoder fails."""
        ffi, lib = self._ffi, self._lib
        pending = list(chunks)
        while pending:
            out: list[np.ndarray] = []
            with self._lock:
                batch = ffi.gc(lib.mtmd_batch_init(self.ptr), lib.mtmd_batch_free)
                run: list[ImageChunk] = []
                for chunk in pending:
                    code = lib.mtmd_batch_add_chunk(batch, chunk.handle)
                    if code == 0:
                        run.append(chunk)
                    elif code in (2, 3) and run:  # full, or another kind of image: next run
                        break
                    else:
                        raise RuntimeError(f"libmtmd could not batch the image (error {code})")
                if lib.mtmd_batch_encode(batch) != 0:
                    raise RuntimeError("libmtmd could not encode the images")
                for chunk in run:
                    embd = lib.mtmd_batch_get_output_embd(batch, chunk.handle)
                    if embd == ffi.NULL:
                        raise RuntimeError("libmtmd returned no embeddings for an image of the batch")
                    n = chunk.n_tokens * self.n_embd
                    out.append(
                        np.frombuffer(ffi.buffer(embd, n * 4), dtype=np.float32)
                        .reshape(chunk.n_tokens, self.n_embd)
                        .copy()
                    )
                ffi.release(batch)
            pending = pending[len(run) :]
            yield out

    def mrope_positions(self, chunk: ImageChunk, pos0: int) -> np.ndarray:
        """The M-RoPE positions of the image's embeddings placed from ``pos0``: an int32
        array ``(MROPE_SECTIONS, n_tokens)``, rows temporal, height, width and an unused zero
        row, as an embedding batch takes them (section-major)."""
        ffi, lib = self._ffi, self._lib
        out = np.zeros((MROPE_SECTIONS, chunk.n_tokens), dtype=np.int32)
        image = lib.mtmd_input_chunk_get_tokens_image(chunk.handle)
        if image == ffi.NULL:
            raise ValueError("the chunk is not an image")
        for i in range(chunk.n_tokens):
            # asked relative to 0: the same offsets whether libmtmd adds its pos_0 or not
            p = lib.mtmd_image_tokens_get_decoder_pos(image, 0, i)
            out[0, i], out[1, i], out[2, i] = p.t, p.y, p.x
        out[:3] += np.int32(pos0)
        return out

    def non_causal(self, chunk: ImageChunk) -> bool:
        """Whether the text model must attend over the whole image at once while decoding it
        (Gemma 3): its embeddings then go into one decode, with the causal mask off."""
        return bool(self._lib.mtmd_decode_use_non_causal(self.ptr, chunk.handle))

    def set_causal_attn(self, context: Any, causal: bool) -> None:
        """Switch the causal mask of ``context`` (a ``Context``) on or off."""
        ptr = self._ffi.cast("struct llama_context *", int(llama_ffi.cast("uintptr_t", context.ptr)))
        self._lib.llama_set_causal_attn(ptr, bool(causal))
