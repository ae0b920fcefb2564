"""Per-token helpers of the engine core: the log-probabilities of a logits row,
sampling with some tokens masked out (``min_tokens``), and a finished request's telemetry event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from llamabatch._core.logprobs import row_top_logprobs
from llamabatch._ffi.context import Context
from llamabatch._ffi.sampler import SamplerChain
from llamabatch.runtime.telemetry import RequestEvent

if TYPE_CHECKING:
    from llamabatch.generate.request import Request
    from llamabatch.outputs import CompletionOutput


def row_logprobs(context: Context, idx: int, token: int, n: int, n_vocab: int) -> dict[int, float]:
    """Log-probabilities at batch index ``idx``: the ``n`` most likely tokens (best first; of
    equal logits, the lower id first) and ``token``. One pass in C over the row, no copy
    (``_core/logprobs.pyx``): an ``n`` 16 request with ``top_logprobs`` 20 computes them for
    every row of every tick, on the engine thread."""
    return row_top_logprobs(context.logits_view(idx), min(max(n, 0), n_vocab), token)


def sample_without(context: Context, sampler: SamplerChain, idx: int, banned: Sequence[int]) -> int:
    """Sample at ``idx`` with ``banned`` tokens masked out; the logits are restored
    afterwards, so log-probabilities stay those of the model."""
    banned = list(banned)
    logits = context.logits_view(idx)
    saved = logits[banned].copy()
    logits[banned] = -np.inf
    try:
        return sampler.sample(context, idx)
    finally:
        logits[banned] = saved


def request_event(request: Request, out: CompletionOutput) -> RequestEvent:
    """The telemetry ``RequestEvent`` of a finished request."""
    ttft = out.timings.time_to_first_token
    gen_time = out.timings.total - ttft if ttft is not None else None
    prefill_time = ttft - out.timings.queue_wait if ttft is not None else None
    return RequestEvent(
        request_id=out.request_id,
        finish_reason=out.finish_reason,
        prompt_tokens=out.usage.prompt_tokens,
        completion_tokens=out.usage.completion_tokens,
        reused_tokens=out.usage.reused_tokens,
        shared_tokens=request.shared_tokens,
        queue_wait=out.timings.queue_wait,
        time_to_first_token=ttft,
        total=out.timings.total,
        prompt_tokens_per_s=(out.usage.prompt_tokens / prefill_time) if prefill_time else None,
        generation_tokens_per_s=(
            (out.usage.completion_tokens - 1) / gen_time
            if gen_time and out.usage.completion_tokens > 1
            else None
        ),
        preemptions=request.n_preemptions,
        index=request.index,
        n=request.params.n,
        itl_p50=out.timings.itl_p50,
        itl_p99=out.timings.itl_p99,
        itl_max=out.timings.itl_max,
        inter_token_latencies=tuple(np.diff(request.token_times).tolist()),
        slo_met=out.timings.slo_met,
    )
