"""The encoder blocks every random-weight test projector shares (``testing_vision.py``,
``testing_gemma3_vision.py``): llama.cpp's clip tensor names of a pre-norm ViT block."""

from __future__ import annotations

__all__ = ["TensorPlan", "clip_block_tensors"]

#: ``(name, numpy shape, std)``; ``std`` None: a norm weight (ones), 0.0: a bias (zeros)
TensorPlan = list[tuple[str, tuple[int, ...], float | None]]


def clip_block_tensors(n_layer: int, d: int, ff: int) -> TensorPlan:
    """The ``v.blk.*`` tensors of ``n_layer`` encoder blocks of width ``d`` and
    feed-forward width ``ff`` (attention, two layer norms, the feed-forward)."""
    plan: TensorPlan = []
    for i in range(n_layer):
        b = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            plan += [(b + name + ".weight", (d, d), d**-0.5), (b + name + ".bias", (d,), 0.0)]
        plan += [
            (b + "ln1.weight", (d,), None),
            (b + "ln1.bias", (d,), 0.0),
            (b + "ln2.weight", (d,), None),
            (b + "ln2.bias", (d,), 0.0),
            (b + "ffn_up.weight", (ff, d), d**-0.5),
            (b + "ffn_up.bias", (ff,), 0.0),
            (b + "ffn_down.weight", (d, ff), ff**-0.5),
            (b + "ffn_down.bias", (d,), 0.0),
        ]
    return plan
