"""A cost model of ``llama_decode``, fitted online, and the tick budget it implies.

``target_itl_ms`` (``EngineConfig``) bounds each tick's expected decode time: every running
stream waits one tick per token, so the tick time *is* their inter-token latency. The
expected time of a batch comes from :class:`DecodeCostModel`, a linear model

    t = w0 + w1 * tokens + w2 * outputs + w3 * attended

(``tokens``: batch tokens; ``outputs``: rows of logits, one per sequence that samples;
``attended``: KV cells attended, summed over the batch's tokens), fitted by exponentially
weighted non-negative least squares from the engine's own measured decodes, so it follows
the machine when it gets slower or faster (the weight of a tick halves about every 35 ticks).
It starts from conservative priors (a slow machine): the first ticks prefill in small
chunks, and the chunks grow as measured ticks come in.

:class:`LatencyBudget` turns the model into each tick's token budget: the decoding streams
always get their token, and the prefill tokens are the most whose predicted tick stays
under the target, and at least one while a prompt waits: the floor that keeps prefill
moving when the decodes alone fill the target. It cannot starve: the running streams are
finite, and prompt chunks go to the oldest prompt first. The floor is one token, not a
chunk: a 32-token floor made every tick of a long prompt overshoot (1 decode + 32 prompt
tokens at 1,000 tokens of context take 145 ms on a 2-core CPU, six times a 24 ms target;
ggml's CPU flash attention costs ~2x more per token in chunks of 32 or fewer than of 64+),
and measured on mixed arrivals it lost on ITL and TTFT alike to chunks that fit the target.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llamabatch._core.slots import SlotState, SlotTable

__all__ = ["DecodeCostModel", "LatencyBudget", "TickFeatures", "most_within"]

#: ticks whose prediction error sets the latency budget's margin
_ERROR_WINDOW = 64

# Feature scales: each feature divided by its scale is about 1 in a typical tick, so the
# covariance starts well conditioned.
_SCALES = np.array([1.0, 64.0, 8.0, 65536.0])
#: the typical noise of a measured decode (seconds)
_NOISE = 1e-3
#: time between two decodes, beyond twice the later one, taken for an idle engine (seconds)
_IDLE = 0.05


@dataclass(frozen=True, slots=True)
class TickFeatures:
    """What a batch holds, as the cost model reads it."""

    tokens: int
    outputs: int
    attended: float

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.tokens, self.outputs, self.attended]) / _SCALES


class DecodeCostModel:
    """``llama_decode`` time (seconds) as a linear function of :class:`TickFeatures`, fitted
    online: exponentially weighted least squares (forgetting factor ``forgetting`` per
    measured decode) with non-negative weights, and a weak pull toward ``prior`` that holds
    the weights no tick has told apart yet (prompt tokens and attended cells often grow
    together) at the prior's conservative values.

    ``prior`` is the starting guess (seconds per feature unit: fixed, per token, per
    output, per attended cell); the default is a slow machine, so the first budgets err
    on the short side. A measurement far from the prediction is clipped (to a relative
    error of ``clip``) so one stalled tick (the OS, a page fault) does not throw the model.
    The weights are solved again every ``refit_every`` measurements (every one at first).
    """

    def __init__(
        self,
        prior: tuple[float, float, float, float] = (0.02, 0.01, 0.005, 2e-6),
        *,
        forgetting: float = 0.98,
        clip: float = 1.0,
        refit_every: int = 4,
        ridge: float | None = None,
    ) -> None:
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {forgetting!r}")
        self.prior = np.array(prior, dtype=np.float64) * _SCALES
        self.weights = self.prior.copy()
        # the pull toward the prior: by default as strong as one measurement of about a
        # millisecond's noise says about a weight as large as the prior's; ``ridge``: the same
        # pull on every (scaled) weight
        if ridge is None:
            self._ridge = np.diag((_NOISE / np.maximum(self.prior, 1e-3)) ** 2)
        else:
            self._ridge = np.eye(4) * ridge
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)
        self.forgetting = forgetting
        self.clip = clip
        self.refit_every = refit_every
        #: measurements fitted so far
        self.n_observed = 0

    def predict(self, features: TickFeatures) -> float:
        """The expected decode time of a batch, in seconds (never negative)."""
        return max(0.0, float(self.weights @ features.vector()))

    def observe(self, features: TickFeatures, seconds: float) -> None:
        """Fit one measured decode."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        x = features.vector()
        predicted = float(self.weights @ x)
        bound = self.clip * max(abs(predicted), 1e-3)
        y = predicted + min(max(seconds - predicted, -bound), bound)
        lam = self.forgetting
        self._gram = lam * self._gram + np.outer(x, x)
        self._moment = lam * self._moment + x * y
        self.n_observed += 1
        if self.n_observed <= 16 or self.n_observed % self.refit_every == 0:
            ridge = self._ridge
            self.weights = _nonnegative_solve(self._gram + ridge, self._moment + ridge @ self.prior)


