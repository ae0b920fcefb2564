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
returning 0) is handled the same way, and counted as refused, never as loaded: a file
counts as loaded only once llama.cpp has taken its state. Files are written atomically (a
temporary file in the same directory, then ``os.replace``).

The directory is untrusted too, at start as well (``scan``):

- only regular files are opened: a symlink, FIFO, socket or device named ``*.lbprefix`` is
  refused without being opened (``lstat``), and the open itself is non-blocking and does
  not follow links (``O_NONBLOCK | O_NOFOLLOW`` where the platform has them), then checked
  again (``fstat``: the same regular file). Symlinks are refused rather than followed: this
  store writes only regular files, so a link is not one of its files;
- a header is read with bounded reads: its claimed token and payload counts must add up to
  the file's size, and the tokens to at most ``max_tokens``, before anything else is read;
  the whole scan reads at most ``MAX_SCAN_TOKEN_BYTES`` of tokens;
- any error refuses that file (logged, counted in ``refused``); nothing a file holds can
  raise out of the scan. Files of another model or KV layout are skipped, not refused.

The directory's size is capped (``max_bytes``, ``EngineConfig.prefix_cache_dir_max_mb``):
before a file is written, the least recently used prefix files (by modification time, which
a load refreshes) are deleted until it fits; a file bigger than the cap is not written.

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
import stat
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np

from llamabatch.config import PREFIX_CACHE_DIR_MAX_MB

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
#: the most tokens a file's header may claim at the start-up scan (without a context size)
MAX_FILE_TOKENS = 1 << 20
#: the most token bytes the start-up scan reads, all files together (the index it builds)
MAX_SCAN_TOKEN_BYTES = 256 << 20
#: seconds the directory listing kept for the size cap is trusted (other processes may write)
RELIST_S = 30.0
_TMP_PREFIX = ".tmp-"
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


class PrefixFileError(ValueError):
    """A prefix file that cannot be used (corrupt, truncated, another model or layout)."""


def file_size(layout: str, n_tokens: int, n_payload: int) -> int:
    """The size in bytes of a prefix file holding ``n_tokens`` tokens and ``n_payload`` bytes of state."""
    return _HEAD.size + len(layout.encode()) + _SIZES.size + 4 * n_tokens + n_payload + _SUM


@contextmanager
def open_regular(path: str | os.PathLike[str]) -> Iterator[tuple[BinaryIO, int]]:
    """``(file, size)`` of ``path`` opened for reading when it is a regular file (not a link,
    FIFO, socket or device: ``PrefixFileError``); never blocks on the open. ``OSError`` when
    it cannot be opened (``FileNotFoundError`` when it does not exist)."""
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise PrefixFileError("not a regular file")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        after = os.fstat(fd)
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise PrefixFileError("not a regular file (replaced while opened)")
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        yield file, after.st_size


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


