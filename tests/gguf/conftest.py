"""The base files of the GGUF tests (``gguf_mutants.py``), written once per session."""

from __future__ import annotations

import pytest
from gguf_mutants import Bases, write_bases


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    return Bases(write_bases(tmp_path_factory.mktemp("gguf-bases")))
