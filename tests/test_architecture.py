"""ARCHITECTURE.md matches the code: every file or folder it names exists, and its layer table
lists every subpackage of ``llamabatch``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llamabatch"
DOC = ROOT / "ARCHITECTURE.md"

#: a backticked path: a file with a known suffix, or a folder (ending in "/")
_PATH = re.compile(r"`([A-Za-z0-9_./-]+(?:\.(?:py|pyx|pxd|pyi|h|md|toml|txt)|/))`")


def named_paths(text: str) -> list[str]:
    """The paths ARCHITECTURE.md names (in backticks): relative to the repository root when
    they start with a top-level folder, else to the ``llamabatch`` package."""
    return sorted(set(_PATH.findall(text)))


def resolve(name: str) -> Path | None:
    for base in (ROOT, PACKAGE):
        path = base / name
        if path.exists():
            return path
    return None


def test_every_named_path_exists() -> None:
    names = named_paths(DOC.read_text(encoding="utf-8"))
    assert len(names) > 40, "ARCHITECTURE.md should name the files of a request's path"
    missing = [name for name in names if resolve(name) is None]
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_layer_table_covers_every_subpackage() -> None:
    text = DOC.read_text(encoding="utf-8")
    table = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    folders = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name != "_vendor"
    )
    absent = [name for name in folders if f"`{name}/`" not in table and f"`llamabatch/{name}/`" not in table]
    assert not absent, f"the layer table of ARCHITECTURE.md does not list: {absent}"


def test_the_path_finder_sees_missing_files() -> None:
    # the check above must be able to fail
    assert named_paths("see `nowhere/at_all.py` and `_core/`") == ["_core/", "nowhere/at_all.py"]
    assert resolve("nowhere/at_all.py") is None
    assert resolve("_core/slots.pyx") is not None
