"""asv: prefix reuse (``llamabatch.bench.prefix``), on the tiny and ~135M test models.

- ``SharedSystemPrompt``: 16 requests sharing a 512-token system prompt (32 unique tokens,
  32 new tokens each), n_parallel 8: wall time and median time to first token, with reuse
  on and off; ``track_`` ratios off/on measured side by side in one run.
- ``MultiTurnChat``: 8 conversations x 4 turns resending the whole history: the share of
  prompt tokens actually computed with reuse, relative to the no-reuse run.
"""

from __future__ import annotations

import os

from llamabatch.bench.prefix import multi_turn_chat, shared_system_prompt
from llamabatch.gguf.testing import model_path

MODELS = ["tiny", "135m"]


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


class SharedSystemPrompt:
    params = (MODELS,)
    param_names = ("model",)
    timeout = 600
    number = 1
    repeat = 1

    def setup(self, model):
        self.path = str(model_path(model))
        kwargs = {"n_threads": _threads(), "n_batch": 512}
        self.off = shared_system_prompt(self.path, prefix_cache=False, **kwargs)
        self.on = shared_system_prompt(self.path, prefix_cache=True, **kwargs)

    def track_total_time_ratio(self, model):
        return self.off.wall_s / self.on.wall_s

    track_total_time_ratio.unit = "x"

    def track_median_ttft_ratio(self, model):
        return self.off.median_ttft_s / self.on.median_ttft_s

    track_median_ttft_ratio.unit = "x"

    def track_wall_with_reuse(self, model):
        return self.on.wall_s

    track_wall_with_reuse.unit = "s"


class MultiTurnChat:
    params = (MODELS,)
    param_names = ("model",)
    timeout = 600
    number = 1
    repeat = 1

    def setup(self, model):
        path = str(model_path(model))
        kwargs = {"n_threads": _threads(), "n_batch": 512}
        reply = 48 if model == "tiny" else 16
        self.off = multi_turn_chat(path, prefix_cache=False, reply_tokens=reply, **kwargs)
        self.on = multi_turn_chat(path, prefix_cache=True, reply_tokens=reply, **kwargs)

    def track_prefill_share(self, model):
        return self.on.prefill_tokens / self.off.prefill_tokens

    track_prefill_share.unit = "fraction"
