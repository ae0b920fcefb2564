"""Pinned prefixes that survive a restart (``LLM(prefix_cache_dir=PATH)``).

When a pinned prefix (``LLM.register_prefix``) has been computed, its sequence state
(``llama_state_seq_get_data``) is written to a file in ``prefix_cache_dir``; when the same
model, with the same KV layout, pins the same tokens again (after a restart too), the file
is loaded into the pinned sequence instead of computing the prefix.

A file is untrusted input. Before llama.cpp sees a byte, ``read_prefix_file`` checks the
whole file: magic, version, exact length, a SHA-256 checksum over everything before it,
the model identity, the KV layout, the token count and the tokens themselves. A file that
fails any check raises ``PrefixFileError`` (a ``ValueError``), is logged and counted
(``prefix_files_refused``), and the prefix is computed as if there were no file (then
written again). llama.cpp's own refusal of the payload (``llama_state_seq_set_data``
returning 0) is handled the same way. Files are written atomically (a temporary file in
the same directory, then ``os.replace``).

File layout (little-endian)::

    magic      8 bytes  b"LBPREFIX"
    version    u32      1
    model_id   32 bytes SHA-256 of the GGUF (see ``model_identity``)
    layout_len u32, layout (UTF-8, <= 256 bytes): the options that change the state's bytes
    n_tokens   u32
    n_payload  u64
    tokens     n_tokens x i32
    payload    n_payload bytes (llama_state_seq_get_data)
    checksum   32 bytes SHA-256 of all the above
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

logger = logging.getLogger("llamabatch")

MAGIC = b"LBPREFIX"
VERSION = 1
SUFFIX = ".lbprefix"
_HEAD = struct.Struct("<8sI32sI")  # magic, version, model id, layout length
_SIZES = struct.Struct("<IQ")  # n_tokens, n_payload
_SUM = 32
MAX_LAYOUT = 256
#: bytes of the GGUF's start and end hashed into its identity (header, metadata, tensor
#: infos; the last tensor data), with its size
IDENTITY_HEAD = 4 << 20
IDENTITY_TAIL = 1 << 20


class PrefixFileError(ValueError):
    """A prefix file that cannot be used (corrupt, truncated, another model or layout)."""


def model_identity(path: str | os.PathLike[str]) -> bytes:
    """SHA-256 over a GGUF file's size, its first 4 MiB and its last 1 MiB."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(struct.pack("<Q", size))
    with open(path, "rb") as f:
        digest.update(f.read(IDENTITY_HEAD))
        if size > IDENTITY_HEAD:
            f.seek(max(IDENTITY_HEAD, size - IDENTITY_TAIL))
            digest.update(f.read(IDENTITY_TAIL))
    return digest.digest()


def encode_prefix_file(model_id: bytes, layout: str, tokens: np.ndarray | list[int], payload: bytes) -> bytes:
    """The bytes of a prefix file (see the module doc)."""
    layout_bytes = layout.encode()
    if len(model_id) != 32 or len(layout_bytes) > MAX_LAYOUT:
        raise ValueError("model_id must be 32 bytes and layout at most 256 bytes")
    toks = np.asarray(tokens, dtype="<i4")
    body = b"".join(
        (
            _HEAD.pack(MAGIC, VERSION, model_id, len(layout_bytes)),
            layout_bytes,
            _SIZES.pack(len(toks), len(payload)),
            toks.tobytes(),
            payload,
        )
    )
    return body + hashlib.sha256(body).digest()


def read_prefix_file(
    data: bytes, model_id: bytes, layout: str, tokens: np.ndarray | list[int] | None = None
) -> tuple[np.ndarray, bytes]:
    """``(tokens, payload)`` of a prefix file's bytes, checked against the model, the layout
    and (if given) the expected tokens; ``PrefixFileError`` naming the first problem."""
    n = len(data)
    if n < _HEAD.size + _SIZES.size + _SUM:
        raise PrefixFileError(f"truncated: {n} bytes")
    magic, version, file_model, n_layout = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise PrefixFileError("not a llamabatch prefix file (bad magic)")
    if version != VERSION:
        raise PrefixFileError(f"unsupported version {version} (expected {VERSION})")
    if n_layout > MAX_LAYOUT:
        raise PrefixFileError(f"layout length {n_layout} > {MAX_LAYOUT}")
    at = _HEAD.size + n_layout
    if n < at + _SIZES.size + _SUM:
        raise PrefixFileError(f"truncated: {n} bytes")
    n_tokens, n_payload = _SIZES.unpack_from(data, at)
    at += _SIZES.size
    expected = at + 4 * n_tokens + n_payload + _SUM
    if expected != n:
        raise PrefixFileError(f"size mismatch: the header says {expected} bytes, the file has {n}")
    if hashlib.sha256(data[: n - _SUM]).digest() != data[n - _SUM :]:
        raise PrefixFileError("checksum mismatch (corrupt file)")
    if file_model != model_id:
        raise PrefixFileError("made with another model")
    file_layout = data[_HEAD.size : _HEAD.size + n_layout]
    if file_layout != layout.encode():
        raise PrefixFileError(
            f"another KV layout ({file_layout.decode(errors='replace')!r}, here {layout!r})"
        )
    if n_tokens == 0 or n_payload == 0:
        raise PrefixFileError("empty prefix")
    file_tokens = np.frombuffer(data, dtype="<i4", count=n_tokens, offset=at).astype(np.int32)
    if tokens is not None:
        want = np.asarray(tokens, dtype=np.int32)
        if len(want) != n_tokens or not np.array_equal(want, file_tokens):
            raise PrefixFileError("the file holds other tokens")
    at += 4 * n_tokens
    return file_tokens, data[at : at + n_payload]


