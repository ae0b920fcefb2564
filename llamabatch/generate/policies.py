"""The admission policy of an engine's configuration (``admission.py``, ``slo.py``)."""

from __future__ import annotations

from llamabatch.config import EngineConfig
from llamabatch.generate.admission import AdmissionPolicy, LatencyAdmission, PriorityAdmission
from llamabatch.generate.cost_model import LatencyBudget
from llamabatch.generate.slo import SLOAdmission

__all__ = ["admission_for"]


def admission_for(config: EngineConfig, n_batch: int) -> AdmissionPolicy:
    """The engine's policy: priorities with ``priority_aging``; each tick under
    ``target_itl_ms`` when set; scheduled for goodput under the SLOs (``slo_ttft_ms``,
    ``slo_itl_ms``, or a request's own: until one comes, the SLO layer passes through),
    refusing at submit a request predicted late under ``slo_reject``."""
    policy: AdmissionPolicy = PriorityAdmission(config.priority_aging)
    if config.target_itl_ms:
        policy = LatencyAdmission(policy, LatencyBudget(config.target_itl_ms / 1000.0, n_batch))
    ttft, itl = config.slo_ttft_ms, config.slo_itl_ms
    return SLOAdmission(
        policy,
        ttft=None if ttft is None else ttft / 1000.0,
        itl=None if itl is None else itl / 1000.0,
        n_batch=n_batch,
        aging=config.priority_aging,
        reject=config.slo_reject,
    )
