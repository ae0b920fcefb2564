"""``batch_invariant=True``: the settings under which a request's tokens and log-probs are
bit-identical whatever else the engine runs (alone or with others, in any arrival order,
through chunked prefill, prefix reuse, preemption and recompute, with speculation on).

ggml's CPU backend computes each token's row of a matrix product on its own, but which kernel
computes it, and in what order it sums, can depend on the batch (llama.cpp commit 0c1e570,
``ggml-cpu/ops.cpp`` and ``ggml-cpu/llamafile/sgemm.cpp``):

- flash attention with an f16 or f32 KV cache takes a tiled kernel when a ubatch holds 64 or
  more query rows of one stream (its 64-cell tiles group a sequence's cells by where they
  sit), and splits the KV cells among the threads when a ubatch holds one row of one stream
  over 512 cells or more; otherwise one row at a time, its cells in order;
- without flash attention a stream's attention products take llamafile's sgemm for two rows
  or more and ggml's ``vec_dot`` for one, and the two round differently;
- in one unified buffer a sequence's cells sit where the others left room, so the tiled
  kernel's tiles and sgemm's lanes group them differently from one run to the next.

With one KV stream per sequence, flash attention on and a KV type other than f16/f32
(``q8_0`` here), every attention row goes through the one-row kernel, over the sequence's
own cells in position order, whatever the ubatch holds. The weight products then depend only
on the weight types: Q4_1 and Q8_0 (SmolLM2-135M's) give the same row whatever the batch.
README, "Reproducibility", has the measurements; ``docs/batch_invariance.py`` reproduces the
unified buffer's divergence through llama.cpp's C API.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from llamabatch._ffi.kv_types import head_dims
from llamabatch.config_checks import INVARIANT_KV_TYPE, batch_invariant_conflict
from llamabatch.gguf.reader import read_header

if TYPE_CHECKING:
    from llamabatch._ffi.model import Model
    from llamabatch.config import EngineConfig

__all__ = [
    "INVARIANT_KV_TYPE",
    "INVARIANT_WEIGHT_TYPES",
    "TILED_KV_TYPES",
    "VARIANT_WEIGHT_TYPES",
    "batch_invariant_conflict",
    "check_weight_types",
    "invariant_config",
]

logger = logging.getLogger("llamabatch")

#: the KV types for which ggml's CPU flash attention picks its kernel by the batch's shape
TILED_KV_TYPES = ("f16", "f32")
#: matrix weight types whose products gave a token the same row whatever else its ubatch
#: held (measured: a decode step alone and beside another stream, bit for bit)
INVARIANT_WEIGHT_TYPES = frozenset({"Q4_1", "Q8_0"})
#: matrix weight types whose one-token ubatch takes ggml's ``vec_dot`` and larger ones
#: llamafile's sgemm, which round differently (measured for F32 and F16)
VARIANT_WEIGHT_TYPES = frozenset({"F32", "F16", "BF16"})


def check_weight_types(path: str | os.PathLike[str]) -> None:
    """Refuse a model whose matrices (2-D tensors) are of a :data:`VARIANT_WEIGHT_TYPES`
    type, with ``ValueError`` naming one; log a warning for types not measured either way
    (K-quants take a tiled kernel from 8 rows, Q4_0 and IQ4_NL a repacked one by groups of
    rows, others llamafile's sgemm from 2 rows: not checked here)."""
    matrices = [t for t in read_header(Path(path)).tensors if len(t.dims) >= 2]
    variant = [t for t in matrices if t.type.name in VARIANT_WEIGHT_TYPES]
    if variant:
        raise ValueError(
            f"batch_invariant=True: {Path(path).name} holds {variant[0].type.name} matrices "
            f"({variant[0].name}, ...), whose product ggml computes for a one-token ubatch with "
            "another kernel than for several tokens (vec_dot against llamafile's sgemm), so a "
            "token's row depends on its batch; measured invariant: "
            f"{', '.join(sorted(INVARIANT_WEIGHT_TYPES))} weights"
        )
    unchecked = sorted({t.type.name for t in matrices} - INVARIANT_WEIGHT_TYPES)
    if unchecked:
        logger.warning(
            "llamabatch: batch_invariant=True with %s weights (%s): not measured; outputs may "
            'still depend on the batch (README, "Reproducibility")',
            "/".join(unchecked),
            Path(path).name,
        )


def invariant_config(config: EngineConfig, model: Model | None = None) -> EngineConfig:
    """``config`` with what ``batch_invariant=True`` decides: one KV stream per sequence,
    flash attention on, and an f16 K or V cache (the default) stored as
    :data:`INVARIANT_KV_TYPE`, or as bf16 where ``model``'s head size is not a multiple of
    q8_0's 32-value blocks. Unchanged without ``batch_invariant``."""
    if not config.batch_invariant:
        return config
    kv_type = INVARIANT_KV_TYPE
    if model is not None and any(dim % 32 for dim in head_dims(model)):
        kv_type = "bf16"
    return config.replace(
        kv_unified=False,
        flash_attn=True,
        type_k=kv_type if config.type_k in TILED_KV_TYPES else config.type_k,
        type_v=kv_type if config.type_v in TILED_KV_TYPES else config.type_v,
    )
