"""What speculation has cost, measured: the budget its exploration may spend.

The speculator drafts where its estimates say drafts pay, and also where they do not yet
know: its first lessons (drafts given so the decode cost model sees what they cost) and its
probes (one draft now and then, so the estimates keep learning). Where drafts fail, those are
pure loss, and on a CPU a tick with one draft token costs up to twice a tick without.

``SpecLedger`` keeps the measured account: for every tick with drafts, the decode time it
took (plus its extra rows' sampling) minus the predicted time of the same tick without
drafts, minus what its accepted drafts saved (each is one more emitted token, worth the
no-draft tick's time per stream); and, with lookup drafters (n-gram, suffix), every tick's
own work of the speculator before the decode (its lookups and choices: about a tenth of a
millisecond, 1% of a small model's tick on a CPU), from the ``warmup``-th measured decode on
(before, the account has too little time to weigh it against: a request's first lookup,
which indexes its prompt, would hold every draft back). Both that loss and the time of all
decodes decay by the same factor per tick, so their ratio is the share of recent decode time
speculation cost. Exploration is allowed while that share stays under ``share`` (1% by
default): the lessons and probes wait where they have been losing, and resume as the account
recovers. Drafts the estimates chose are allowed up to ``limit`` (2%): estimates that keep
hoping (a class of drafts whose evidence faded back to its prior) cannot cost more. Where
drafts pay the account is far below zero and neither bound is near.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SpecLedger"]


@dataclass
class SpecLedger:
    """The measured net cost of drafting (see the module docstring)."""

    #: the most share of recent decode time exploration may have cost
    share: float = 0.01
    #: the most share of recent decode time any drafts may have cost
    limit: float = 0.02
    #: per tick, the weight of older ticks decays by this factor (~1000 ticks of memory)
    decay: float = 0.999
    #: measured decodes before the speculator's own work is booked (``spent``)
    warmup: int = 32
    #: decodes measured so far
    n_decoded: int = 0
    #: net seconds lost to drafts (negative: gained), decayed
    loss: float = 0.0
    #: seconds of every decode, decayed
    total: float = 0.0
    #: lifetime net seconds lost to drafts (not decayed; for reports)
    lifetime_loss: float = 0.0
    # the tick being settled: its extra seconds, the no-draft seconds per stream, accepted drafts
    _extra: float = 0.0
    _per_stream: float = 0.0
    _accepted: int = 0
    _open: bool = False

    def decoded(self, seconds: float) -> None:
        """A decode took ``seconds`` (every decode of the engine, drafts or not)."""
        self.settle()
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.total = self.total * self.decay + seconds
        self.loss *= self.decay
        self.n_decoded += 1

    def drafted(self, seconds: float, base: float, n_streams: int, drafts: int, row_cost: float) -> None:
        """The decode just counted held ``drafts`` draft tokens among ``n_streams`` emitting
        rows; ``base``: its predicted seconds without the drafts; ``row_cost``: seconds to
        sample one more row. Its accepted drafts follow (``accepted``)."""
        self.settle()
        if drafts <= 0 or not base > 0 or n_streams <= 0 or not math.isfinite(seconds):
            return
        self._extra = seconds + drafts * row_cost - base
        self._per_stream = base / n_streams
        self._accepted = 0
        self._open = True

    def spent(self, seconds: float) -> None:
        """The speculator's own work before a decode took ``seconds`` (lookups, choosing):
        a cost of speculating, whatever the drafts then save (from the ``warmup``-th decode)."""
        if self.n_decoded >= self.warmup and math.isfinite(seconds) and seconds > 0:
            self.loss += seconds
            self.lifetime_loss += seconds

    def accepted(self, n: int) -> None:
        """``n`` drafts of the current tick were accepted."""
        self._accepted += n

    def settle(self) -> None:
        """Book the current tick (its drafts are all verified)."""
        if not self._open:
            return
        self._open = False
        net = self._extra - self._accepted * self._per_stream
        self.loss += net
        self.lifetime_loss += net

    def allows_drafts(self) -> bool:
        """Whether drafting stays within its budget (``loss <= limit * total``)."""
        return self.loss <= self.limit * self.total

    def allows_exploration(self) -> bool:
        """Whether exploring drafts stay within the budget (``loss <= share * total``)."""
        return self.loss <= self.share * self.total