def encode_prefix_file(
    model_id: bytes, layout: str, tokens: np.ndarray | list[int], payload: bytes | bytearray
) -> bytes:
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
        self,
        directory: str | os.PathLike[str],
        model_path: str | os.PathLike[str],
        layout: str,
        max_bytes: int = PREFIX_CACHE_DIR_MAX_MB << 20,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model_id = model_identity(model_path)
        self.layout = layout
        #: the directory's size cap: the prefix files of every model and layout together
        self.max_bytes = max_bytes
        #: files whose state llama.cpp took; files written; files refused (unsafe, corrupt,
        #: over a limit, or refused by llama.cpp); files deleted to keep under ``max_bytes``
        self.loaded = self.saved = self.refused = self.pruned = 0
        self._files: dict[str, tuple[int, int]] | None = None  # ``make_room``'s listing
        self._listed_at = 0.0
        #: the files of this model and layout found at start (``scan``), by their first
        #: ``block`` tokens: what the RAM tier may load on a match
        self.disk: dict[bytes, list[tuple[np.ndarray, Path]]] = {}
        self.block = 32

    def scan(self, block: int, max_files: int = 10_000, max_tokens: int = MAX_FILE_TOKENS) -> int:
        """Index the files of this model and layout in the directory by their tokens (only
        their headers are read, with bounded reads; the rest is checked when one is loaded).
        A file that is unsafe or malformed is refused (logged, counted), never raised; files
        past ``max_files``, or past ``MAX_SCAN_TOKEN_BYTES`` of tokens in all, are left
        unindexed. Returns how many were indexed."""
        self.block = block
        self.disk.clear()
        n = 0
        budget = MAX_SCAN_TOKEN_BYTES
        for path in self._file_paths(max_files):
            try:
                tokens = self._peek_tokens(path, max_tokens)
            except Exception as exc:  # whatever a file holds: refuse it, go on
                self.refuse(path, str(exc) or type(exc).__name__, "skipped")
                continue
            if tokens is None or len(tokens) < block:
                continue
            budget -= tokens.nbytes
            if budget < 0:
                logger.warning(
                    "llamabatch: prefix directory scan stopped: %d files indexed, the most it reads", n
                )
                break
            self.disk.setdefault(tokens[:block].tobytes(), []).append((tokens, path))
            n += 1
        return n

    def _file_paths(self, max_files: int) -> list[Path]:
        """The names of prefix files in the directory (at most ``max_files``, sorted; not
        temporary files being written), whatever their type."""
        paths: list[Path] = []
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if entry.name.endswith(SUFFIX) and not entry.name.startswith(_TMP_PREFIX):
                        paths.append(Path(entry.path))
                        if len(paths) >= max_files:
                            break
        except OSError as exc:
            logger.warning("llamabatch: cannot list the prefix directory %s: %s", self.directory, exc)
        return sorted(paths)

    def _peek_tokens(self, path: Path, max_tokens: int) -> np.ndarray | None:
        """The tokens in a file's header when it is of this model and layout, None when it is
        another's; ``PrefixFileError`` (or ``OSError``) when it is unsafe or malformed."""
        with open_regular(path) as (f, size):
            head = f.read(_HEAD.size + MAX_LAYOUT + _SIZES.size)
            if len(head) < _HEAD.size:
                raise PrefixFileError(f"truncated: {size} bytes")
            magic, version, model, n_layout = _HEAD.unpack_from(head, 0)
            if magic != MAGIC:
                raise PrefixFileError("not a llamabatch prefix file (bad magic)")
            if version != VERSION:
                raise PrefixFileError(f"unsupported version {version} (expected {VERSION})")
            if n_layout > MAX_LAYOUT:
                raise PrefixFileError(f"layout length {n_layout} > {MAX_LAYOUT}")
            at = _HEAD.size + n_layout
            if len(head) < at + _SIZES.size:
                raise PrefixFileError(f"truncated: {size} bytes")
            if model != self.model_id or head[_HEAD.size : at] != self.layout.encode():
                return None
            n_tokens, n_payload = _SIZES.unpack_from(head, at)
            at += _SIZES.size
            if at + 4 * n_tokens + n_payload + _SUM != size:
                raise PrefixFileError(
                    f"size mismatch: the header says {n_tokens} tokens and {n_payload} payload "
                    f"bytes, the file has {size} bytes"
                )
            if n_tokens == 0 or n_payload == 0:
                raise PrefixFileError("empty prefix")
            if n_tokens > max_tokens:
                raise PrefixFileError(f"{n_tokens} tokens, more than the {max_tokens} a file may hold here")
            f.seek(at)
            raw = f.read(4 * n_tokens)
        if len(raw) != 4 * n_tokens:
            raise PrefixFileError("truncated while read")
        return np.frombuffer(raw, dtype="<i4").astype(np.int32)

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
            with open_regular(path) as (f, size):
                if size > max_bytes:
                    raise PrefixFileError(
                        f"{size} bytes, more than a sequence's state can take ({max_bytes})"
                    )
                data = f.read(size + 1)
            payload = read_prefix_file(data, self.model_id, self.layout, tokens)[1]
        except FileNotFoundError:
            return None
        except (PrefixFileError, OSError) as exc:
            self.refuse(path, str(exc))
            return None
        self.touch(path)
        return payload

    def touch(self, path: Path) -> None:
        """Mark ``path`` as recently used (its modification time: the directory's LRU order)."""
        try:
            os.utime(path, follow_symlinks=False)
        except (OSError, NotImplementedError):
            return
        self._noted(path)

    def refuse(self, path: Path, why: str, then: str = "computing the prefix") -> None:
        """Count and log a prefix file that is not used (``why``)."""
        self.refused += 1
        logger.warning("llamabatch: prefix file %s refused (%s); %s", path, why, then)

    def save(self, tokens: np.ndarray | list[int], payload: bytes | bytearray) -> bool:
        """Write the file of ``tokens`` atomically; False (logged) when it cannot be written."""
        if not payload:
            return False
        path = self.path_for(tokens)
        data = encode_prefix_file(self.model_id, self.layout, tokens, payload)
        if not self.make_room(len(data), replacing=path):
            logger.warning(
                "llamabatch: prefix file %s not written: %d bytes do not fit the directory's cap (%d bytes)",
                path,
                len(data),
                self.max_bytes,
            )
            return False
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=SUFFIX, dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            logger.warning("llamabatch: cannot write prefix file %s: %s", path, exc)
            return False
        self._noted(path, len(data))
        self.saved += 1
        return True

    def make_room(self, n_bytes: int, replacing: Path | None = None) -> bool:
        """Delete the least recently used prefix files (oldest modification time first) until
        ``n_bytes`` more fit under ``max_bytes`` (``replacing``'s current size not counted:
        it is about to be replaced); False when they cannot.

        The directory's listing is kept in memory between calls (a save then costs no
        directory scan) and listed again when older than ``RELIST_S``, so that files other
        processes write count too."""
        if n_bytes > self.max_bytes:
            return False
        skip = str(replacing) if replacing is not None else None
        files = self._listing()
        total = sum(size for path, (_, size) in files.items() if path != skip)
        for path, (_, size) in sorted(files.items(), key=lambda item: item[1][0]):
            if total + n_bytes <= self.max_bytes:
                break
            if path == skip:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("llamabatch: cannot delete prefix file %s: %s", path, exc)
                continue
            del files[path]
            total -= size
            self.pruned += 1
            logger.info("llamabatch: prefix file %s deleted (least recently used, directory cap)", path)
        return total + n_bytes <= self.max_bytes

    def _listing(self) -> dict[str, tuple[int, int]]:
        """The regular prefix files in the directory: path -> ``(mtime_ns, size)``."""
        now = time.monotonic()
        if self._files is None or now - self._listed_at > RELIST_S:
            self._files = self._regular_files()
            self._listed_at = now
        return self._files

    def _noted(self, path: Path, size: int | None = None) -> None:
        """Record in the listing that ``path`` was just written (``size``) or used."""
        files = self._files
        if files is None:
            return
        key = str(path)
        if size is None:
            if key not in files:
                return
            size = files[key][1]
        files[key] = (time.time_ns(), size)

    def _regular_files(self) -> dict[str, tuple[int, int]]:
        """Path -> ``(mtime_ns, size)`` of the regular prefix files in the directory."""
        out: dict[str, tuple[int, int]] = {}
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if not entry.name.endswith(SUFFIX) or entry.name.startswith(_TMP_PREFIX):
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(info.st_mode):
                        out[entry.path] = (info.st_mtime_ns, info.st_size)
        except OSError as exc:
            logger.warning("llamabatch: cannot list the prefix directory %s: %s", self.directory, exc)
        return out


def store_for(
    directory: str | os.PathLike[str] | None,
    model: object,
    context: object,
    flash_attn: object = None,
    max_mb: int = PREFIX_CACHE_DIR_MAX_MB,
) -> PrefixStore | None:
    """The prefix store of ``directory`` for ``model`` and the KV layout of ``context`` (its
    K/V types, unified or per-stream) and ``flash_attn`` (the V cache is stored transposed
    without it), capped at ``max_mb`` MiB, or None without a directory."""
    if directory is None:
        return None
    layout = ";".join(f"{name}={getattr(context, name, None)}" for name in ("type_k", "type_v", "kv_unified"))
    layout += f";flash_attn={flash_attn}"
    return PrefixStore(directory, model.path, layout, max_mb << 20)  # type: ignore[attr-defined]


def state_bytes_per_token(model: object) -> int:
    """A generous bound on a sequence state's bytes per token (K and V of every layer in f32)."""
    n_layer = int(getattr(model, "n_layer", 0) or 0)
    n_embd = int(getattr(model, "n_embd", 0) or 0)
    return 2 * n_layer * n_embd * 4 + 64 if n_layer and n_embd else 1 << 20
