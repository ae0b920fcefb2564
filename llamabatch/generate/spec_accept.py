"""The acceptance rules of speculative decoding, on numpy arrays (no llama.cpp here).

Which rule a request gets (:func:`acceptance_rule`):

* ``"greedy"`` (``temperature == 0``): accept the longest draft prefix that equals the target's
  argmax at each position; the next token is the target's argmax after it.
* ``"sampled"`` (the draft-model method, a sampled request whose sampling distribution this
  module can compute exactly: temperature, ``top_k``, ``top_p``, ``min_p``, ``logit_bias``): the
  standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023). Draft token ``x``
  drawn from the draft's distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``,
  ``p`` being the target's distribution; at the first rejection the next token is drawn from the
  residual ``max(0, p - q)`` normalised; after a fully accepted run a bonus token is drawn from
  the target's ``p`` at the next position. Every emitted token is then distributed exactly as the
  target alone would sample it.
* ``"match"`` (everything else: grammars / JSON schemas, repetition / frequency / presence
  penalties, ``typical_p``, ``min_tokens``, DRY, XTC, top-n-sigma, mirostat, and every n-gram
  draft): the target samples each
  position with the request's own llama.cpp sampler chain, and the draft is accepted while the
  target's sample equals it. Also exact: each emitted token is the target's own sample.

:func:`processed_probs` reproduces the distribution llama.cpp's chain (``_ffi/sampler.py``:
logit bias, top-k, top-p, min-p, temperature, then a draw) samples from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from llamabatch.params import SamplingParams

__all__ = [
    "AcceptanceRule",
    "accept_greedy",
    "accept_sampled",
    "acceptance_rule",
    "processed_probs",
    "sample_from",
]

AcceptanceRule = Literal["greedy", "sampled", "match"]
#: the sampler stages whose distribution :func:`processed_probs` computes exactly
_EXACT_STAGES = frozenset({"logit_bias", "top_k", "top_p", "min_p", "temperature", "dist"})


def acceptance_rule(params: SamplingParams) -> AcceptanceRule:
    """The rule a draft-model draft of a request with ``params`` is verified by (module doc)."""
    if params.greedy:
        return "greedy"
    exotic = set(params.active_stages) - _EXACT_STAGES  # grammar, penalties, DRY, XTC, mirostat...
    return "match" if exotic else "sampled"


def processed_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the request's sampler chain draws from, for each row of ``logits``.

    ``logits``: ``(n, n_vocab)`` (or one ``(n_vocab,)`` row); returns float64 probabilities of the
    same shape. In llama.cpp's order: logit bias, top-k, top-p and min-p (both on the softmax of
    the untempered logits, keeping at least one token), temperature, softmax.
    """
    full = np.array(logits, dtype=np.float64, ndmin=2)
    for token, bias in (params.logit_bias or {}).items():
        full[:, token] += bias
    n_vocab = full.shape[1]
    if not 0 < params.top_k < n_vocab:
        out = _filtered_softmax(full, params)
    else:  # work on the top-k candidates only (cheap for a large vocabulary)
        top = np.argpartition(-full, params.top_k - 1, axis=1)[:, : params.top_k]
        out = np.zeros_like(full)
        np.put_along_axis(out, top, _filtered_softmax(np.take_along_axis(full, top, axis=1), params), axis=1)
    return out if np.ndim(logits) == 2 else out[0]


def _filtered_softmax(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Top-p, min-p, temperature and softmax over the candidate logits ``x`` (modified)."""
    if params.top_p < 1.0:
        order = np.argsort(-x, axis=1, kind="stable")
        sorted_x = np.take_along_axis(x, order, axis=1)
        probs = _softmax(sorted_x)
        cum = np.cumsum(probs, axis=1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        keep_sorted = np.concatenate([np.ones((x.shape[0], 1), bool), cum[:, :-1] < params.top_p], axis=1)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=1)
        x[~keep] = -np.inf
    if params.min_p > 0.0:
        top = x.max(axis=1, keepdims=True)
        x[x < top + np.log(params.min_p)] = -np.inf
    x /= params.temperature
    return _softmax(x)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token drawn from the distribution ``probs`` (need not be normalised)."""
    cum = np.cumsum(probs)
    index = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return min(index, len(cum) - 1)


def accept_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> tuple[int, int]:
    """``(n_accepted, next_token)``: the longest prefix of ``draft`` equal to ``target_argmax``
    (the target's argmax at each of the ``len(draft) + 1`` positions), and the target's token at
    the first position after it."""
    n = 0
    while n < len(draft) and int(draft[n]) == int(target_argmax[n]):
        n += 1
    return n, int(target_argmax[n])


def accept_sampled(
    p: np.ndarray, q: np.ndarray, draft: Sequence[int], rng: np.random.Generator
) -> tuple[int, int]:
    """The speculative-sampling rule: ``(n_accepted, next_token)``.

    ``p``: the target's distributions at the ``len(draft) + 1`` positions (``(k + 1, n_vocab)``);
    ``q``: the draft's distributions the draft tokens were drawn from (``(k, n_vocab)``).
    ``next_token`` is the residual sample at the first rejection, else the bonus token from
    ``p[k]``. The emitted tokens ``draft[:n_accepted] + [next_token]`` are distributed as the
    target's own samples.
    """
    k = len(draft)
    if p.shape[0] != k + 1 or q.shape[0] < k:
        raise ValueError(f"need {k + 1} target rows and {k} draft rows, got {p.shape[0]} and {q.shape[0]}")
    for i in range(k):
        x = int(draft[i])
        px, qx = float(p[i, x]), float(q[i, x])
        if qx <= 0.0:  # cannot happen for a token drawn from q; treat as a rejection
            ratio = 0.0
        else:
            ratio = px / qx
        if ratio >= 1.0 or rng.random() < ratio:
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        if not residual.sum() > 0.0:  # p == q up to rounding: the residual is p itself
            residual = p[i]
        return i, sample_from(residual, rng)
    return k, sample_from(p[k], rng)