def _nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin w.A.w - 2 b.w`` over ``w >= 0`` (A positive definite, 4 unknowns): the best
    of the solutions on every subset of free weights that stays non-negative."""
    try:  # the usual case: the unconstrained optimum is non-negative, hence the answer
        full = np.linalg.solve(a, b)
        if (full >= 0).all():
            return full
    except np.linalg.LinAlgError:
        pass
    n = len(b)
    best = np.zeros(n)
    best_value = 0.0
    for mask in range(1, 1 << n):
        free = [i for i in range(n) if mask >> i & 1]
        try:
            sub = np.linalg.solve(a[np.ix_(free, free)], b[free])
        except np.linalg.LinAlgError:
            continue
        if (sub < 0).any():
            continue
        w = np.zeros(n)
        w[free] = sub
        value = float(w @ a @ w - 2 * b @ w)
        if value < best_value:
            best, best_value = w, value
    return best


def batch_features(table: SlotTable, slots: list[int]) -> TickFeatures:
    """The features of the batch just filled (before ``commit``): ``slots`` are the busy ones."""
    tokens = 0
    attended = 0.0
    unified = table.kv_unified
    for s in slots:
        n = table.tokens_in_batch(s)
        if n:
            tokens += n
            attended += n * (table.n_past(s) + (n + 1) / 2)
    if unified:  # a unified cache attends over every used cell, masked
        attended = float(tokens * (table.cells_used + tokens))
    return TickFeatures(tokens, table.n_outputs, attended)


class LatencyBudget:
    """Each tick's token budget under ``target`` seconds of expected decode time."""

    def __init__(
        self,
        target: float,
        n_batch: int,
        *,
        model: DecodeCostModel | None = None,
        margin_quantile: float = 0.9,
        error_window: int = _ERROR_WINDOW,
        first_margin: float = 1.0,
        headroom: float = 1.0,
    ) -> None:
        if not 0.0 < margin_quantile <= 1.0:
            raise ValueError(f"margin_quantile must be in (0, 1], got {margin_quantile!r}")
        if not headroom >= 1.0:
            raise ValueError(f"headroom must be >= 1, got {headroom!r}")
        #: a further factor the plans aim under the recent errors' margin by: a tick exceeds
        #: the largest of the last ``error_window`` errors about once in ``error_window + 1``
        self.headroom = headroom
        #: the quantile of the recent errors the plans aim under (see ``observe``), over the
        #: last ``error_window`` ticks; until a quarter of them are in, ``first_margin``
        self.margin_quantile = margin_quantile
        self.target = target
        self.n_batch = n_batch
        self.model = model if model is not None else DecodeCostModel()
        #: the predicted decode time of the last budget's plan, then (set by the core) of the
        #: batch decoded, before the model is fitted on it (seconds), for telemetry
        self.predicted = 0.0
        # measured / predicted time of the recent ticks streams waited on (out of sample)
        self._errors: deque[float] = deque(maxlen=error_window)
        #: what the plans aim at: the target divided by the model's recent error (see observe)
        self.aim = target / first_margin
        #: when the last measured decode ended (``time.perf_counter``)
        self._last_decoded = -math.inf

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        """A batch just decoded in ``elapsed`` seconds: record the model's error on it, then fit
        the model. The error is the streams' wait (from the last decode's end to this one's:
        the engine's work between decodes included, a millisecond, tens at times) over the
        decode time predicted. The plans aim at ``target`` divided by the ``margin_quantile`` (90th
        percentile; the largest for an SLO) of the recent measured/predicted ratios (1 to 2),
        so that the ticks, not just their expectation, stay under the target: a linear model
        misses some ticks by 20-30% (ggml's kernels change speed with the batch's shape), and
        every stream in such a tick waits for it."""
        predicted = self.model.predict(features)
        self.predicted = predicted
        now = time.perf_counter()
        # what the streams waited: from the last decode's end to this one's (sampling,
        # emitting, admission, filling, this decode), unless the engine idled in between
        waited = now - self._last_decoded
        self._last_decoded = now
        if not elapsed <= waited <= 2 * elapsed + _IDLE:
            waited = elapsed
        if predicted > 0 and features.outputs > 0:
            self._errors.append(waited / predicted)
            if len(self._errors) >= (self._errors.maxlen or 0) // 4:
                margin = float(np.quantile(np.fromiter(self._errors, float), self.margin_quantile))
                self.aim = self.target / (min(2.0, max(1.0, margin)) * self.headroom)
        self.model.observe(features, elapsed)

    def admits(self, table: SlotTable, slots: list[int], n_prompt: int) -> bool:
        """Whether one more stream may start: once every busy stream (``slots``, prefilling
        ones and those admitted this step included: they decode next) and the new one
        (``n_prompt`` tokens) decode, their tick's predicted time stays under the target.
        Always when nothing runs (a stream alone is as fast as it gets). Admitting past it
        makes every tick overshoot whatever the prefill does: eight streams decoding take
        28-30 ms a tick on a 2-core CPU, so under a 24 ms target the seventh waits in the
        queue (its time to first token grows) rather than slow all of them."""
        n = len(slots) + 1
        if n == 1:
            return True
        pending = sum(table.n_pending(s) for s in slots) + n_prompt
        if table.kv_unified:  # every token attends the used range (and the prompts to come)
            attended = float(n * (table.cells_used + pending + n))
        else:  # each stream its own cells
            attended = float(sum(table.n_past(s) + 1 for s in slots) + pending + 1)
        return self.model.predict(TickFeatures(n, n, attended)) <= self.aim

    def budget(self, table: SlotTable, slots: list[int]) -> int:
        """The token budget of the next tick over ``slots`` (the busy ones)."""
        n_decode = 0
        attended_decode = 0.0
        prefill_past: list[int] = []
        pending = 0
        for s in slots:
            state = table.state(s)
            if state == SlotState.DECODE:
                n_decode += 1
                attended_decode += table.n_past(s) + 1
            elif state == SlotState.PREFILL:
                prefill_past.append(table.n_past(s))
                pending += table.n_pending(s)
        model = self.model
        unified = table.kv_unified
        used = table.cells_used
        if unified:
            attended_decode = float(n_decode * (used + n_decode))

        def cost(p: int) -> float:
            n = n_decode + p
            if unified:
                attended = float(n * (used + n))
            else:
                past = sum(prefill_past) / len(prefill_past) if prefill_past else 0.0
                attended = attended_decode + p * (past + (p + 1) / 2)
            outputs = n_decode + (1 if p else 0)
            return model.predict(TickFeatures(n, outputs, attended))

        room = min(self.n_batch - n_decode, pending)
        if room <= 0 or not n_decode:  # no stream waits on this tick, or nothing to prefill
            self.predicted = cost(0)
            return self.n_batch
        # the most prompt tokens whose tick stays under the target; at least one
        p = max(1, most_within(cost, self.aim, room))
        self.predicted = cost(p)
        return n_decode + p


def most_within(cost: Callable[[int], float], limit: float, hi: int) -> int:
    """The largest ``n`` in ``[0, hi]`` with ``cost(n) <= limit`` (0 when none), by bisection:
    ``cost`` grows with ``n``."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo
