"""Draft/target pairs of random-weight models, for speculative decoding tests and benchmarks.

:func:`draft_pair` returns ``(draft, target)`` GGUF paths (cached like
:func:`llamabatch.gguf.testing.model_path`) for a :data:`PAIR_PRESETS` name:

* ``"tiny"`` and ``"135m"``: the target is the draft plus extra layers whose output projections
  (``attn_output`` and ``ffn_down``) are zeros. Such a layer adds nothing to the residual stream,
  so the target's logits equal the draft's (up to float rounding: adding zeros is exact) and a
  draft-model speculation accepts 100% of its drafts, while each target decode computes all its
  layers. ``"135m"``: the target is the SmolLM-135M shape (30 layers), the draft its first 4
  layers, so the target costs about 4x the draft (the shared output projection included).
* ``"vocab320"``: two *independent* models (different weights) with the same 320-token
  vocabulary: a draft that disagrees with its target, for statistical tests of the sampled
  acceptance rule (a small vocabulary keeps the distributions cheap to compare).

Both files of a pair have the same vocabulary (:func:`llamabatch.gguf.testing.build_vocab` is a
function of ``n_vocab`` alone) and the same special tokens.

:func:`loop_model` is a model of a :data:`PRESETS` shape with the output projections of *every*
layer zeroed: its next token depends on the current token alone, so greedy text walks a fixed
cycle of tokens, and ``loop_prompts`` (in ``testing.py``: it runs the model) returns prompts
that hold a turn of it, whose greedy continuation repeats their own text (the case n-gram
speculation is for, which a random model's text rarely is). It costs what the preset costs:
every layer is computed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import NamedTuple

from llamabatch.gguf.testing_llama import (
    PRESETS,
    ModelSpec,
    built_once,
    cache_dir,
    spec_hash,
    write_llama_gguf,
)

__all__ = ["PAIR_PRESETS", "DraftPair", "draft_pair", "loop_model"]


class DraftPair(NamedTuple):
    """The GGUF paths of a draft model and its target."""

    draft: Path
    target: Path


_TINY_DRAFT = dataclasses.replace(PRESETS["tiny"], n_layer=1, name="llamabatch-tiny-draft")
_M135_DRAFT = dataclasses.replace(PRESETS["135m"], n_layer=4, name="llamabatch-135m-draft")
_V320 = ModelSpec(
    n_vocab=320, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, name="llamabatch-v320-target"
)

#: name -> (draft spec, target spec, first zeroed target layer or None: independent weights).
PAIR_PRESETS: dict[str, tuple[ModelSpec, ModelSpec, int | None]] = {
    "tiny": (_TINY_DRAFT, dataclasses.replace(_TINY_DRAFT, n_layer=4, name="llamabatch-tiny-target"), 1),
    "135m": (_M135_DRAFT, dataclasses.replace(_M135_DRAFT, n_layer=30, name="llamabatch-135m-target"), 4),
    "vocab320": (dataclasses.replace(_V320, seed=1, n_layer=1, name="llamabatch-v320-draft"), _V320, None),
}


def _zero_output_projections(path: Path, from_layer: int) -> None:
    """Overwrite, in place, the ``attn_output`` and ``ffn_down`` tensors of the layers from
    ``from_layer`` on with zero bytes (a zero in F32, F16 and Q8_0 alike: a Q8_0 block of zero
    bytes has scale 0)."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= from_layer and parts[2] in ("attn_output", "ffn_down"):
            tensor.data[...] = 0
    reader.data.flush()
    del reader


def _cached(spec: ModelSpec, zero_from: int | None, directory: Path) -> Path:
    suffix = "" if zero_from is None else f"-z{zero_from}"

    def build(tmp: Path) -> None:
        write_llama_gguf(tmp, spec)
        if zero_from is not None:
            _zero_output_projections(tmp, zero_from)

    return built_once(directory / f"{spec.name}-{spec_hash(spec)}{suffix}.gguf", build)


def draft_pair(preset: str = "tiny", cache: str | os.PathLike[str] | None = None) -> DraftPair:
    """The ``(draft, target)`` GGUF paths of the pair ``preset`` (a :data:`PAIR_PRESETS` name).

    Built on first use and cached (``cache`` overrides
    :func:`llamabatch.gguf.testing.cache_dir`); safe against concurrent builders.
    """
    try:
        draft_spec, target_spec, zero_from = PAIR_PRESETS[preset]
    except (KeyError, TypeError):
        raise ValueError(f"unknown draft pair {preset!r}; choose from {sorted(PAIR_PRESETS)}") from None
    directory = Path(cache) if cache is not None else cache_dir()
    return DraftPair(_cached(draft_spec, None, directory), _cached(target_spec, zero_from, directory))


def loop_model(preset: str = "tiny", cache: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF path of the ``preset`` model (a :data:`PRESETS` name) with every layer's output
    projections zeroed: greedy decoding walks a fixed cycle of tokens (see the module doc).
    Built on first use and cached, as :func:`draft_pair`."""
    try:
        spec = PRESETS[preset]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)}") from None
    directory = Path(cache) if cache is not None else cache_dir()
    return _cached(dataclasses.replace(spec, name=f"{spec.name}-loop"), 0, directory)
