"""``Context``: owner of a ``llama_context`` — decode/encode, outputs and KV memory.

``check_decode`` is the ONE place that maps llama.cpp's decode return codes to Python.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import numpy as np

from llamabatch._ffi import ffi, lib, log
from llamabatch._ffi.kv_types import check_kv_types, kv_type
from llamabatch._ffi.model import POOLING_NAMES, Model
from llamabatch.errors import ContextError, DecodeError, KVCacheFull
from llamabatch.validate import check_bool, check_positive_int

POOLING_TYPES = {name: value for value, name in POOLING_NAMES.items()}

FLASH_ATTN = {
    None: lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


class DecodeCode(enum.IntEnum):
    """``llama_decode`` / ``llama_encode`` return codes: the ONE definition of their meaning.

    ``of(code)`` maps any int (unknown negative codes are ``FATAL``); ``retryable`` codes
    mean "no memory for this batch": a smaller batch, or freed cells, may succeed.
    """

    OK = 0
    NO_KV_SLOT = 1  # no room in the KV cache for the batch
    ABORTED = 2  # the abort callback stopped the computation
    INVALID_BATCH = -1  # a token, position or seq_id llama.cpp rejects
    ALLOC_FAILED = -2  # could not allocate the compute buffers (encoders, embeddings)
    FATAL = -3  # a failed graph compute, or any other negative code

    @classmethod
    def of(cls, code: int) -> DecodeCode:
        try:
            return cls(code)
        except ValueError:
            return cls.FATAL if code < 0 else cls.NO_KV_SLOT

    @property
    def retryable(self) -> bool:
        return self in (DecodeCode.NO_KV_SLOT, DecodeCode.ALLOC_FAILED)

    def error(self, what: str = "llama_decode", code: int | None = None) -> DecodeError | None:
        """The exception for this code (None for OK); ``code``: the raw value, when known."""
        raw = int(self) if code is None else code
        if self is DecodeCode.OK:
            return None
        if self is DecodeCode.NO_KV_SLOT:
            return KVCacheFull(raw, f"{what}: no room in the KV cache for the batch (code {raw})")
        reason = {
            DecodeCode.ABORTED: "aborted",
            DecodeCode.INVALID_BATCH: "invalid input batch",
            DecodeCode.ALLOC_FAILED: "could not allocate compute memory",
        }.get(self, "fatal error")
        return DecodeError(raw, f"{what}: {reason} (code {raw})")


def decode_error(code: int, what: str = "llama_decode") -> DecodeError | None:
    """Map a ``llama_decode``/``llama_encode`` return code to an exception (None for 0)."""
    return DecodeCode.of(code).error(what, code)


def check_decode(code: int, what: str = "llama_decode") -> None:
    """Raise the exception for a non-zero return code."""
    error = decode_error(code, what)
    if error is not None:
        raise error


def max_parallel_sequences() -> int:
    """llama.cpp's upper bound on ``n_seq_max`` (``LLAMA_MAX_SEQ``)."""
    return int(lib.llama_max_parallel_sequences())


#: ggml's GGML_MAX_N_THREADS: more threads than this overflow ggml's per-thread tables
#: (far more make OpenMP crash the process).
MAX_THREADS = 512
#: llama.cpp pads n_ctx (and, with one KV stream per sequence, each stream) to this.
_CTX_PAD = 256
#: Host bytes llama.cpp allocates per KV cell (position, shift, sequence bitset) and per
#: batch token (output ids), whatever the model: lower bounds.
_CELL_BYTES = 48
_BATCH_TOKEN_BYTES = 4


