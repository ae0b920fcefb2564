"""Fitting the engine's decode cost models on each measured ``llama_decode``.

After every successful decode (before ``SlotTable.commit``) the core hands its measured time
here: the features of the batch are read once and fitted by every model that learns from
them, the admission policy's (its tick budget, ``admission.py``) and the speculator's (its
draft lengths, ``spec_policy``), each with its own prior.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from llamabatch._core.slots import SlotTable
from llamabatch.generate.cost_model import TickFeatures, batch_features
from llamabatch.generate.slot_map import SlotMap

__all__ = ["CostLearner", "fit_decode_costs"]


class CostLearner(Protocol):
    """What learns from measured decodes: ``AdmissionPolicy``, ``Speculator``."""

    @property
    def learns_costs(self) -> bool:
        """Whether ``observe`` does anything (else the features are not read)."""
        ...

    def observe(self, features: TickFeatures, elapsed: float) -> None:
        """A batch of ``features`` decoded in ``elapsed`` seconds."""
        ...


def fit_decode_costs(
    table: SlotTable, slots: SlotMap, learners: Iterable[CostLearner | None], elapsed: float
) -> None:
    """Fit ``learners`` (in order; None and those that do not learn are left out) on the batch
    of ``table`` just decoded in ``elapsed`` seconds (``slots``: which slots are busy)."""
    active = [learner for learner in learners if learner is not None and learner.learns_costs]
    if not active:
        return
    features = batch_features(table, [s for s, _ in slots.busy()])
    for learner in active:
        learner.observe(features, elapsed)
