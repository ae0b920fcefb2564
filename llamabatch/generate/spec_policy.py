"""When speculation pays: each tick's draft lengths from measured costs and acceptance.

Extra tokens in a batch are not free on a CPU: a sequence's decode with four drafts can cost
three times its decode alone, while an accepted draft saves one tick of that sequence. So
each tick the speculator chooses every speculating request's draft length ``k`` (0 allowed)
to maximise the expected generated tokens per second of the tick,

    (streams decoding + sum of expected accepted drafts) / (predicted decode time with the
     drafts + the draft model's time for the longest draft)

against the tick without drafts (which must be beaten by ``SpecPolicy.margin``):

* the decode time comes from a :class:`DecodeCostModel` fitted on every decode of the engine
  (``Speculator.observe``), so it follows the machine; the draft model's time per draft step
  is measured on its own calls (:class:`DraftTimer`);
* the expected accepted drafts come from :class:`AcceptanceModel`: per request and draft
  position, the rate at which a draft at that position was accepted once the ones before it
  were (exponentially weighted: recent drafts count most), pulled toward the request's rate
  over all positions, the engine's and a prior; n-gram drafts are estimated apart by the
  length of the suffix they matched (their class). A draft at position ``i`` is worth the
  product of the rates up to ``i``, so the worth of each further draft token falls, and the
  best lengths are the top draft tokens by worth (:func:`choose_draft_lengths`).

Consequences: one stream in a loop (drafts always accepted) drafts long runs; a request whose
drafts fail stops drafting (its estimate falls), and tries again after its evidence fades.
Above ``SpecPolicy.max_streams`` (4) decoding sequences nobody drafts: measured on a 2-core
CPU, the estimates alone let 8 streams draft and lose a third of their throughput. No timing
is built in: only a starting guess the fit replaces.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamabatch._core.slots import SlotState
from llamabatch.generate.cost_model import DecodeCostModel, TickFeatures

if TYPE_CHECKING:
    from llamabatch.generate.tick_context import TickContext

__all__ = [
    "AcceptanceModel",
    "DraftTimer",
    "RequestAcceptance",
    "SpecCostModel",
    "SpecPolicy",
    "choose_draft_lengths",
    "decode_cost_model",
    "read_between",
    "tick_cost",
]

#: the speculator's cost model's pull toward zero weights, and how far above its prediction
#: a measured decode counts (see ``decode_cost_model``)
RIDGE = 1e-4
CLIP = 2.0


@dataclass
class SpecPolicy:
    """The speculator's knobs (see the module docstring); the defaults need no tuning."""

    #: a hard cap: no drafting while more sequences than this decode (None: the costs decide).
    #: Measured on a 2-core CPU, the costs alone let 8 streams draft and lose 36% (the cost
    #: model fits llama_decode's time, but the CPU's small-batch kernels and the rows' sampling
    #: make drafts dearer than it predicts at that width), so the cap stays
    max_streams: int | None = 4
    #: the most tokens (decode + drafts) a tick's speculating part may reach
    max_batch_tokens: int = 65
    #: drafting must raise the tick's expected tokens per second by this fraction
    margin: float = 0.03
    #: the most share of recent decode time drafts may have cost, as measured
    #: (``spec_ledger.SpecLedger``; None: no bound), and the share exploration (the lessons and
    #: probes below) may have cost
    loss_share: float | None = 0.02
    explore_share: float = 0.01
    #: the first ``explore_ticks`` ticks with drafts are the cost model's lessons: the i-th
    #: holds ``explore_tokens * 2**i`` draft tokens (2, 4, 8, 16), given even where the first
    #: guesses say drafts do not pay (a line through short drafts alone misjudges long ones:
    #: on a CPU the second token of a batch is the dear one, and nothing drafted long again)
    explore_ticks: int = 4
    explore_tokens: int = 2
    #: ticks with drafts, weighted by ``evidence_decay`` per tick: below ``probe_below``, a tick
    #: where nobody would draft gives one draft token to the likeliest draft (if its chance is
    #: at least ``probe_gain``), so the cost model keeps learning what drafts cost
    evidence_decay: float = 0.98
    probe_below: float = 1.0
    probe_gain: float = 0.5
    #: per tick, the weight of a request's past drafts decays by this factor
    request_decay: float = 0.9
    #: how many drafts the engine-wide rate weighs in a request's rate (over its positions)
    request_prior_weight: float = 3.0
    #: how many drafts the request's rate weighs in one position's estimate
    position_weight: float = 4.0
    #: per tick, the weight of the engine-wide counts decays by this factor
    global_decay: float = 0.995
    #: the acceptance rate assumed before any draft was verified, and its weight in drafts
    #: (hopeful: a draft never tried is never learned about; a wrong hope costs a few drafts)
    prior: float = 0.7
    prior_weight: float = 2.0


