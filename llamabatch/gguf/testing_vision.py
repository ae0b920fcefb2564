"""A random-weight vision-language test model: a tiny CLIP-style image encoder with a LLaVA
MLP projector (an ``--mmproj`` GGUF), and a random Llama text model to match; or, with
``VisionSpec(projector="qwen2vl_merger")``, a Qwen2-VL-style pair whose text model places
image embeddings with M-RoPE positions.

llama.cpp's clip loader reads the projector file (``general.architecture = "clip"``): the
``clip.vision.*`` hyperparameters, ``clip.projector_type = "mlp"`` (LLaVA's two-layer MLP,
``mm.0`` and ``mm.2``), a patch-embedding convolution, learned position embeddings and
pre-norm transformer blocks (``v.blk.N.*``). Images are resized to ``image_size`` square and
cut into ``(image_size / patch_size)**2`` patches: one image gives that many embeddings, of
the text model's width (``n_embd``). The weights come from a seeded PCG64 stream, as the other
test models' do; the text model is :func:`llamabatch.gguf.testing.write_llama_gguf`'s, with
the test vocabulary and ChatML.

The Qwen2-VL projector (``clip.projector_type = "qwen2vl_merger"``) has no learned position
embeddings (its encoder rotates by 2-D RoPE), two patch-embedding kernels (the two frames of
its temporal patch, ``v.patch_embd.weight`` and ``.weight.1``), a final norm (``v.post_ln``)
and a merger MLP (``mm.0``, ``mm.2``) over each 2x2 block of patches, so an image of
``h x w`` patches gives ``h/2 * w/2`` embeddings that take ``max(h/2, w/2)`` positions. Its
text model is architecture ``qwen2vl`` (Llama's tensors, RoPE sections in
``rope.dimension_sections``); libmtmd wraps each image in ``<|vision_start|>`` and
``<|vision_end|>`` text.

Gemma 3's projector (``clip.projector_type = "gemma3"``, ``testing_gemma3_vision.py``)
average-pools the encoder's patches and projects them for a random Gemma 3 text model
(:data:`GEMMA3_TEXT`, a ``testing_swa.py`` model); its images are decoded with
bidirectional attention.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from llamabatch.gguf.testing_clip import TensorPlan, clip_block_tensors
from llamabatch.gguf.testing_gemma3_vision import GEMMA3_POOL, GEMMA3_TEXT, gemma3_tensors
from llamabatch.gguf.testing_llama import ModelSpec, built_once, cache_dir, spec_hash, write_llama_gguf
from llamabatch.gguf.testing_swa import SWASpec, write_swa_gguf

__all__ = [
    "GEMMA3_TEXT",
    "QWEN2VL_ROPE_SECTIONS",
    "QWEN2VL_TEXT",
    "VLM_TEXT",
    "VisionSpec",
    "make_vision_model",
    "write_mmproj_gguf",
]


#: The text model of the default :class:`VisionSpec` (the tiny preset's shape).
VLM_TEXT = ModelSpec(
    n_vocab=1024, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, name="llamabatch-vlm-text"
)

#: The text model of a Qwen2-VL :class:`VisionSpec` (the same shape, its own weights' name).
QWEN2VL_TEXT = ModelSpec(
    n_vocab=1024, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, name="llamabatch-vlm-qwen2vl-text"
)
#: Its RoPE sections (rotation pairs of a 16-wide head: temporal, height, width, unused).
QWEN2VL_ROPE_SECTIONS = (2, 3, 3, 0)

Projector = Literal["mlp", "qwen2vl_merger", "gemma3"]


@dataclass(frozen=True)
class VisionSpec:
    """The shape of the image encoder; ``text`` is the text model, whose ``n_embd`` the
    projector's output takes. ``n_layer`` blocks are stored; LLaVA's graph uses all but the
    last (its features come from the penultimate block). ``projector`` is ``"mlp"`` (LLaVA)
    or ``"qwen2vl_merger"`` (Qwen2-VL, M-RoPE; ``text`` should then be :data:`QWEN2VL_TEXT`;
    libmtmd sizes its images itself, in multiples of ``2 * patch_size``, and ``image_size``
    is only the warm-up image's) or ``"gemma3"`` (Gemma 3, bidirectional image attention;
    ``text`` must then be a Gemma 3 :class:`SWASpec` such as :data:`GEMMA3_TEXT`, and
    ``image_size / patch_size`` a multiple of 4, the pooling factor)."""

    image_size: int = 32
    patch_size: int = 8
    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 48
    n_layer: int = 2
    seed: int = 7
    text: ModelSpec | SWASpec = VLM_TEXT
    projector: Projector = "mlp"

    def __post_init__(self) -> None:
        if self.projector not in ("mlp", "qwen2vl_merger", "gemma3"):
            raise ValueError(f"projector must be 'mlp', 'qwen2vl_merger' or 'gemma3', not {self.projector!r}")
        if isinstance(self.text, SWASpec) != (self.projector == "gemma3"):
            raise ValueError("the gemma3 projector, and only it, pairs with a Gemma 3 text model (SWASpec)")
        for field in ("image_size", "patch_size", "n_embd", "n_head", "n_ff", "n_layer"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive")
        if self.image_size % self.patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        if self.n_embd % self.n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        if self.n_ff == self.n_embd:
            raise ValueError("n_ff must differ from n_embd (llama.cpp then reads ffn_up/ffn_down as swapped)")
        if self.projector == "qwen2vl_merger":
            if (self.n_embd // self.n_head) % 4:
                raise ValueError("qwen2vl_merger needs a head size (n_embd / n_head) that is a multiple of 4")
            if self.image_size % (2 * self.patch_size):
                raise ValueError("qwen2vl_merger needs image_size to be a multiple of 2 * patch_size")
        elif self.projector == "gemma3":
            if (self.image_size // self.patch_size) % GEMMA3_POOL:
                raise ValueError(f"gemma3 needs image_size / patch_size to be a multiple of {GEMMA3_POOL}")
        elif self.n_layer < 2:
            raise ValueError("n_layer must be >= 2 (LLaVA uses the penultimate block's output)")

    @property
    def n_image_tokens(self) -> int:
        """Embeddings per image (LLaVA's and Gemma 3's; Qwen2-VL's depend on the image's size)."""
        side = self.image_size // self.patch_size
        return (side // GEMMA3_POOL) ** 2 if self.projector == "gemma3" else side**2

    @property
    def name(self) -> str:
        """The projector file's name: every field of the shape and the text model's hash."""
        kind = {"mlp": "mlp", "qwen2vl_merger": "qwen2vl", "gemma3": "gemma3"}[self.projector]
        return (
            f"mmproj-{kind}-i{self.image_size}-p{self.patch_size}-e{self.n_embd}-h{self.n_head}-f{self.n_ff}"
            f"-l{self.n_layer}-s{self.seed}-t{spec_hash(self.text)}.gguf"
        )


def _tensors(spec: VisionSpec) -> TensorPlan:
    """``(name, numpy shape, std)``; ``std`` None: a norm weight (ones), 0.0: a bias (zeros)."""
    if spec.projector == "gemma3":
        args = (spec.image_size, spec.patch_size, spec.n_embd, spec.n_ff, spec.n_layer, spec.text.n_embd)
        return gemma3_tensors(*args)
    d, ff, p, out = spec.n_embd, spec.n_ff, spec.patch_size, spec.text.n_embd
    plan: TensorPlan
    if spec.projector == "qwen2vl_merger":
        plan = [
            ("v.patch_embd.weight", (d, 3, p, p), (6 * p * p) ** -0.5),
            ("v.patch_embd.weight.1", (d, 3, p, p), (6 * p * p) ** -0.5),
        ]
    else:
        plan = [
            ("v.patch_embd.weight", (d, 3, p, p), (3 * p * p) ** -0.5),
            ("v.patch_embd.bias", (d,), 0.0),
            ("v.position_embd.weight", (spec.n_image_tokens, d), 0.5),
            ("v.pre_ln.weight", (d,), None),
            ("v.pre_ln.bias", (d,), 0.0),
        ]
    plan += clip_block_tensors(spec.n_layer, d, ff)
    # The projector's output scale is that of the text model's token embeddings.
    if spec.projector == "qwen2vl_merger":
        merged = 4 * d  # a 2x2 block of patches, concatenated
        return [
            *plan,
            ("v.post_ln.weight", (d,), None),
            ("v.post_ln.bias", (d,), 0.0),
            ("mm.0.weight", (merged, merged), merged**-0.5),
            ("mm.0.bias", (merged,), 0.0),
            ("mm.2.weight", (out, merged), merged**-0.5 * out**-0.5),
            ("mm.2.bias", (out,), 0.0),
        ]
    plan += [
        ("mm.0.weight", (out, d), d**-0.5),
        ("mm.0.bias", (out,), 0.0),
        ("mm.2.weight", (out, out), out**-0.5 * out**-0.5),
        ("mm.2.bias", (out,), 0.0),
    ]
    return plan


def write_mmproj_gguf(path: str | os.PathLike[str], spec: VisionSpec | None = None) -> Path:
    """Write the projector (``--mmproj``) GGUF of ``spec`` to ``path`` (atomically)."""
    import gguf

    spec = spec or VisionSpec()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    writer = gguf.GGUFWriter(str(tmp), arch="clip")
    try:
        writer.add_name(path.stem)
        writer.add_file_type(0)  # ALL_F32
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_string("clip.projector_type", spec.projector)
        writer.add_bool("clip.use_gelu", True)
        if spec.projector == "qwen2vl_merger":
            writer.add_uint32("clip.vision.spatial_merge_size", 2)
        writer.add_uint32("clip.vision.image_size", spec.image_size)
        writer.add_uint32("clip.vision.patch_size", spec.patch_size)
        writer.add_uint32("clip.vision.embedding_length", spec.n_embd)
        writer.add_uint32("clip.vision.feed_forward_length", spec.n_ff)
        writer.add_uint32("clip.vision.block_count", spec.n_layer)
        writer.add_uint32("clip.vision.projection_dim", spec.text.n_embd)
        writer.add_uint32("clip.vision.attention.head_count", spec.n_head)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        f32 = gguf.GGMLQuantizationType.F32
        for name, shape, std in _tensors(spec):
            if std is None:
                values = np.ones(shape, dtype=np.float32)
            elif std == 0.0:
                values = np.zeros(shape, dtype=np.float32)
            else:
                values = (rng.random(shape, dtype=np.float32) * 2 - 1) * np.float32(std * 3.0**0.5)
            writer.add_tensor(name, values, raw_dtype=f32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def make_vision_model(
    directory: str | os.PathLike[str] | None = None, spec: VisionSpec | None = None
) -> tuple[Path, Path]:
    """``(model_path, mmproj_path)``: the text model and the projector of ``spec`` in
    ``directory`` (default: the test models' cache folder), written on first use (atomic,
    safe against concurrent builders)."""
    spec = spec or VisionSpec()
    folder = Path(directory) if directory is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    text = spec.text
    sections = QWEN2VL_ROPE_SECTIONS if spec.projector == "qwen2vl_merger" else None
    if isinstance(text, SWASpec):
        model = built_once(folder / text.name, lambda p: write_swa_gguf(p, text))
    else:
        model = built_once(
            folder / f"{text.name}-{spec_hash(text)}{'-mrope' if sections else ''}.gguf",
            lambda p: write_llama_gguf(p, text, rope_sections=sections),
        )
    mmproj = built_once(folder / spec.name, lambda p: write_mmproj_gguf(p, spec))
    return model, mmproj
