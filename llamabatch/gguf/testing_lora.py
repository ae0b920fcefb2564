"""Random-weight LoRA adapters in llama.cpp's adapter GGUF layout, for any base model.

:func:`make_lora` reads the base model's header (``gguf/reader.py``: names, shapes, the
architecture) and writes an adapter for its attention and feed-forward projections. The layout is
the one llama.cpp's adapter loader reads (facts from ``src/llama-adapter.cpp`` at the pinned
commit):

* keys ``general.type = "adapter"``, ``general.architecture`` = the base's, ``adapter.type =
  "lora"``, ``adapter.lora.alpha`` (a FLOAT32; the delta is scaled by ``alpha / rank``);
* for a base matrix ``W`` named ``X.weight`` with ggml shape ``[n_in, n_out]``, the tensors
  ``X.weight.lora_a`` of ggml shape ``[n_in, rank]`` and ``X.weight.lora_b`` of ``[rank, n_out]``
  (numpy shapes reversed), so ``W x + scale * B (A x)``.

The weights are deterministic for a ``seed`` (the PCG64 stream, as the test models'), and large
enough that greedy text differs from the base model's.
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import numpy as np

from llamabatch.gguf.reader import read_header

__all__ = ["LORA_TARGETS", "lora_ranks", "make_lora"]

#: the projections an adapter from :func:`make_lora` changes (llama.cpp's tensor names)
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_TARGET = re.compile(r"blk\.\d+\.(" + "|".join(LORA_TARGETS) + r")\.weight")
#: std of B relative to 1 / sqrt(rank): the delta's size next to the base weights' output
_B_GAIN = 0.5


def _random(seed: int, name: str, shape: tuple[int, int], std: float) -> np.ndarray:
    """Deterministic float32 values, uniform with standard deviation ``std``, for one tensor."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))
    half_width = std * 3.0**0.5
    return rng.uniform(-half_width, half_width, size=shape).astype(np.float32)


def make_lora(
    base_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    rank: int = 8,
    seed: int = 0,
    *,
    alpha: float | None = None,
) -> Path:
    """Write a random-weight LoRA adapter for the GGUF model at ``base_path`` to ``out_path``.

    Every 2-D ``blk.N.{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down}.weight`` of the
    base gets a rank-``rank`` pair; ``alpha`` defaults to ``rank`` (scale 1). The file appears
    atomically. Returns ``Path(out_path)``.
    """
    import gguf

    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 4096:
        raise ValueError(f"rank must be an int in [1, 4096], got {rank!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    alpha = float(rank if alpha is None else alpha)
    base = read_header(Path(base_path))
    arch_entry = base.kv.get(gguf.Keys.General.ARCHITECTURE)
    if arch_entry is None or not isinstance(arch_entry.value, bytes):
        raise ValueError(f"{base_path}: no general.architecture string")
    arch = arch_entry.value.decode("utf-8", "replace")
    targets = [(t.name, t.dims) for t in base.tensors if _TARGET.fullmatch(t.name) and len(t.dims) == 2]
    if not targets:
        raise ValueError(f"{base_path}: no attention or feed-forward projections to adapt")

    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for name, (n_in, n_out) in targets:
            # numpy shapes are ggml's reversed: A is (rank, n_in), B is (n_out, rank)
            a = _random(seed, name + ".lora_a", (rank, n_in), n_in**-0.5)
            b = _random(seed, name + ".lora_b", (n_out, rank), _B_GAIN * rank**-0.5)
            writer.add_tensor(name + ".lora_a", a)
            writer.add_tensor(name + ".lora_b", b)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def lora_ranks(path: str | os.PathLike[str]) -> dict[str, int]:
    """``{base tensor name: rank}`` of an adapter file (from its header; for tests)."""
    header = read_header(Path(path))
    return {t.name[: -len(".lora_a")]: int(t.dims[1]) for t in header.tensors if t.name.endswith(".lora_a")}
