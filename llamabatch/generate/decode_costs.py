"""Fitting the engine's decode cost models on each measured ``llama_decode``.

After every successful decode (before ``SlotTable.commit``) the core hands its measured time
here: the features of the batch are read once and fitted by every model that learns from
them, the ``LatencyBudget``'s (``target_itl_ms``) and the speculator's (its draft lengths,
``spec_policy``), each with its own prior. Moved out of ``core.py``, which stays a driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llamabatch.generate.cost_model import batch_features

if TYPE_CHECKING:
    from llamabatch.generate.core import EngineCore

__all__ = ["fit_decode_costs"]


def fit_decode_costs(core: EngineCore, elapsed: float) -> None:
    """Fit the cost models of ``core`` on its batch just decoded in ``elapsed`` seconds."""
    latency, spec = core.latency, core.spec
    if latency is None and spec is None:
        return
    features = batch_features(core.table, [s for s, _ in core.slots.busy()])
    if latency is not None:  # what the model expected of this batch; then fit it
        latency.observe(features, elapsed)
    if spec is not None:
        spec.observe(features, elapsed)
