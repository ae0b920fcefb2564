"""``llamabatch drop-page-cache``: the files it finds, and that their pages really leave the cache."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamabatch._vendor import find_build
from llamabatch.bench.page_cache import library_files

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/Unix only")


def resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (``mincore`` on a fresh mapping)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    # a private copy-on-write mapping: writable for ctypes, its untouched pages the file's own
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        first = ctypes.c_char.from_buffer(mapped)  # an export of the mapping: its address
        try:
            if libc.mincore(ctypes.addressof(first), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del first  # the mapping cannot close while exported
    return sum(v & 1 for v in vec)


def drop_here(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_the_pinned_libraries_and_the_given_paths_are_listed_once(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.bin").symlink_to(tmp_path / "a.bin")
    files = library_files([str(tmp_path)])
    assert any(Path(f).name.startswith("libllama") for f in files)
    assert all(
        Path(f).resolve().parent in (find_build().lib_dir.resolve(), tmp_path.resolve()) for f in files
    )
    assert files.count(str((tmp_path / "a.bin").resolve())) == 1  # the link is the same file
    assert str(tmp_path / "sub") not in files
    assert len(files) == len(set(files))


def test_a_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        library_files([str(tmp_path / "nowhere")])


def test_the_command_drops_the_files_pages(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"
    with target.open("wb") as fh:
        fh.write(os.urandom(64 * mmap.PAGESIZE))
        os.fsync(fh.fileno())  # dirty pages cannot be dropped
    drop_here(target)
    if resident_pages(target):
        pytest.skip("tmp_path's filesystem holds files in memory (tmpfs): no page cache to drop")
    target.read_bytes()
    assert resident_pages(target) > 0
    run = subprocess.run(
        [sys.executable, "-m", "llamabatch", "drop-page-cache", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "dropped the page cache of" in run.stdout
    assert resident_pages(target) == 0


def test_the_command_refuses_a_missing_path(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "llamabatch", "drop-page-cache", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "nowhere" in run.stderr
