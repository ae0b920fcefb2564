"""``Model``: owner of a ``llama_model`` (and its vocabulary), with tokenization."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

from llamabatch._ffi import ensure_backend, ffi, lib, log
from llamabatch._ffi.cpu_backend import use_extra_bufts
from llamabatch.errors import ModelLoadError
from llamabatch.gguf.check import check_gguf
from llamabatch.validate import check_bool, check_positive_int

GGUF_MAGIC = b"GGUF"

LOAD_MODES = {
    "auto": lib.LLAMA_LOAD_MODE_AUTO,
    "none": lib.LLAMA_LOAD_MODE_NONE,
    "mmap": lib.LLAMA_LOAD_MODE_MMAP,
    "mlock": lib.LLAMA_LOAD_MODE_MLOCK,
    "mmap_mlock": lib.LLAMA_LOAD_MODE_MMAP_MLOCK,
    "direct_io": lib.LLAMA_LOAD_MODE_DIRECT_IO,
}

# enum llama_vocab_type (llama.h; the cdef declares only NONE)
_VOCAB_SPM, _VOCAB_BPE, _VOCAB_WPM, _VOCAB_UGM = 1, 2, 3, 4

POOLING_NAMES = {
    lib.LLAMA_POOLING_TYPE_UNSPECIFIED: "unspecified",
    lib.LLAMA_POOLING_TYPE_NONE: "none",
    lib.LLAMA_POOLING_TYPE_MEAN: "mean",
    lib.LLAMA_POOLING_TYPE_CLS: "cls",
    lib.LLAMA_POOLING_TYPE_LAST: "last",
    lib.LLAMA_POOLING_TYPE_RANK: "rank",
}


def _check_gguf_file(path: Path) -> None:
    """Fail early, with the file's name, on what llama.cpp would only log."""
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(str(path), "not a regular file")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(str(path), f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")


def _read_str(fn, *args: Any, size: int = 256) -> str | None:
    """Call a llama.cpp ``(..., char *buf, size_t size) -> int32`` getter, growing the buffer;
    None when the getter reports failure (a negative length)."""
    while True:
        buf = ffi.new("char[]", size)
        n = fn(*args, buf, size)
        if n < 0:
            return None
        if n < size:
            return ffi.string(buf, n).decode("utf-8", "replace")
        size = n + 1


class Model:
    """A GGUF model loaded by llama.cpp.

    Args:
        path: the ``.gguf`` file.
        n_gpu_layers: layers to offload to a GPU (-1: all; ignored by CPU builds).
        load_mode: ``"mmap"`` (default), ``"none"`` (read into memory), ``"mlock"``,
            ``"mmap_mlock"``, ``"direct_io"`` or ``"auto"``.
        vocab_only: load only the vocabulary (tokenization without weights).
        check_tensors: validate tensor data while loading.
        main_gpu: the GPU that holds the whole model when not splitting.
        validate: check the file with :func:`llamabatch.gguf.check.check_gguf` before
            llama.cpp reads it (default). llama.cpp aborts the process on some inconsistent
            files; ``False`` skips the check (for files known to be good, or to see what
            llama.cpp itself says).

    Raises:
        FileNotFoundError: the file does not exist.
        ModelLoadError: the file is not a GGUF, is truncated, corrupt, inconsistent or
            unsupported; the message names the key or tensor at fault, or carries llama.cpp's
            own reason when llama.cpp rejects the file.
        ValueError: an invalid parameter.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = 0,
        load_mode: str = "mmap",
        vocab_only: bool = False,
        check_tensors: bool = False,
        main_gpu: int = 0,
        validate: bool = True,
    ) -> None:
        self._ptr = ffi.NULL
        self._contexts: weakref.WeakSet[Any] = weakref.WeakSet()
        #: LoRA adapters loaded for this model (``_ffi/lora.py``), freed before it
        self._adapters: weakref.WeakSet[Any] = weakref.WeakSet()
        self.path = Path(path)
        if not isinstance(load_mode, str) or load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {sorted(LOAD_MODES)}, got {load_mode!r}")
        # int32 in llama_model_params: a larger value would be cffi's OverflowError
        n_gpu_layers = check_positive_int("n_gpu_layers", n_gpu_layers, minimum=-1)  # -1: all
        main_gpu = check_positive_int("main_gpu", main_gpu, minimum=0)
        vocab_only = check_bool("vocab_only", vocab_only)
        check_tensors = check_bool("check_tensors", check_tensors)
        validate = check_bool("validate", validate)
        _check_gguf_file(self.path)
        if validate:
            check_gguf(self.path, vocab_only=vocab_only)
        ensure_backend()
        log.install()  # ours again (another binding may have taken it), at the level asked for now

        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.load_mode = LOAD_MODES[load_mode]
        params.vocab_only = vocab_only
        params.check_tensors = check_tensors
        params.main_gpu = main_gpu
        params.use_extra_bufts = use_extra_bufts()  # not on AMX builds (_ffi/cpu_backend.py)
        with log.capture() as logged:
            ptr = lib.llama_model_load_from_file(os.fsencode(self.path), params)
            failed = ptr == ffi.NULL
            # on failure llama.cpp's own lines go into the exception, not to the log
            reason = (log.load_reason(logged.errors) or log.load_reason(logged.warnings)) if failed else ""
            logged.release(failed=failed)
        if failed:
            reason = reason or "no reason given"
            raise ModelLoadError(str(self.path), f"llama.cpp rejected the file: {reason}")
        self._ptr = ffi.gc(ptr, lib.llama_model_free)
        self._vocab = lib.llama_model_get_vocab(ptr)
        #: False for files without a vocabulary (tokenizer "none"): llama.cpp aborts on
        #: tokenizing with one, so the token methods raise ValueError instead.
        self.has_vocab: bool = lib.llama_vocab_type(self._vocab) != lib.LLAMA_VOCAB_TYPE_NONE
        if validate:
            self._check_vocab_resolved()
        self.vocab_only = vocab_only
        self.n_vocab: int = lib.llama_vocab_n_tokens(self._vocab)
        self.architecture: str = self.meta("general.architecture") or ""
        if vocab_only:
            # Without weights llama.cpp has no hyperparameters to report: some getters
            # abort the process. Read what the GGUF says instead.
            self.n_embd = self._meta_int("embedding_length")
            self.n_ctx_train = self._meta_int("context_length")
            self.n_layer = self._meta_int("block_count")
            self.n_head = self._meta_int("attention.head_count")
            self.n_head_kv = self._meta_int("attention.head_count_kv") or self.n_head
            #: sliding-window attention's window in positions (0: none): its KV cache keeps
            #: only each sequence's last positions
            self.n_swa: int = self._meta_int("attention.sliding_window")
            self.size = self.n_params = self.n_cls_out = 0
            self.description = f"{self.architecture} (vocabulary only)"
            self.has_encoder = self.has_decoder = self.is_recurrent = self.is_hybrid = False
        else:
            self.n_embd = lib.llama_model_n_embd(ptr)
            self.n_ctx_train = lib.llama_model_n_ctx_train(ptr)
            self.n_layer = lib.llama_model_n_layer(ptr)
            self.n_head = lib.llama_model_n_head(ptr)
            self.n_head_kv = lib.llama_model_n_head_kv(ptr)
            self.n_swa = lib.llama_model_n_swa(ptr)
            self.size = lib.llama_model_size(ptr)
            self.n_params = lib.llama_model_n_params(ptr)
            self.description = _read_str(lib.llama_model_desc, ptr) or ""
            self.has_encoder = bool(lib.llama_model_has_encoder(ptr))
            self.has_decoder = bool(lib.llama_model_has_decoder(ptr))
            self.is_recurrent = bool(lib.llama_model_is_recurrent(ptr))
            self.is_hybrid = bool(lib.llama_model_is_hybrid(ptr))
            self.n_cls_out = lib.llama_model_n_cls_out(ptr)
        tmpl = lib.llama_model_chat_template(ptr, ffi.NULL)
        self.chat_template: str | None = (
            ffi.string(tmpl).decode("utf-8", "replace") if tmpl != ffi.NULL else None
        )
        self.bos: int = lib.llama_vocab_bos(self._vocab)
        self.eos: int = lib.llama_vocab_eos(self._vocab)
        self.eot: int = lib.llama_vocab_eot(self._vocab)
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(self._vocab))
        self.add_eos: bool = bool(lib.llama_vocab_get_add_eos(self._vocab))
        #: fill-in-the-middle tokens (prefix, suffix, middle, repository, file separator; -1:
        #: none), which ``/infill`` needs (``prompts/infill.py``)
        self.fim: dict[str, int] = {
            "pre": lib.llama_vocab_fim_pre(self._vocab),
            "suf": lib.llama_vocab_fim_suf(self._vocab),
            "mid": lib.llama_vocab_fim_mid(self._vocab),
            "rep": lib.llama_vocab_fim_rep(self._vocab),
            "sep": lib.llama_vocab_fim_sep(self._vocab),
        }

    # -- lifetime -----------------------------------------------------------------------

    @property
    def ptr(self):
        """The ``llama_model *`` (for the binding's other owners)."""
        if self._ptr == ffi.NULL:
            raise ValueError("the model is closed")
        return self._ptr

    @property
    def vocab(self):
        """The ``const llama_vocab *``."""
        self.ptr  # noqa: B018 - raises when closed
        return self._vocab

    @property
    def closed(self) -> bool:
        return self._ptr == ffi.NULL

    def register_dependent(self, owner: Any) -> None:
        """Close ``owner`` (an object with ``close()`` that holds this model's pointer: a
        ``Context``, an ``MtmdContext``) before this model is freed."""
        self._contexts.add(owner)

    def register_adapter(self, adapter: Any) -> None:
        """Record a LoRA adapter loaded for this model: ``close`` frees it first."""
        self._adapters.add(adapter)

    def close(self) -> None:
        """Free the model now (and any context or LoRA adapter still using it). Idempotent."""
        if self._ptr == ffi.NULL:
            return
        for context in list(self._contexts):
            context.close()
        for adapter in list(self._adapters):
            adapter.close()
        ffi.release(self._ptr)
        self._ptr = ffi.NULL
        self._vocab = ffi.NULL

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.description!r}"
        return f"<llamabatch.Model {self.path.name} {state}>"

    def _check_vocab_resolved(self) -> None:
        """What llama.cpp made of the vocabulary: the special tokens its tokenizer adds must
        exist, or llama.cpp asserts at the first tokenization (SentencePiece, BPE and Unigram
        add BOS / EOS when the file says so; WordPiece always adds CLS, its BOS, and SEP).
        The ids are llama.cpp's own, its per-tokenizer defaults applied."""
        vocab = self._vocab
        if not self.has_vocab:
            return  # tokenize() refuses a model without a vocabulary
        kind = lib.llama_vocab_type(vocab)
        bos = ("tokenizer.ggml.bos_token_id", "BOS", lib.llama_vocab_bos)
        eos = ("tokenizer.ggml.eos_token_id", "EOS", lib.llama_vocab_eos)
        sep = ("tokenizer.ggml.seperator_token_id", "SEP", lib.llama_vocab_sep)
        needed = []
        if kind in (_VOCAB_SPM, _VOCAB_BPE, _VOCAB_UGM):
            needed += [bos] if lib.llama_vocab_get_add_bos(vocab) else []
            needed += [eos] if lib.llama_vocab_get_add_eos(vocab) else []
        elif kind == _VOCAB_WPM:
            needed += [bos, sep]
        for key, name, token in needed:
            if token(vocab) < 0:
                self.close()
                raise ModelLoadError(
                    str(self.path), f"{key}: missing, but the tokenizer adds a {name} token to every text"
                )

    # -- metadata -----------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        """One GGUF metadata value as a string, or None when absent."""
        return _read_str(lib.llama_model_meta_val_str, self.ptr, key.encode())

    def _meta_int(self, key: str) -> int:
        value = self.meta(f"{self.architecture}.{key}")
        try:
            return int(value) if value is not None else 0
        except ValueError:
            return 0

    def metadata(self) -> dict[str, str]:
        """Every GGUF metadata key and value (arrays are summarised by llama.cpp)."""
        out = {}
        for i in range(lib.llama_model_meta_count(self.ptr)):
            key = _read_str(lib.llama_model_meta_key_by_index, self.ptr, i) or ""
            out[key] = _read_str(lib.llama_model_meta_val_str_by_index, self.ptr, i) or ""
        return out

    @property
    def generates_text(self) -> bool:
        """Whether the model can generate text: a decoder-only model with causal attention
        (llama.cpp reports BERT-like encoders as decoders with bidirectional attention)."""
        causal = self.meta(f"{self.architecture}.attention.causal")
        if self.architecture in ("bert", "nomic-bert", "jina-bert-v2", "modern-bert", "neo-bert"):
            causal = causal or "false"
        return self.has_decoder and not self.has_encoder and (causal or "true").lower() not in ("false", "0")

    @property
    def pooling_type(self) -> str:
        """The pooling the GGUF declares (``mean``, ``cls``, ``last``, ``rank``, ``none``)."""
        value = self.meta(f"{self.architecture}.pooling_type")
        if value is None:
            return "unspecified"
        try:
            return POOLING_NAMES.get(int(value), "unspecified")
        except ValueError:
            return "unspecified"

    @property
    def has_classifier_head(self) -> bool:
        """Whether the file holds a classification head (tensor ``cls.weight`` or
        ``cls.output.weight``), which llama.cpp's rank pooling applies; without one, rank
        pooling returns a component of the hidden state. llama.h lists no tensors, so the
        file's header (every part of a split model) is read with ``gguf/reader.py``."""
        if getattr(self, "_has_cls", None) is None:
            import re

            from llamabatch.gguf.reader import tensor_names

            paths = [self.path]
            split = re.fullmatch(r"(.*)-\d{5}-of-(\d{5})\.gguf", self.path.name)
            if split is not None:  # llama.cpp's split naming: the head may be in any part
                prefix, n = split.group(1), int(split.group(2))
                paths = [self.path.with_name(f"{prefix}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
            heads = {"cls.weight", "cls.output.weight"}
            names = (name for path in paths if path.is_file() for name in tensor_names(path))
            self._has_cls = any(name in heads for name in names)
        return bool(self._has_cls)

    # -- tokens -------------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokenize ``text``; ``add_special`` adds BOS/EOS as the model wants, ``parse_special``
        turns special-token text such as ``<|im_start|>`` into those tokens."""
        self._check_has_vocab()
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n_max = len(data) + 8
        while True:
            tokens = ffi.new("llama_token[]", n_max)
            n = lib.llama_tokenize(self.vocab, data, len(data), tokens, n_max, add_special, parse_special)
            if n >= 0:
                return list(ffi.unpack(tokens, n))
            if -n <= n_max:  # pragma: no cover - llama.cpp reports overflow as -needed
                raise RuntimeError(f"llama_tokenize failed ({n}) on {len(data)} bytes")
            n_max = -n

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character); ``special`` renders
        control tokens as their text."""
        self._check_token(token)
        buf = ffi.new("char[]", 64)
        n = lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return ffi.unpack(buf, n)

    def detokenize(
        self, tokens: list[int], remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        """Text of ``tokens`` (invalid UTF-8 replaced)."""
        for token in tokens:
            self._check_token(token)
        arr = ffi.new("llama_token[]", list(tokens))
        size = max(16, 8 * len(tokens))
        while True:
            buf = ffi.new("char[]", size)
            n = lib.llama_detokenize(self.vocab, arr, len(tokens), buf, size, remove_special, unparse_special)
            if n >= 0:
                return ffi.unpack(buf, n).decode("utf-8", "replace")
            size = -n

    def token_text(self, token: int) -> str:
        """The vocabulary entry of ``token`` as stored in the GGUF."""
        self._check_token(token)
        return ffi.string(lib.llama_vocab_get_text(self.vocab, token)).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        return bool(lib.llama_vocab_is_eog(self.vocab, token))

    def eog_flags(self) -> bytearray:
        """One byte per token id: 1 for end-of-generation tokens (a fast per-token lookup)."""
        vocab = self.vocab
        return bytearray(lib.llama_vocab_is_eog(vocab, t) for t in range(self.n_vocab))

    def _check_has_vocab(self) -> None:
        if not self.has_vocab:
            raise ValueError(f"{self.path.name} has no vocabulary (tokenizer 'none'): it cannot tokenize")

    def _check_token(self, token: int) -> None:
        self._check_has_vocab()
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} out of range [0, {self.n_vocab})")
