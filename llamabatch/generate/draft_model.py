"""The draft-model method of speculative decoding: a small model drafts, the target verifies.

:class:`DraftModelDrafter` owns the draft :class:`~llamabatch._ffi.model.Model` and its own
:class:`~llamabatch._ffi.context.Context` (one sequence per engine slot, unified KV). Each tick,
:meth:`DraftModelDrafter.draft` drafts for *all* speculating requests together:

1. one batch brings every request's draft sequence up to its history (prompt + output so far):
   the tokens the draft KV holds beyond the longest common prefix with the history (rejected
   drafts, or everything after a preemption) are removed with ``llama_memory_seq_rm``, the new
   ones fed (a first prompt larger than the batch is fed in several decodes);
2. then at most ``k - 1`` more decodes, each ONE ``llama_decode`` over all requests still
   drafting, one token each.

So the draft KV of a request always equals a prefix of its history plus the last drafts; no
per-request decode, and no hook is needed for commits: the next :meth:`draft` reconciles.
:meth:`release` frees a request's sequence when it ends or is preempted.

Drafting per acceptance rule (:func:`llamabatch.generate.spec_accept.acceptance_rule`):
``"sampled"`` draws each draft token from ``q``, the draft's distribution under the request's own
sampling params, and keeps ``q`` for :meth:`verify`; ``"greedy"`` and ``"match"`` draft the draft
model's argmax. A request's random draws come from one ``numpy`` generator seeded from
``SamplingParams.seed`` (reproducible), kept across preemption.
"""

from __future__ import annotations

import os
import random
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llamabatch._core.batch import Batch, BatchPool
from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch._ffi.vocab_compat import vocab_facts, vocab_mismatch
from llamabatch.errors import DraftModelMismatch
from llamabatch.generate.spec_accept import (
    AcceptanceRule,
    accept_greedy,
    accept_sampled,
    acceptance_rule,
    processed_probs,
    sample_from,
)

if TYPE_CHECKING:
    from llamabatch.params import SamplingParams

__all__ = ["Draft", "DraftJob", "DraftModelDrafter", "load_draft_model"]


@dataclass
class DraftJob:
    """One request to draft for: ``key`` names it (stable for its life), ``prompt`` and
    ``output`` are its tokens so far (the last one not yet decoded by the target), ``k`` the
    most tokens to draft."""

    key: Hashable
    prompt: Sequence[int]
    output: Sequence[int]
    k: int
    params: SamplingParams


@dataclass
class Draft:
    """Drafted tokens; ``q[i]`` is the distribution ``tokens[i]`` was drawn from (rule
    ``"sampled"`` only, else None)."""

    tokens: list[int]
    rule: AcceptanceRule
    q: np.ndarray | None = None


@dataclass
class _Sequence:
    seq_id: int
    tokens: list[int] = field(default_factory=list)  # exactly what the draft KV holds, by position
    stable: int = 0  # tokens[:stable] were history (not drafts) at the last sync


_Work = tuple[DraftJob, _Sequence, Draft]


def load_draft_model(path: str | os.PathLike[str], target: Model) -> Model:
    """Load the draft model at ``path`` and check it can draft for ``target``.

    Raises what :class:`Model` raises for a missing or corrupt file (``FileNotFoundError``,
    ``ModelLoadError``), and :class:`~llamabatch.errors.DraftModelMismatch` (a ``ValueError``)
    when the vocabularies differ.
    """
    model = Model(path)
    try:
        if not model.generates_text:
            raise DraftModelMismatch(f"draft model {model.path.name} does not generate text")
        reason = vocab_mismatch(vocab_facts(model), vocab_facts(target))
        if reason is not None:
            raise DraftModelMismatch(
                f"draft model {model.path.name} cannot draft for {target.path.name}: "
                f"their vocabularies differ: {reason}"
            )
    except BaseException:
        model.close()
        raise
    return model