def _pad(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _check_sizes(
    model: Model,
    n_ctx: object,
    n_batch: object,
    n_ubatch: object,
    n_seq_max: object,
    n_threads: object,
    n_threads_batch: object,
) -> tuple[int, int, int, int, int, int]:
    """The size parameters as ints, each checked to fit its C type (``ValueError`` naming it)."""
    n_ctx = check_positive_int("n_ctx", n_ctx)
    n_batch = check_positive_int("n_batch", n_batch)
    n_ubatch = n_batch if n_ubatch is None else check_positive_int("n_ubatch", n_ubatch)
    if n_ubatch > n_batch:
        raise ValueError(f"n_ubatch ({n_ubatch}) must be <= n_batch ({n_batch})")
    n_seq_max = check_positive_int("n_seq_max", n_seq_max, maximum=max_parallel_sequences())
    n_threads = check_positive_int("n_threads", n_threads, allow_none=True, maximum=MAX_THREADS)
    n_threads_batch = check_positive_int(
        "n_threads_batch", n_threads_batch, allow_none=True, maximum=MAX_THREADS
    )
    n_threads = min(os.cpu_count() or 1, MAX_THREADS) if n_threads is None else n_threads
    n_threads_batch = n_threads if n_threads_batch is None else n_threads_batch
    return n_ctx, n_batch, n_ubatch, n_seq_max, n_threads, n_threads_batch  # type: ignore[return-value]


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not on this platform
        return None


def _check_host_memory(cells: int, batch: int, n_ctx: int, n_batch: int) -> None:
    """Refuse sizes whose fixed host-side bookkeeping alone would take more than a quarter of
    the machine's memory: llama.cpp zero-fills it at once (~48 bytes per KV cell, 4 per batch
    token, before the KV cache itself), so an absurd ``n_ctx`` or ``n_batch`` would otherwise
    touch gigabytes before failing with ``std::bad_alloc``, or get the process OOM-killed."""
    memory = _physical_memory()
    if not memory:
        return
    need = cells * _CELL_BYTES + batch * _BATCH_TOKEN_BYTES
    if need > memory // 4:
        by_ctx = cells * _CELL_BYTES >= batch * _BATCH_TOKEN_BYTES
        name, value = ("n_ctx", n_ctx) if by_ctx else ("n_batch", n_batch)
        raise ValueError(
            f"{name}={value} is too large for this machine: it needs at least {need / 2**30:.1f} GiB "
            f"of host memory for llama.cpp's bookkeeping alone (before the KV cache), more than a "
            f"quarter of the {memory / 2**30:.1f} GiB there is"
        )


def _check_llama_asserts(
    model: Model,
    n_ctx: int,
    n_batch: int,
    n_ubatch: int,
    n_seq_max: int,
    embeddings: bool,
    pooling: str | None,
    kv_unified: bool,
) -> None:
    """Refuse size combinations that make llama.cpp's context constructor abort the process
    (GGML_ASSERT), with a ``ValueError`` naming the parameters.

    The sizes llama.cpp derives (llama_context's constructor): with causal attention a
    batch never exceeds ``n_ctx``; ``n_ubatch`` never exceeds the batch; ``n_ctx`` is padded
    to 256, and with one KV stream per sequence each stream is.
    """
    causal = model.meta(f"{model.architecture}.attention.causal") != "false"
    batch = min(n_ctx, n_batch) if causal else n_batch
    ubatch = min(batch, n_ubatch)
    # One output row per sequence is reserved up front, out of at most one batch of outputs.
    if n_seq_max > batch:
        if batch < n_batch:
            raise ValueError(
                f"n_seq_max ({n_seq_max}) must be <= n_ctx ({n_ctx}): llama.cpp caps a batch at n_ctx "
                "tokens and needs room for one output per sequence in it"
            )
        raise ValueError(
            f"n_seq_max ({n_seq_max}) must be <= n_batch ({n_batch}): llama.cpp needs room for one "
            "output per sequence in a batch"
        )
    ctx = _pad(n_ctx, _CTX_PAD)
    if not kv_unified:
        ctx = _pad(ctx // n_seq_max, _CTX_PAD) * n_seq_max
    _check_host_memory(ctx if causal else 0, batch, n_ctx, n_batch)
    # Mean pooling's graph is reserved for a ubatch split evenly across n_seq_max sequences.
    resolved = pooling if pooling is not None else model.pooling_type
    if embeddings and resolved == "mean":
        reserve = min(ctx, ubatch)
        if reserve % n_seq_max:
            if reserve == n_ubatch:
                what = f"n_ubatch ({n_ubatch})"
            elif reserve == ubatch:  # causal attention: n_ctx caps the batch
                what = f"n_ctx ({n_ctx}, which caps n_batch and n_ubatch)"
            else:
                what = f"n_ctx as llama.cpp pads it ({reserve}, below n_ubatch)"
            raise ValueError(
                f"with mean pooling, {what} must be a multiple of n_seq_max ({n_seq_max}): llama.cpp "
                "reserves its graph for that many tokens split evenly across n_seq_max sequences"
            )


class Context:
    """A llama.cpp context on a :class:`Model`: KV memory, decode, logits and embeddings.

    Only one thread may use a context at a time; llamabatch's engines give each context
    to one worker thread.
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        embeddings: bool = False,
        pooling: str | None = None,
        flash_attn: bool | str | None = None,
        kv_unified: bool = True,
        offload_kqv: bool = True,
        no_perf: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
    ) -> None:
        self._ptr = ffi.NULL
        log.install()  # ours again (another binding may have taken it), at the level asked for now
        #: the LoRA adapter set on this context and its scales (``_ffi/lora.py``: ``set_adapters``)
        self.adapters: tuple[Any, ...] = ()
        self.adapter_scales: tuple[float, ...] = ()
        if model.vocab_only:
            raise ValueError(
                f"{model.path.name} was loaded with vocab_only=True: it has no weights to compute with"
            )
        n_ctx, n_batch, n_ubatch, n_seq_max, n_threads, n_threads_batch = _check_sizes(
            model, n_ctx, n_batch, n_ubatch, n_seq_max, n_threads, n_threads_batch
        )
        embeddings = check_bool("embeddings", embeddings)
        kv_unified = check_bool("kv_unified", kv_unified)
        offload_kqv = check_bool("offload_kqv", offload_kqv)
        no_perf = check_bool("no_perf", no_perf)
        if pooling is not None and (not isinstance(pooling, str) or pooling not in POOLING_TYPES):
            raise ValueError(f"pooling must be None or one of {sorted(POOLING_TYPES)}, got {pooling!r}")
        if not (
            flash_attn is None
            or isinstance(flash_attn, (bool, np.bool_))
            or (isinstance(flash_attn, str) and flash_attn == "auto")
        ):
            raise ValueError(f"flash_attn must be True, False, 'auto' or None, got {flash_attn!r}")
        flash_attn = bool(flash_attn) if isinstance(flash_attn, np.bool_) else flash_attn
        ggml_type_k, ggml_type_v = check_kv_types(model, type_k, type_v, flash_attn)
        _check_llama_asserts(model, n_ctx, n_batch, n_ubatch, n_seq_max, embeddings, pooling, kv_unified)

        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch
        params.embeddings = embeddings
        if pooling is not None:
            params.pooling_type = POOLING_TYPES[pooling]
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        params.kv_unified = kv_unified
        params.type_k = ggml_type_k
        params.type_v = ggml_type_v
        params.offload_kqv = offload_kqv
        params.no_perf = no_perf

        ptr = lib.llama_init_from_model(model.ptr, params)
        if ptr == ffi.NULL:
            raise ContextError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={n_batch}, "
                f"n_ubatch={n_ubatch}, n_seq_max={n_seq_max}) for {model.path.name}: "
                "likely out of memory for the KV cache, or parameters the model does not support"
            )
        self.model = model
        self._ptr = ffi.gc(ptr, lib.llama_free)
        model.register_dependent(self)
        self._memory = lib.llama_get_memory(ptr)
        # False for models llama.cpp runs without KV memory (BERT-like encoders): a whole
        # batch must then fit in one ubatch, or llama.cpp aborts the process.
        self.has_memory: bool = self._memory != ffi.NULL
        # A C-level flag read by llama.cpp between graph nodes (CPU backend): abort()
        # makes a running or the next llama_decode return 2 without touching Python.
        self._abort_flag = ffi.new("int *", 0)
        lib.llama_set_abort_callback(ptr, ffi.addressof(lib, "llamabatch_abort_flag_cb"), self._abort_flag)
        self.n_ctx: int = lib.llama_n_ctx(ptr)
        self.n_ctx_seq: int = lib.llama_n_ctx_seq(ptr)
        self.n_batch: int = lib.llama_n_batch(ptr)
        self.n_ubatch: int = lib.llama_n_ubatch(ptr)
        self.n_seq_max: int = lib.llama_n_seq_max(ptr)
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch
        self.embeddings = embeddings
        self.kv_unified = kv_unified
        #: the KV cache element types (llama.cpp's names)
        self.type_k: str = kv_type("type_k", type_k).name
        self.type_v: str = kv_type("type_v", type_v).name
        self.pooling: str = POOLING_NAMES.get(lib.llama_pooling_type(ptr), "unspecified")

    # -- lifetime -----------------------------------------------------------------------

    @property
    def ptr(self):
        """The ``llama_context *``."""
        if self._ptr == ffi.NULL:
            raise ValueError("the context is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr == ffi.NULL

    def close(self) -> None:
        """Free the context now. Idempotent."""
        if self._ptr != ffi.NULL:
            ffi.release(self._ptr)
            self._ptr = ffi.NULL
            self._memory = ffi.NULL

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abort(self) -> None:
        """Make the running (or next) decode return 2 ("aborted"); safe from any thread."""
        self._abort_flag[0] = 1

    def clear_abort(self) -> None:
        self._abort_flag[0] = 0

    # -- compute ------------------------------------------------------------------------

    def decode_address(self, batch_address: int) -> int:
        """``llama_decode`` on the ``llama_batch`` struct at ``batch_address`` (a batch from
        the core's pool); returns llama.cpp's code. The GIL is released during the call."""
        return lib.llama_decode(self.ptr, ffi.cast("llama_batch *", batch_address)[0])

    def encode_address(self, batch_address: int) -> int:
        """``llama_encode`` (encoder models) on the batch at ``batch_address``."""
        return lib.llama_encode(self.ptr, ffi.cast("llama_batch *", batch_address)[0])

    def decode_tokens(
        self, tokens: list[int], pos0: int = 0, seq_id: int = 0, all_logits: bool = False
    ) -> None:
        """Decode one sequence's tokens in one batch (simple paths and tests); raises on error."""
        n = len(tokens)
        if n == 0:
            raise ValueError("no tokens to decode")
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = 1 if (all_logits or i == n - 1) else 0
            check_decode(lib.llama_decode(self.ptr, batch))
        finally:
            lib.llama_batch_free(batch)

    def logits_ith(self, i: int) -> np.ndarray:
        """A copy of the logits of output ``i`` of the last decode (batch index)."""
        return self.logits_view(i).copy()

    def logits_rows(self, n_rows: int) -> np.ndarray:
        """The last decode's output logits as an ``(n_rows, n_vocab)`` view, rows in batch
        order (no copy: valid until the next decode)."""
        ptr = lib.llama_get_logits(self.ptr)
        if ptr == ffi.NULL:
            raise IndexError("no logits from the last decode")
        buf = ffi.buffer(ptr, 4 * n_rows * self.model.n_vocab)
        return np.frombuffer(buf, dtype=np.float32).reshape(n_rows, self.model.n_vocab)

    def logits_block(self, i: int, n_rows: int) -> np.ndarray:
        """The logits of batch indices ``i .. i + n_rows - 1``, every one an output of the last
        decode, as an ``(n_rows, n_vocab)`` view (outputs are stored in batch order)."""
        ptr = lib.llama_get_logits_ith(self.ptr, i)
        if ptr == ffi.NULL:
            raise IndexError(f"no logits at batch index {i}")
        buf = ffi.buffer(ptr, 4 * n_rows * self.model.n_vocab)
        return np.frombuffer(buf, dtype=np.float32).reshape(n_rows, self.model.n_vocab)

    def logits_view(self, i: int) -> np.ndarray:
        """The logits at batch index ``i`` of the last decode, as a view (no copy: valid
        until the next decode)."""
        ptr = lib.llama_get_logits_ith(self.ptr, i)
        if ptr == ffi.NULL:
            raise IndexError(f"no logits at batch index {i}")
        return np.frombuffer(ffi.buffer(ptr, 4 * self.model.n_vocab), dtype=np.float32)

    def embeddings_seq(self, seq_id: int, n: int | None = None) -> np.ndarray | None:
        """A copy of the pooled embedding of ``seq_id`` (``n`` floats: n_embd, or n_cls_out
        for rank pooling), or None when the context does not pool."""
        ptr = lib.llama_get_embeddings_seq(self.ptr, seq_id)
        if ptr == ffi.NULL:
            return None
        n = self.model.n_embd if n is None else n
        return np.frombuffer(ffi.buffer(ptr, 4 * n), dtype=np.float32).copy()

    def embeddings_ith(self, i: int) -> np.ndarray:
        """A copy of the embedding of output ``i`` of the last decode."""
        ptr = lib.llama_get_embeddings_ith(self.ptr, i)
        if ptr == ffi.NULL:
            raise IndexError(f"no embedding at batch index {i}")
        return np.frombuffer(ffi.buffer(ptr, 4 * self.model.n_embd), dtype=np.float32).copy()

    # -- KV memory ----------------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (-1: open end; seq_id -1: all)."""
        return bool(lib.llama_memory_seq_rm(self._memory_or_raise(), seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s cells at positions [p0, p1)."""
        lib.llama_memory_seq_cp(self._memory_or_raise(), src, dst, p0, p1)

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in the KV cache, -1 when it holds none: above 0
        when a sliding-window cache has dropped the sequence's early positions (every
        position from it to ``seq_pos_max`` is held)."""
        return lib.llama_memory_seq_pos_min(self._memory_or_raise(), seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in the KV cache, -1 when it holds none."""
        return lib.llama_memory_seq_pos_max(self._memory_or_raise(), seq_id)

    def memory_clear(self, data: bool = True) -> None:
        lib.llama_memory_clear(self._memory_or_raise(), data)

    # -- sequence state (host-RAM prompt cache, persistent prefixes) ---------------------

    def state_seq_get(self, seq_id: int, max_bytes: int | None = None) -> bytearray:
        """The state of ``seq_id`` (its KV cells, with their positions), in llama.cpp's
        format for ``state_seq_set``; empty when it cannot be copied or would take more than
        ``max_bytes``. A bytearray: llama.cpp writes into it directly (a state is tens of
        megabytes; a second copy doubled the time a RAM-tier save or a layout switch took)."""
        ptr = self.ptr
        size = lib.llama_state_seq_get_size(ptr, seq_id)
        if size == 0 or (max_bytes is not None and size > max_bytes):
            return bytearray()
        out = bytearray(size)
        n = lib.llama_state_seq_get_data(ptr, ffi.from_buffer(out), size, seq_id)
        del out[n:]
        return out

    def state_seq_set(self, seq_id: int, data: bytes | bytearray) -> bool:
        """Load ``data`` (from ``state_seq_get`` of a context of the same model and KV
        layout) into the empty ``seq_id``; False when llama.cpp refuses it (no room, or a
        layout that does not match: then ``seq_id`` holds nothing)."""
        if not data:
            return False
        src = ffi.from_buffer("uint8_t[]", data)
        ok = lib.llama_state_seq_set_data(self.ptr, src, len(data), seq_id) != 0
        if not ok:
            self.seq_rm(seq_id, -1, -1)
        return ok

    def _memory_or_raise(self):
        self.ptr  # noqa: B018 - raises when closed
        return self._memory