class RequestAcceptance:
    """One request's exponentially weighted draft outcomes, by position: ``hits[i]`` of
    ``tries[i]`` drafts at position ``i`` (tried when every draft before it was accepted).
    The lists reach the furthest position tried so far (up to ``n``): each tick decays them,
    and with 64 positions allowed most are never reached."""

    __slots__ = ("hits", "tries")

    def __init__(self, n: int) -> None:
        self.hits: list[float] = []
        self.tries: list[float] = []


class AcceptanceModel:
    """Acceptance estimates per draft position: per request, pulled toward the engine's.

    Drafts come in classes (``cls``) that are estimated apart: an n-gram draft's class is the
    length of the suffix it matched (a long match, as in a loop, is right far more often than
    a two-token one); a draft model's drafts are all class 0.

    The estimate is hierarchical, as the evidence is thin where it matters: a position's rate
    (the chance that a draft there is accepted when the ones before it were) is the request's
    own evidence at that position, pulled toward the request's rate over all its positions,
    itself pulled toward the engine's rate of the class over all positions, itself pulled
    toward the prior. Positions share one rate unless their own evidence says otherwise: a
    draft model's chance of agreeing with its target hardly depends on how far the draft has
    gone, and a position no draft has reached yet is as likely as the request's others. (Per
    position engine-wide counts were tried first: one early rejection at position 8 kept every
    later request's drafts at 8 tokens, as nothing drafts there again to correct it.)"""

    def __init__(self, n: int, policy: SpecPolicy, priors: dict[int, float] | None = None) -> None:
        self.n = n
        self.policy = policy
        #: a prior per draft class, where the drafter knows better than ``policy.prior`` (the
        #: longest-match drafter: a long match goes on far more often than a short one)
        self.priors = priors or {}
        #: the engine's drafts per class, over all positions: [hits, tries] (exponentially weighted)
        self._global: dict[int, list[float]] = {}

    def _engine(self, cls: int) -> list[float]:
        g = self._global.get(cls)
        if g is None:
            g = self._global[cls] = [0.0, 0.0]
        return g

    def pooled(self, req: RequestAcceptance, cls: int = 0) -> float:
        """The request's rate over all its positions (its drafts' hits over their tries),
        pulled toward the engine's rate of the class (itself pulled toward the prior)."""
        p = self.policy
        hits, tries = self._engine(cls)
        prior = self.priors.get(cls, p.prior)
        engine = (hits + p.prior_weight * prior) / (tries + p.prior_weight)
        m = p.request_prior_weight
        return (sum(req.hits) + m * engine) / (sum(req.tries) + m)

    def rate(self, req: RequestAcceptance, i: int, cls: int = 0, pooled: float | None = None) -> float:
        """The estimated chance that a draft at position ``i`` is accepted when the drafts
        before it were (``pooled``: the request's :meth:`pooled` rate, if known)."""
        if pooled is None:
            pooled = self.pooled(req, cls)
        w = self.policy.position_weight
        if i >= len(req.tries):  # never tried there: the request's rate
            return pooled
        return (req.hits[i] + w * pooled) / (req.tries[i] + w)

    def gains(self, req: RequestAcceptance, cap: int, cls: int = 0) -> list[float]:
        """The expected accepted drafts each further draft token adds, for up to ``cap``
        tokens: the product of the rates up to its position (non-increasing)."""
        pooled = self.pooled(req, cls)
        out: list[float] = []
        g = 1.0
        for i in range(min(cap, self.n)):
            g *= self.rate(req, i, cls, pooled)
            out.append(g)
        return out

    def observe(self, req: RequestAcceptance, drafted: int, accepted: int, cls: int = 0) -> None:
        """``accepted`` of ``drafted`` drafts were accepted (the first rejection ends them)."""
        e = self._engine(cls)
        reach = min(drafted, accepted + 1, self.n)
        if len(req.tries) < reach:
            req.hits.extend([0.0] * (reach - len(req.hits)))
            req.tries.extend([0.0] * (reach - len(req.tries)))
        for i in range(reach):
            hit = 1.0 if i < accepted else 0.0
            req.hits[i] += hit
            req.tries[i] += 1.0
            e[0] += hit
            e[1] += 1.0

    def decay(self, req: RequestAcceptance) -> None:
        """A tick passed for ``req`` (its older drafts weigh less)."""
        f = self.policy.request_decay
        req.hits = [h * f for h in req.hits]
        req.tries = [t * f for t in req.tries]

    def tick(self) -> None:
        """A tick passed for the engine-wide counts."""
        f = self.policy.global_decay
        for e in self._global.values():
            e[0] *= f
            e[1] *= f


