"""``llamabatch drop-page-cache``: read the llama.cpp libraries afresh before a measurement.

On this project's VMs the same library bytes ran 1.2-1.4x slower when their page-cache pages
had been read hours before than from a fresh copy (unified KV decode, 8 sequences: 230 against
283 tok/s; the time went to ``ggml_vec_dot_f16``). Evicting the files' pages
(``posix_fadvise(POSIX_FADV_DONTNEED)``) gave the fresh speed back to the installed files. A
side-by-side comparison is only fair when both sides' libraries are fresh, so this command
drops the pinned build's libraries (``llamabatch._vendor.find_build``) and any files or
directories given, e.g. the directory of ``llama-batched-bench`` and ``llama-server``.

The kernel keeps a page that any process maps, and this process maps the llama.cpp build
(importing ``llamabatch`` loads it), so the command replaces itself (``exec``) with a small
Python program that holds no library, and drops the pages from there. Processes still
running with the libraries loaded (a server) keep their pages: stop them first.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["add_arguments", "library_files", "main"]

# Run in a fresh interpreter (after exec): argv[1:] are the files; no llamabatch import.
_DROP = """
import os, sys
n = size = 0
for name in sys.argv[1:]:
    fd = os.open(name, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size += os.fstat(fd).st_size
        n += 1
    finally:
        os.close(fd)
print(f"dropped the page cache of {n} files ({size / 2**20:.1f} MiB)")
"""


def library_files(paths: list[str]) -> list[str]:
    """The regular files under the pinned llama.cpp build's library directory and ``paths``
    (a directory gives its files, not recursing; symbolic links are followed once)."""
    from llamabatch._vendor import find_build

    roots = [find_build().lib_dir, *(Path(p).expanduser() for p in paths)]
    files: dict[str, None] = {}  # ordered, no repeats (a library's versioned names are links)
    for root in roots:
        if not root.exists():
            raise FileNotFoundError(2, "no such file or directory", str(root))
        for path in sorted(root.iterdir()) if root.is_dir() else [root]:
            if path.is_file():
                files[str(path.resolve())] = None
    return list(files)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch drop-page-cache``."""
    p.description = (
        "Drop the page cache of the llama.cpp build's libraries (and of PATHs) so that the next "
        "process reads them afresh: run it before a side-by-side benchmark (see "
        "llamabatch.bench.page_cache)."
    )
    p.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="more files or directories, e.g. the llama.cpp tools' directory",
    )


def main(args: argparse.Namespace) -> int:
    """``llamabatch drop-page-cache``: exec a library-free interpreter that drops the pages."""
    if not hasattr(os, "posix_fadvise"):
        print(f"{args.prog}: posix_fadvise is not available on this platform", file=sys.stderr)
        return 1
    files = library_files(args.paths)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-c", _DROP, *files])
    return 0  # pragma: no cover - execv does not return
