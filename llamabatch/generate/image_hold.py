"""Prompts held while their image positions are computed (``vision.py``): which request and
how far (:class:`ImageHold`), and the engine's strategy over the slots not held
(:class:`HoldStrategy`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamabatch.strategies import SubsetView

__all__ = ["HoldStrategy", "ImageHold"]


@dataclass
class ImageHold:
    """A running request whose prompt's positions up to its last image are being computed
    (the slot table does not plan its slot meanwhile): ``start``, the first position computed
    here; ``pos``, the next one; ``row``, the embeddings computed of the M-RoPE image at
    ``pos`` (its positions are passed only when all are in)."""

    request: Any
    slot: int
    start: int
    pos: int
    row: int = 0
    #: the image being computed: its key and embeddings (kept: the cache may drop them)
    embd: tuple[str, np.ndarray] | None = None
    #: the M-RoPE positions of the image at ``mrope[0]`` (``(MROPE_SECTIONS, n_tokens)``)
    mrope: tuple[int, np.ndarray] | None = None


class HoldStrategy:
    """The engine's strategy over the slots that are not held (their prompts' images are
    being computed); when it plans nothing while others have work, every decoding slot's
    token and the oldest prompt chunk, as ``decode_maximal`` would."""

    def __init__(self, inner: Any, holds: Mapping[int, ImageHold]) -> None:
        self.inner = inner
        self.holds = holds
        self.name = f"{getattr(inner, 'name', type(inner).__name__)}+images"

    def plan(self, view: Any, budget: int, chunk_size: int, queue_depth: int) -> list[tuple[int, int]]:
        held = self.holds
        subset = SubsetView(
            view,
            [s for s in view.decode_slots if s not in held],
            [s for s in view.prefill_slots if s not in held],
        )
        plan = list(self.inner.plan(subset, budget, chunk_size, queue_depth))
        if plan or not (subset.decode_slots or subset.prefill_slots):
            return plan
        plan = [(s, 1) for s in subset.decode_slots[:budget]]
        left = budget - len(plan)
        if left > 0 and subset.prefill_slots:
            slot = subset.prefill_slots[0]
            plan.append((slot, min(left, chunk_size, view.n_pending(slot))))
        return plan
