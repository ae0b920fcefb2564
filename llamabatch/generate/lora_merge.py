"""Merge-on-load (``merge_lora=True``): one LoRA adapter merged into the model's weights.

A deployment that serves one adapter need not pay for it on every token, nor switch: at load
the adapter is checked and merged (``gguf/merge_lora.py``: adapted tensors written as F16)
into a GGUF kept under :func:`merged_cache_dir`, named by a hash of the base file (path, size,
modification time), the adapter's bytes, the scale and the merge format, so a restart reuses
it and a changed file makes a new one. The engine then loads that file in place of the base.

The merged model IS the deployment: a request naming the adapter (at the merged scale, 1) or
none runs the merged weights; one naming another adapter, another scale, or asking for the
base model (there is none loaded) is a ``ValueError`` saying so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamabatch.gguf.check_lora import check_lora
from llamabatch.gguf.merge_lora import MERGE_FORMAT, merge_lora
from llamabatch.params import SamplingParams

__all__ = ["MergedLora", "merge_on_load", "merged_cache_dir", "merged_params"]

#: the scale the adapter is merged at (``lora_adapters`` gives none: llama.cpp's default)
MERGED_SCALE = 1.0


@dataclass(frozen=True)
class MergedLora:
    """The adapter merged into the served model."""

    name: str
    adapter: Path
    #: the merged GGUF the engine loads
    path: Path
    scale: float = MERGED_SCALE


def merged_cache_dir() -> Path:
    """Where merged models are kept: ``$XDG_CACHE_HOME/llamabatch/merged``, else
    ``~/.cache/llamabatch/merged``. Each is about the base's size plus its adapted tensors as
    F16; delete the folder's files to reclaim the space (they are made again when needed)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "llamabatch" / "merged"


def merge_on_load(
    model_path: str | os.PathLike[str], config: Any, cache_dir: Path | None = None
) -> MergedLora:
    """The merged model of ``config``'s one adapter (``config.lora_adapters``) on
    ``model_path``: the cached file when one exists for these inputs, else merged now.

    Raises what :func:`~llamabatch.gguf.merge_lora.merge_lora` raises: ``FileNotFoundError``,
    ``LoraLoadError`` naming a wrong adapter file, ``OSError`` when the file cannot be written."""
    ((name, adapter_file),) = config.lora_adapters
    base, adapter = Path(model_path), Path(adapter_file)
    check_lora(adapter, base)  # every load: the cached file is used only for a valid adapter
    stat = base.stat()
    digest = hashlib.sha256()
    digest.update(f"{MERGE_FORMAT}\0{base.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    digest.update(f"{MERGED_SCALE!r}\0".encode())
    with adapter.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{base.stem}+{name}")[:80]
    out = (cache_dir or merged_cache_dir()) / f"{stem}-{digest.hexdigest()[:16]}.gguf"
    if not out.is_file():
        merge_lora(base, adapter, out, scale=MERGED_SCALE)
    return MergedLora(name, adapter, out)


def merged_params(merged: MergedLora | None, params: SamplingParams) -> SamplingParams:
    """``params`` for the merged model: the merged adapter, or none, runs as the model itself
    (``lora=()``); any other adapter set is a ``ValueError`` naming what is served."""
    if merged is None:
        return params
    served = f"the model merged with LoRA adapter {merged.name!r} (merge_lora=True)"
    for name in params.lora_files:
        if name != merged.name:
            raise ValueError(f"LoRA adapter {name!r}: this engine serves only {served}")
    if not params.lora:
        return params
    if params.lora == ((merged.name, merged.scale),):
        return dataclasses.replace(params, lora=())
    if [name for name, _ in params.lora] == [merged.name]:
        scale = params.lora[0][1]
        raise ValueError(
            f"LoRA adapter {merged.name!r} at scale {scale:g}: it is merged into the weights at "
            f"scale {merged.scale:g}, which a request cannot change"
        )
    others = ", ".join(repr(name) for name, _ in params.lora if name != merged.name)
    raise ValueError(
        f"LoRA adapter(s) {others}: this engine serves only {served}; neither other adapters "
        "nor the base model are loaded"
    )
