"""Prompt log-probabilities (vLLM's ``SamplingParams.prompt_logprobs``; ``echo`` with
``logprobs`` on ``/v1/completions``, as lm-evaluation-harness scores a text).

A scoring request computes its whole prompt (no cached prefix: a reused token has no
logits), and every prompt row of its prefill ticks is an output of the decode
(``SlotTable.start(score_chunk=...)``). After each decode the rows are read here: row ``j``
of a chunk starting at position ``p0`` is the model's distribution of the prompt token at
``p0 + j + 1``. Position 0 has none (``None``), as in vLLM.

llama.cpp keeps an output buffer as large as the most rows one decode asked for, so a
scoring slot takes at most ``SCORE_FLOATS`` logits a tick (``score_chunk``): 170 rows on a
49k vocabulary, 32 MiB.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from llamabatch._core.logprobs import row_top_logprobs

if TYPE_CHECKING:
    from llamabatch.generate.request import Request

#: the most logits (floats) one scoring slot's prompt rows take in a tick
SCORE_FLOATS = 1 << 23
#: ... but never fewer rows than this a tick
MIN_SCORE_ROWS = 16


def score_chunk(request: Request, n_vocab: int) -> int:
    """The ``score_chunk`` to start ``request`` with: 0 when it wants no prompt
    log-probabilities or has them all (a request preempted after its prompt was computed)."""
    wanted = request.state.prompt_logprobs
    if wanted is None or request.t_first_token is not None:
        return 0
    return max(MIN_SCORE_ROWS, SCORE_FLOATS // max(n_vocab, 1))


def record(core: Any) -> None:
    """Read the prompt log-probabilities of every scoring slot in the last decode (its rows
    are the batch indices ``batch_index .. + tokens_in_batch``, all outputs)."""
    table, context = core.table, core.context
    for slot, request in core.slots.busy():
        scores = request.state.prompt_logprobs
        k = table.tokens_in_batch(slot)
        if scores is None or not k:
            continue
        p0 = table.n_past(slot) - k  # (after the commit)
        prompt = request.prompt_tokens
        n = min(request.params.prompt_logprobs or 0, context.model.n_vocab)
        rows = context.logits_block(table.batch_index(slot), k)
        for j in range(min(k, len(prompt) - 1 - p0)):  # a recomputed output token has none
            scores[p0 + j + 1] = row_top_logprobs(rows[j], n, prompt[p0 + j + 1])


def output_logits(context: Any, table: Any, outputs: list[tuple[int, int]]) -> Any:
    """The tick's sampling rows as ``(len(outputs), n_vocab)`` logits: a view of the output
    buffer, or, when prompt rows sit among them, a copy of each row."""
    if not table.n_score_rows:
        return context.logits_rows(len(outputs))
    return np.stack([context.logits_view(idx) for _, idx in outputs])
