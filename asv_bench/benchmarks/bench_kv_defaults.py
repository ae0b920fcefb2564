"""asv: the KV layout and flash attention the defaults choose, against the other choices, on the
workloads of the memory issue (``llamabatch bench-layouts``, scaled to run in seconds).

``KVChoices.time_workload``: one workload's wall time per choice, in one ``LLM`` made in
``setup``: ``defaults`` (``LLM(model)``: here a stream per slot without flash attention),
``unified-fa-on`` (llama-server's layout, the old defaults), ``unified-fa-off`` and
``per-stream-fa-on``. The README's table is the full-size run of the same workloads.
Threads: ``$LLAMABATCH_BENCH_THREADS`` (default: all cores).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from llamabatch import LLM, SamplingParams
from llamabatch.bench import layouts
from llamabatch.bench.workloads import resolve_model
from llamabatch.cli import build_parser

#: the choices: the LLM options each adds to the model
CHOICES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "unified-fa-on": {"kv_unified": True, "n_ctx": 8192, "flash_attn": True},
    "unified-fa-off": {"kv_unified": True, "n_ctx": 8192, "flash_attn": False},
    "per-stream-fa-on": {"kv_unified": False, "flash_attn": True},
}

# the workloads, scaled down: bench-layouts' arguments
_ARGS = {
    "uniform": ["--npl", "8", "--npp", "128", "--ntg", "32"],
    "shared_prefix": ["--shared-requests", "8", "--prefix-tokens", "1024", "--max-tokens", "32"],
    "chat": ["--conversations", "6", "--turns", "2", "--max-tokens", "16"],
    # the long stream's ubatch of its own (SlotTable.batch_order) shows here
    "long_among_short": ["--long-tokens", "2000", "--max-tokens", "32"],
}


class KVChoices:
    """Wall time of a workload on each KV layout / flash-attention choice (135M model)."""

    params = (list(_ARGS), list(CHOICES))
    param_names: ClassVar[list[str]] = ["workload", "choice"]
    timeout = 600
    number = 1
    repeat = 3

    def setup(self, workload: str, choice: str) -> None:
        self.args = build_parser().parse_args(["bench-layouts", *_ARGS[workload]])
        threads = int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))
        slots = layouts.SLOTS[workload](self.args) if workload in layouts.SLOTS else 8
        self.llm = LLM(str(resolve_model("135m")), n_threads=threads, n_parallel=slots, **CHOICES[choice])
        self.llm.generate([[self.llm.model.bos, 300, 400]], SamplingParams(max_tokens=2), use_tqdm=False)

    def teardown(self, workload: str, choice: str) -> None:
        self.llm.close()

    def time_workload(self, workload: str, choice: str) -> None:
        self.llm.clear_prefix_cache()  # every run computes its prompts: no reuse from the last one
        layouts.WORKLOADS[workload](self.llm, self.args)
