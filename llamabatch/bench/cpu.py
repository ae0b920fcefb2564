"""The CPU features that decide which GGUF weight type embeds fastest, for benchmark reports.

ggml's CPU kernels for f16 and bf16 weights run natively only with AVX512-FP16 / AVX512-BF16
(or AMX); elsewhere the weights are converted on the fly and f32 is the faster choice for
small encoders (see :func:`llamabatch.gguf.convert_head.auto_dtype`). ``llamabatch bench-embed``
and ``bench-rerank`` print :func:`cpu_summary` beside their figures so that results from
different machines can be compared.
"""

from __future__ import annotations

import os
import platform

from llamabatch.gguf.convert_head import CPU_FEATURES, cpu_flags

__all__ = ["cpu_model", "cpu_summary"]


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (``platform.processor()`` where /proc/cpuinfo is unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_summary() -> str:
    """``"<model>, <n> cores, flags: avx2 f16c ... (no avx512f ...)"``: the relevant features
    present, then those absent."""
    flags = cpu_flags()
    have = [name for name in CPU_FEATURES if flags[name]]
    lack = [name for name in CPU_FEATURES if not flags[name]]
    text = f"{cpu_model()}, {os.cpu_count()} cores, flags: {' '.join(have) or 'none'}"
    return text + (f" (no {' '.join(lack)})" if lack else "")