class DraftModelDrafter:
    """Drafts with a small model for every speculating request, in batched decodes.

    Args:
        path: the draft GGUF.
        target: the engine's model (the vocabularies must match).
        n_seq: sequences in the draft context (the engine's ``n_parallel``).
        n_ctx: the draft context's size (cells shared by all sequences).
        n_batch: tokens per draft decode.
        n_threads: CPU threads for the draft's decodes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        target: Model,
        *,
        n_seq: int,
        n_ctx: int,
        n_batch: int = 512,
        n_threads: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.model = load_draft_model(path, target)
        try:
            self.context = Context(
                self.model,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_seq_max=n_seq,
                n_threads=n_threads,
                kv_unified=True,
            )
        except BaseException:
            self.model.close()
            raise
        self._pool = BatchPool(self.context.n_batch, 1, 1)
        self._eog = self.model.eog_flags()
        self._free = list(range(n_seq - 1, -1, -1))
        self._seqs: dict[Hashable, _Sequence] = {}
        self._rngs: dict[Hashable, np.random.Generator] = {}
        #: Draft decodes run and tokens drafted (telemetry, tests).
        self.n_decodes = 0
        self.n_drafted = 0
        #: failed draft decodes in a row (no KV room), and draft() calls still to skip after them
        self.n_failures = 0
        self._skip = 0

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, object],
        target: Model,
        *,
        n_seq: int,
        n_ctx: int,
        n_batch: int = 512,
        n_threads: int | None = None,
    ) -> DraftModelDrafter:
        """The drafter of ``speculative_config`` ``{"method": "draft_model", "model": path,
        "num_speculative_tokens": k}`` for an engine of ``n_seq`` slots and ``n_ctx`` cells: the
        draft context gets ``n_ctx + n_seq * k`` cells (room for each sequence's drafts)."""
        path = config.get("model")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(
                "speculative_config['model'] must be the path of the draft GGUF for method 'draft_model', "
                f"got {path!r}"
            )
        k = config.get("num_speculative_tokens", 0)
        k = k if isinstance(k, int) and k > 0 else 0
        return cls(path, target, n_seq=n_seq, n_ctx=n_ctx + n_seq * k, n_batch=n_batch, n_threads=n_threads)

    # -- per request ------------------------------------------------------------------

    def rng(self, key: Hashable, params: SamplingParams) -> np.random.Generator:
        """The request's generator (seeded from ``params.seed``; a random seed when None)."""
        gen = self._rngs.get(key)
        if gen is None:
            seed = params.seed if params.seed is not None else random.getrandbits(64)
            gen = self._rngs[key] = np.random.default_rng([seed, 0x5EC])
        return gen

    def release(self, key: Hashable, *, done: bool = True) -> None:
        """Free the draft sequence of ``key`` (it ended, or ``done=False``: it was preempted and
        keeps its random generator). Idempotent."""
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.context.seq_rm(seq.seq_id)
            self._free.append(seq.seq_id)
        if done:
            self._rngs.pop(key, None)

    def holds(self, key: Hashable) -> list[int] | None:
        """The tokens the draft KV holds for ``key`` (None: no sequence); for tests."""
        seq = self._seqs.get(key)
        return None if seq is None else list(seq.tokens)

    @property
    def n_free_sequences(self) -> int:
        """Draft sequences not assigned to a request."""
        return len(self._free)

    # -- drafting ---------------------------------------------------------------------

    def draft(self, jobs: Iterable[DraftJob]) -> dict[Hashable, Draft]:
        """Draft up to ``job.k`` tokens for each job (see the module doc); a request gets no
        entry when it has nothing to draft or no sequence is free. A failed draft decode (no KV
        room) drafts nothing this time, clears the draft KV of the requests involved and skips
        the next ``2 ** n`` calls after ``n`` failures in a row (at most 256), so a draft
        context too small for the moment does not refill its KV every tick."""
        if self._skip > 0:
            self._skip -= 1
            return {}
        work: list[_Work] = []
        batch = self._pool.acquire()
        try:
            rows: list[tuple[int, int]] = []  # (work index, batch index) awaiting logits
            for job in jobs:
                if job.k <= 0 or len(job.prompt) + len(job.output) == 0:
                    continue
                seq = self._sequence(job.key)
                if seq is None:
                    continue
                work.append((job, seq, Draft([], acceptance_rule(job.params))))
                feed = self._sync(seq, job.prompt, job.output)
                pos = len(seq.tokens)
                seq.tokens.extend(feed)
                seq.stable = len(seq.tokens)
                n_prompt = len(job.prompt)
                for i, token in enumerate(feed):
                    # the prompt ends a batch, as the target prefilled it alone: a row's
                    # rounding in ggml depends on the batch it is in, and a draft computed
                    # as its target computed it agrees with it to the bit
                    if batch.n_free == 0 or (pos + i == n_prompt and batch.n_tokens):
                        if not self._decode(batch, rows, work):
                            return {}
                        rows = []
                    last = i == len(feed) - 1
                    if last:
                        rows.append((len(work) - 1, batch.n_tokens))
                    batch.add(token, pos + i, seq.seq_id, last)
            if batch.n_tokens and not self._decode(batch, rows, work):
                return {}
            for _ in range(max((job.k for job, _, _ in work), default=0) - 1):
                rows = []
                for index, (job, seq, draft) in enumerate(work):
                    if 0 < len(draft.tokens) < job.k and not self._eog[draft.tokens[-1]]:
                        rows.append((index, batch.n_tokens))
                        batch.add(draft.tokens[-1], len(seq.tokens), seq.seq_id, True)
                        seq.tokens.append(draft.tokens[-1])
                if not rows or not self._decode(batch, rows, work):
                    break
        finally:
            self._pool.release(batch)
        out: dict[Hashable, Draft] = {}
        for job, _, draft in work:
            if draft.tokens:
                if draft.q is not None:
                    draft.q = draft.q[: len(draft.tokens)]
                out[job.key] = draft
                self.n_drafted += len(draft.tokens)
        return out

    def _sequence(self, key: Hashable) -> _Sequence | None:
        seq = self._seqs.get(key)
        if seq is None and self._free:
            seq = self._seqs[key] = _Sequence(self._free.pop())
        return seq

    def _sync(self, seq: _Sequence, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        """Cut ``seq``'s KV back to its longest common prefix with the history (at most all
        but the history's last token, whose logits are needed) and return the tokens to feed."""
        n_prompt, n = len(prompt), len(prompt) + len(output)

        def at(i: int) -> int:
            return int(prompt[i]) if i < n_prompt else int(output[i - n_prompt])

        held = seq.tokens
        limit = min(len(held), n - 1)
        c = min(seq.stable, limit)
        if c > 0 and held[c - 1] != at(c - 1):
            c = 0  # not the history it was synced to: compare from the start
        while c < limit and held[c] == at(c):
            c += 1
        if c < len(held):
            self.context.seq_rm(seq.seq_id, c, -1)
            del held[c:]
        return [at(i) for i in range(c, n)]

    def _decode(self, batch: Batch, rows: list[tuple[int, int]], work: list[_Work]) -> bool:
        code = self.context.decode_address(batch.address)
        self.n_decodes += 1
        batch.clear()
        if code != 0:
            self.n_failures += 1
            self._skip = min(256, 2**self.n_failures)
            for _job, seq, draft in work:  # the KV may hold part of the batch: start over
                self.context.seq_rm(seq.seq_id)
                seq.tokens.clear()
                seq.stable = 0
                draft.tokens.clear()
            return False
        self.n_failures = 0
        for index, batch_index in rows:
            job, _, draft = work[index]
            logits = self.context.logits_view(batch_index)
            if draft.rule == "sampled":
                q = processed_probs(logits, job.params)
                if draft.q is None:
                    draft.q = np.empty((job.k, q.shape[0]), dtype=np.float64)
                draft.q[len(draft.tokens)] = q
                draft.tokens.append(sample_from(q, self.rng(job.key, job.params)))
            else:
                draft.tokens.append(int(np.argmax(logits)))
        return True

    # -- verification -----------------------------------------------------------------

    def verify(
        self, key: Hashable, draft: Draft, target_logits: np.ndarray, params: SamplingParams
    ) -> tuple[int, int]:
        """``(n_accepted, next_token)`` for a ``"greedy"`` or ``"sampled"`` draft, from the
        target's logits at the ``len(draft.tokens) + 1`` verified positions (rows in order).
        A ``"match"`` draft is verified by the target's own sampler chain instead."""
        if draft.rule == "greedy":
            return accept_greedy(np.argmax(target_logits, axis=1), draft.tokens)
        if draft.rule == "sampled" and draft.q is not None:
            p = processed_probs(target_logits, params)
            return accept_sampled(p, draft.q, draft.tokens, self.rng(key, params))
        raise ValueError(f"a {draft.rule!r} draft is verified by the request's sampler chain")

    def close(self) -> None:
        """Free the draft context and model. Idempotent."""
        self.context.close()
        self.model.close()
        self._seqs.clear()
