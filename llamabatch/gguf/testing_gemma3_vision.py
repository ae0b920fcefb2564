"""The Gemma 3 half of the random-weight vision test models (``VisionSpec(projector="gemma3")``
in ``testing_vision.py``): a SigLIP-style encoder with Gemma 3's projector, paired with a
random Gemma 3 text model (``testing_swa.py``'s, sliding-window layers included).

llama.cpp's clip loader reads ``clip.projector_type = "gemma3"``: the encoder has a
patch-embedding convolution with a bias, learned position embeddings, pre-norm transformer
blocks (``v.blk.N.*``, LayerNorm with biases, GELU) and a final LayerNorm (``v.post_ln``);
no norm before the blocks. Gemma 3's projector then average-pools each ``GEMMA3_POOL x GEMMA3_POOL`` block of
patches (the loader's default ``n_merge``; the file leaves
``clip.vision.projector.scale_factor`` out, as real Gemma 3 files do), RMS-normalises the
pooled vectors (``mm.soft_emb_norm.weight``) and projects them to the text model's width
(``mm.input_projection.weight``, stored ``n_embd x text.n_embd``, used transposed). An image
is resized (bilinear) to ``image_size`` square, so it gives ``(image_size / patch_size /
4)**2`` embeddings. libmtmd wraps them in ``<start_of_image>`` and ``<end_of_image>`` text
and reports them as needing bidirectional attention (``mtmd_decode_use_non_causal``): they
are decoded in one batch with the causal mask off.

The text model's token embeddings are scaled by ``sqrt(n_embd)`` in llama.cpp's Gemma 3
graph (input vectors are not), so the projection's weights are drawn to give unit-scale
embeddings, as the scaled tokens have.
"""

from __future__ import annotations

from llamabatch.gguf.testing_clip import TensorPlan, clip_block_tensors
from llamabatch.gguf.testing_swa import SWASpec

__all__ = ["GEMMA3_POOL", "GEMMA3_TEXT", "gemma3_tensors"]

#: Gemma 3's pooling factor per side (clip.cpp's default ``n_merge`` for ``gemma3``).
GEMMA3_POOL = 4

#: The text model of a Gemma 3 :class:`VisionSpec`: six layers (five sliding, one global), a
#: window wider than an image, and the projector's output width. Its embeddings are tied and
#: undamped (``testing_swa.py``); this seed's greedy answers to the tests' prompts are word
#: pieces, not byte tokens (llama-server leaves the log-probs out of an answer that is not
#: valid UTF-8).
GEMMA3_TEXT = SWASpec(
    n_vocab=1024,
    n_embd=64,
    n_layer=6,
    n_head=4,
    n_head_kv=2,
    head_dim=16,
    n_ff=128,
    sliding_window=48,
    seed=7,
)


def gemma3_tensors(image_size: int, patch_size: int, d: int, ff: int, n_layer: int, out: int) -> TensorPlan:
    """``(name, numpy shape, std)`` of the projector file's tensors (encoder width ``d``,
    feed-forward ``ff``, text width ``out``); ``std`` None: a norm weight (ones), 0.0: a bias
    (zeros)."""
    p = patch_size
    n_patches = (image_size // p) ** 2
    plan: TensorPlan = [
        ("v.patch_embd.weight", (d, 3, p, p), (3 * p * p) ** -0.5),
        ("v.patch_embd.bias", (d,), 0.0),
        ("v.position_embd.weight", (n_patches, d), 0.5),
    ]
    plan += clip_block_tensors(n_layer, d, ff)
    return [
        *plan,
        ("v.post_ln.weight", (d,), None),
        ("v.post_ln.bias", (d,), 0.0),
        ("mm.soft_emb_norm.weight", (d,), None),
        ("mm.input_projection.weight", (d, out), d**-0.5),
    ]