class PrefixStore:
    """Prefix files of one model and KV layout in ``directory`` (see the module doc)."""

    def __init__(
        self, directory: str | os.PathLike[str], model_path: str | os.PathLike[str], layout: str
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model_id = model_identity(model_path)
        self.layout = layout
        self.loaded = self.saved = self.refused = 0
        #: the files of this model and layout found at start (``scan``), by their first
        #: ``block`` tokens: what the RAM tier may load on a match
        self.disk: dict[bytes, list[tuple[np.ndarray, Path]]] = {}
        self.block = 32

    def scan(self, block: int, max_files: int = 10_000) -> int:
        """Index the files of this model and layout in the directory by their tokens (only
        their headers are read; the rest is checked when one is loaded). Returns how many."""
        self.block = block
        self.disk.clear()
        n = 0
        for path in sorted(self.directory.glob(f"*{SUFFIX}"))[:max_files]:
            tokens = self._peek_tokens(path)
            if tokens is not None and len(tokens) >= block:
                self.disk.setdefault(tokens[:block].tobytes(), []).append((tokens, path))
                n += 1
        return n

    def _peek_tokens(self, path: Path) -> np.ndarray | None:
        """The tokens in a file's header when it is of this model and layout, else None."""
        try:
            with open(path, "rb") as f:
                head = f.read(_HEAD.size + MAX_LAYOUT + _SIZES.size)
                if len(head) < _HEAD.size:
                    return None
                magic, version, model, n_layout = _HEAD.unpack_from(head, 0)
                if magic != MAGIC or version != VERSION or model != self.model_id or n_layout > MAX_LAYOUT:
                    return None
                if head[_HEAD.size : _HEAD.size + n_layout] != self.layout.encode():
                    return None
                at = _HEAD.size + n_layout
                if len(head) < at + _SIZES.size:
                    return None
                n_tokens, _ = _SIZES.unpack_from(head, at)
                f.seek(at + _SIZES.size)
                raw = f.read(4 * n_tokens)
            if len(raw) != 4 * n_tokens:
                return None
            return np.frombuffer(raw, dtype="<i4").astype(np.int32)
        except OSError:
            return None

    def best(self, tokens: np.ndarray) -> tuple[np.ndarray | None, int]:
        """The indexed file's tokens sharing the longest prefix with ``tokens``, and its length."""
        from llamabatch.generate.ram_cache import common_prefix

        best, best_n = None, 0
        for file_tokens, _ in self.disk.get(tokens[: self.block].tobytes(), ()):
            n = common_prefix(file_tokens, tokens)
            if n > best_n:
                best, best_n = file_tokens, n
        return best, best_n

    def forget(self, tokens: np.ndarray) -> None:
        """Drop ``tokens``' file from the index (loaded into RAM, or refused)."""
        group = self.disk.get(tokens[: self.block].tobytes(), [])
        group[:] = [(t, p) for t, p in group if not np.array_equal(t, tokens)]

    def path_for(self, tokens: np.ndarray | list[int]) -> Path:
        """The file of ``tokens`` (a hash of the model, the layout and the tokens)."""
        digest = hashlib.sha256(self.model_id + self.layout.encode() + b"\0")
        digest.update(np.asarray(tokens, dtype="<i4").tobytes())
        return self.directory / f"{digest.hexdigest()[:40]}{SUFFIX}"

    def load(self, tokens: np.ndarray | list[int], max_bytes: int) -> bytes | None:
        """The checked state payload saved for ``tokens``, or None (no file, or refused:
        logged and counted)."""
        path = self.path_for(tokens)
        try:
            size = path.stat().st_size
        except OSError:
            return None
        try:
            if size > max_bytes:
                raise PrefixFileError(f"{size} bytes, more than a sequence's state can take ({max_bytes})")
            data = path.read_bytes()
            return read_prefix_file(data, self.model_id, self.layout, tokens)[1]
        except (PrefixFileError, OSError) as exc:
            self.refuse(path, str(exc))
            return None

    def refuse(self, path: Path, why: str) -> None:
        self.refused += 1
        logger.warning("llamabatch: prefix file %s refused (%s); computing the prefix", path, why)

    def save(self, tokens: np.ndarray | list[int], payload: bytes) -> bool:
        """Write the file of ``tokens`` atomically; False (logged) when it cannot be written."""
        if not payload:
            return False
        path = self.path_for(tokens)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(encode_prefix_file(self.model_id, self.layout, tokens, payload))
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            logger.warning("llamabatch: cannot write prefix file %s: %s", path, exc)
            return False
        self.saved += 1
        return True


def store_for(
    directory: str | os.PathLike[str] | None, model: object, context: object, flash_attn: object = None
) -> PrefixStore | None:
    """The prefix store of ``directory`` for ``model`` and the KV layout of ``context`` (its
    K/V types, unified or per-stream) and ``flash_attn`` (the V cache is stored transposed
    without it), or None without a directory."""
    if directory is None:
        return None
    layout = ";".join(f"{name}={getattr(context, name, None)}" for name in ("type_k", "type_v", "kv_unified"))
    layout += f";flash_attn={flash_attn}"
    return PrefixStore(directory, model.path, layout)  # type: ignore[attr-defined]


def state_bytes_per_token(model: object) -> int:
    """A generous bound on a sequence state's bytes per token (K and V of every layer in f32)."""
    n_layer = int(getattr(model, "n_layer", 0) or 0)
    n_embd = int(getattr(model, "n_embd", 0) or 0)
    return 2 * n_layer * n_embd * 4 + 64 if n_layer and n_embd else 1 << 20
