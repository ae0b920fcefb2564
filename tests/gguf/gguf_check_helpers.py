"""What the GGUF validator's tests share: a mutant written to a file, a base edited, and the
assertion that the validator rejects a file naming what is wrong."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf.constants import GGMLQuantizationType, GGUFValueType
from gguf_mutants import GGUF, Bases

from llamabatch import ModelLoadError
from llamabatch.gguf.check import check_gguf

VT = GGUFValueType
Q = GGMLQuantizationType


def write_model(tmp_path: Path, content: GGUF | bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.to_bytes()[0])
    return path


def edited(bases: Bases, base: str, fn: Callable[[GGUF], object]) -> GGUF:
    g = bases.gguf[base].copy()
    fn(g)
    return g


def rejects(path: Path, *fragments: str, vocab_only: bool = False) -> str:
    with pytest.raises(ModelLoadError) as info:
        check_gguf(path, vocab_only=vocab_only)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def set_key(key: str, vtype: int, value: object, item: int | None = None) -> Callable[[GGUF], None]:
    return lambda g: g.set(key, vtype, value, item)
