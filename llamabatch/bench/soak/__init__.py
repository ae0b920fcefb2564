"""``llamabatch bench-soak``: many mixed requests from many threads, with random
cancellations, ``close()``/reopen cycles and injected decode faults, checking that no
request is lost, none ends twice, and nothing is left behind.

This is a soak benchmark, not a unit test. ``N`` requests (prompts) go through one
:class:`llamabatch.LLM` at a time from ``T`` client threads: ``T - 1`` blocking threads
(``submit`` + ``result``, iterating a handle, ``generate`` of one to three prompts,
``stream``) and one thread running an asyncio loop (``agenerate``, ``astream``). Requests
mix prompt lengths, ``max_tokens``, greedy and sampled decoding, seeds, ``n > 1``, stop
strings, grammars, log-probabilities and penalties. Some are cancelled: ``handle.cancel()``,
a stream closed early, an asyncio task cancelled.

Every ``close_every`` requests the LLM is closed and a new one opened, alternating the two
KV layouts: ``kv_unified=True`` with a tight ``n_ctx`` (admission control and preemption
at work) and ``kv_unified=False`` (one stream per sequence). Half of the closes are abrupt
(requests in flight end ``"cancelled"``; submissions racing the close get ``EngineClosed``
and count as refused, not lost); the others are *drained*: the clients pause, every
request ends, one probe request must still complete normally (the engine serves after its
faults), then the prefix cache is cleared and the KV cache must be empty
(``stats().kv_cells_used == 0`` and ``seq_pos_max(seq) == -1`` for every sequence). The
last LLM's life is always drained.

A fault injector calls ``llm.context.abort()`` at random moments: the running (or next)
``llama_decode`` returns 2, and the engine must end that batch's requests with
``finish_reason="error"`` and keep serving. One fault is pending at a time, so each is
accounted for: consumed by a failed batch, or absorbed by a close.

Accounting: a ``RequestEvent`` listener on every LLM counts the ends of every completion
(request id, index); the callers record what they got. Every completion whose id a caller
learnt must end exactly once, with the finish reason the caller saw; the completions no
caller could name (a task cancelled before its first delta) must match, in number, the
ends nobody claimed. Waits have timeouts: a request that never ends is reported, never
waited for forever.

The package: ``config.py`` (``SoakConfig``), ``workload.py`` (the requests), ``ledger.py`` (the
accounting), ``run.py`` (the controller, ``run_soak``), ``clients.py`` (the clients),
``result.py`` (``SoakResult``, the invariants), ``report.py`` and ``cli.py``.
"""

from llamabatch.bench.soak.cli import add_arguments, main
from llamabatch.bench.soak.config import MAX_SEQ_TOKENS, SoakConfig
from llamabatch.bench.soak.ledger import Dispenser, Gate, Holder, Ledger, Life
from llamabatch.bench.soak.report import soak_report
from llamabatch.bench.soak.result import SoakResult
from llamabatch.bench.soak.run import run_soak

__all__ = [
    "MAX_SEQ_TOKENS",
    "Dispenser",
    "Gate",
    "Holder",
    "Ledger",
    "Life",
    "SoakConfig",
    "SoakResult",
    "add_arguments",
    "main",
    "run_soak",
    "soak_report",
]