class DraftTimer:
    """The draft model's seconds per draft step (one batched draft decode over all requests),
    exponentially weighted over its measured calls; 0 until one was measured."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.per_step = 0.0
        self.n_observed = 0
        self.n_calls = 0

    def observe(self, seconds: float, steps: int) -> None:
        if steps <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self.n_calls += 1
        if self.n_calls == 1:
            # the draft model's first decode pages its weights in (often 100x a later one's
            # time): counted, the drafts would look too dear to try again for a long while
            return
        x = seconds / steps
        self.per_step = x if not self.n_observed else self.per_step + self.weight * (x - self.per_step)
        self.n_observed += 1

    def predict(self, steps: int) -> float:
        return self.per_step * steps


class SpecCostModel:
    """The speculator's decode cost model: ``llama_decode``'s time by the tick's tokens.

    On a CPU the cost is not a line: one token runs matrix-vector kernels (10 ms for the 135M
    model on 2 cores), two tokens the matrix ones (20 ms), then each token adds less (5 tokens
    34 ms, 9 tokens 57, 17 tokens 85, 30 tokens 131). A line fitted where drafts run (10 to
    15 tokens) put a one-token draft at 34 ms, so short drafts never ran again to correct it;
    a line through a prompt's 512-token chunks (the first one also paying for the compute
    buffers) once priced a draft token at 100 ms. So the measured seconds are kept by size:
    one-token ticks a running mean of their own, ticks of 2, 3-4, 5-8, ... tokens the running
    mean of their tokens and seconds, and a tick's time is read between the sizes measured
    (never falling with more tokens; past the largest, along the last step's slope). Until a
    second size is measured, the linear :class:`DecodeCostModel` (``decode_cost_model``)
    stands in: with no ticks of drafts seen, drafts look cheap and the first lessons measure
    them. Ticks of more than ``fit_tokens`` tokens or with fewer logits rows than half their
    tokens (a prompt's chunks) are left out: the drafts' ticks are small, and all rows."""

    def __init__(self, fit_tokens: int = 128, weight: float = 0.1) -> None:
        self.fit_tokens = fit_tokens
        self.weight = weight
        #: the stand-in until two sizes are measured
        self.multi = decode_cost_model()
        #: seconds of a one-token tick (exponentially weighted), and how many were measured
        self.single = 0.0
        self.n_single = 0
        #: by size class (``(tokens - 1).bit_length()``): running means of [tokens, seconds]
        self.sizes: dict[int, list[float]] = {}
        self._points: list[tuple[float, float]] | None = None  # (tokens, seconds), rising

    def observe(self, features: TickFeatures, seconds: float) -> None:
        """Count one measured decode (attended cells are left out: see ``Speculator.observe``)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        w = self.weight
        if features.tokens <= 1:
            self.single = seconds if not self.n_single else self.single + w * (seconds - self.single)
            self.n_single += 1
            self._points = None
            return
        if features.tokens > self.fit_tokens or 2 * features.outputs < features.tokens:
            return
        multi = self.multi
        # the first decodes unclipped: they set the scale the clip works from
        multi.clip = CLIP if multi.n_observed >= 8 else math.inf
        multi.observe(TickFeatures(features.tokens, features.outputs, 0.0), seconds)
        size = self.sizes.get((features.tokens - 1).bit_length())
        if size is None:
            self.sizes[(features.tokens - 1).bit_length()] = [float(features.tokens), seconds]
        else:
            size[0] += w * (features.tokens - size[0])
            size[1] += w * (seconds - size[1])
        self._points = None

    def points(self) -> list[tuple[float, float]]:
        """The measured (tokens, seconds) by size, rising in both (empty: fewer than two)."""
        if self._points is None:
            raw = sorted((t, s) for t, s in self.sizes.values())
            if self.n_single:
                raw.insert(0, (1.0, self.single))
            points: list[tuple[float, float]] = []
            for t, s in raw:
                points.append((t, max(s, points[-1][1]) if points else s))
            self._points = points if len(points) >= 2 else []
        return self._points

    def largest_size(self) -> int:
        """The most tokens a measured size holds (its class's upper bound; 0: none)."""
        return 1 << max(self.sizes) if self.sizes else 0

    def seconds(self, tokens: int) -> float | None:
        """The predicted seconds of a tick of ``tokens`` tokens from the sizes measured (None
        until two are)."""
        points = self.points()
        return read_between(points, tokens) if points else None

    def predict(self, features: TickFeatures) -> float:
        if features.tokens <= 1 and self.n_single:
            return self.single
        sized = self.seconds(features.tokens)
        return self.multi.predict(features) if sized is None else sized


def read_between(points: Sequence[tuple[float, float]], tokens: int) -> float:
    """Seconds for ``tokens`` read between measured (tokens, seconds) ``points`` (two or more,
    rising): linear between neighbours, past the last along the last step's slope."""
    if tokens <= points[0][0]:
        return points[0][1] * max(tokens, 0) / points[0][0]
    for (t0, s0), (t1, s1) in itertools.pairwise(points):
        if tokens <= t1:
            return s0 + (s1 - s0) * (tokens - t0) / max(t1 - t0, 1e-9)
    (t0, s0), (t1, s1) = points[-2], points[-1]
    return s1 + (s1 - s0) / max(t1 - t0, 1e-9) * (tokens - t1)


def decode_cost_model() -> DecodeCostModel:
    """The speculator's decode cost model: a ``DecodeCostModel`` that starts from nothing,
    with a weak pull toward zero weights (``RIDGE``, in the model's scaled features, where a
    tick's features are about 1) and a loose clip (a decode may count up to ``CLIP`` times
    above the prediction), so a few measured decodes set it whatever their scale (a 100 us
    tick of a tiny model or a 30 ms one). What the decodes do not tell apart (one stream's
    ticks all hold one token and one logits row) goes mostly to the fixed cost, so drafts
    look cheap until ticks with drafts are measured: the first ticks try drafts and the fit
    learns what they cost (a guess under which drafts never ran could never learn it).
    ``DecodeCostModel`` derives its pull from its prior (as strong as one decode with a
    millisecond's noise), which would swamp a fast tick's measurements: ``ridge`` sets it."""
    return DecodeCostModel(prior=(0.0, 0.0, 0.0, 0.0), clip=CLIP, ridge=RIDGE)


def tick_cost(
    core: TickContext, n_decode: int, model: DecodeCostModel | SpecCostModel
) -> Callable[[int], float]:
    """The predicted decode time (seconds) of this tick's batch with ``d`` draft tokens: its
    decode tokens, the prompt tokens its budget lets the plan take and the drafts, each draft
    with its logits row, as ``model`` predicts it."""
    table = core.table
    busy = [s for s, _ in core.slots.busy()]
    pending = sum(table.n_pending(s) for s in busy)
    prefill = max(0, min(core.budget - n_decode, pending))
    decode_past = sum(table.n_past(s) + 1 for s in busy if table.state(s) == SlotState.DECODE)
    used = table.cells_used
    unified = table.kv_unified
    single = None
    if isinstance(model, SpecCostModel):
        points = model.points()
        if points:  # measured by size: read there (as measured now)
            return lambda d: read_between(points, n_decode + prefill + d)
        single = model.single if model.n_single else None
        model = model.multi
    # the model is linear: its coefficients once, then arithmetic (called ~60 times a tick)
    c0 = model.predict(TickFeatures(0, 0, 0.0))
    c_token = model.predict(TickFeatures(1, 0, 0.0)) - c0
    c_output = model.predict(TickFeatures(0, 1, 0.0)) - c0
    c_cell = model.predict(TickFeatures(0, 0, 1.0)) - c0
    outputs0 = n_decode + (1 if prefill else 0)

    def cost(d: int) -> float:
        n = n_decode + prefill + d
        if n == 1 and single is not None:
            return single
        attended = float(n * (used + n)) if unified else float(decode_past * (1 + d / max(n_decode, 1)))
        return max(0.0, c0 + c_token * n + c_output * (outputs0 + d) + c_cell * attended)

    return cost


def choose_draft_lengths(
    gains: Sequence[Sequence[float]],
    n_emit: int,
    cost: Callable[[int, int], float],
    room: int,
    margin: float = 0.0,
) -> list[int]:
    """The draft length of each request that maximises the tick's expected tokens per second.

    ``gains[r][i]``: the expected accepted drafts that request ``r``'s ``i``-th draft token
    adds (non-increasing in ``i``; its length is the most ``r`` may draft); ``n_emit``: the
    tokens the tick emits without drafts (one per decoding stream); ``cost(total, longest)``:
    the predicted seconds of the tick with ``total`` draft tokens whose longest run is
    ``longest``; ``room``: the most draft tokens in all. For each total, the best drafts are
    the ones worth most (a request's tokens come in position order); the best total wins if
    its rate beats the tick without drafts by ``margin`` (a fraction), else nobody drafts."""
    ks = [0] * len(gains)
    if not any(gains):  # nothing to draft: no cost to predict
        return ks
    order = sorted(
        ((g, i, r) for r, gs in enumerate(gains) for i, g in enumerate(gs) if g > 0),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    base = n_emit / max(cost(0, 0), 1e-12)
    best_rate, best_total = base * (1.0 + margin), 0
    expected = float(n_emit)
    longest = 0
    for total, (g, _, r) in enumerate(order[: max(0, room)], start=1):
        ks[r] += 1
        longest = max(longest, ks[r])
        expected += g
        rate = expected / max(cost(total, longest), 1e-12)
        if rate > best_rate:
            best_rate, best_total = rate, total
    out = [0] * len(gains)
    for _, _, r in order[:best_total]:
        out[r] += 1
    return out
