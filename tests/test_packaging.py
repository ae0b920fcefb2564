"""The wheel ships every subpackage: pyproject's explicit package list must name each folder of
``llamabatch/`` that holds an ``__init__.py`` (a new one left out installs nothing, and CI's
non-editable install then fails to import it while an editable checkout hides the gap)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _listed_packages() -> set[str]:
    # [tool.setuptools] packages = [...] (read with a pattern: tomllib needs Python 3.11)
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r"^\[tool\.setuptools\]\s*\npackages\s*=\s*\[(.*?)\]", text, re.S | re.M)
    assert match is not None, "no [tool.setuptools] packages list in pyproject.toml"
    return set(re.findall(r'"([\w.]+)"', match.group(1)))


def test_every_subpackage_is_in_the_wheel():
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "llamabatch").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    missing = on_disk - _listed_packages()
    assert missing == set(), f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
