"""The libmtmd binding (``_ffi/mtmd.py``) on the random-weight vision model
(``llamabatch.testing.make_vision_model``): loading, tokenizing with media markers, encoding,
and one owner freed once."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest

from llamabatch._ffi.model import Model
from llamabatch._ffi.mtmd import ImageChunk, MtmdContext, TextChunk, mtmd_available
from llamabatch.errors import ModelLoadError
from llamabatch.testing import VisionSpec, make_vision_model

pytestmark = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory):
    return make_vision_model(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def mtmd(vision_files):
    model = Model(vision_files[0])
    ctx = MtmdContext(model, vision_files[1], n_threads=1)
    yield ctx
    model.close()


def _image(seed: int, height: int = 20, width: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_tokenize_splits_text_and_images(mtmd):
    spec = VisionSpec()
    chunks = mtmd.tokenize(f"a {mtmd.marker} b {mtmd.marker} c", [(_image(0), "k0"), (_image(1), "k1")])
    kinds = [type(c) for c in chunks]
    assert kinds == [TextChunk, ImageChunk, TextChunk, ImageChunk, TextChunk]
    images = [c for c in chunks if isinstance(c, ImageChunk)]
    assert [c.key for c in images] == ["k0", "k1"]
    assert all(c.n_tokens == c.n_pos == spec.n_image_tokens for c in images)
    assert chunks[0].tokens[0] == mtmd.model.bos  # add_special: BOS first


def test_encode_is_deterministic_and_depends_on_the_image(mtmd):
    (a,) = [c for c in mtmd.tokenize(mtmd.marker, [(_image(0), "a")]) if isinstance(c, ImageChunk)]
    (b,) = [c for c in mtmd.tokenize(mtmd.marker, [(_image(1), "b")]) if isinstance(c, ImageChunk)]
    ea, ea2, eb = mtmd.encode(a), mtmd.encode(a), mtmd.encode(b)
    assert ea.shape == (VisionSpec().n_image_tokens, mtmd.model.n_embd) and ea.dtype == np.float32
    np.testing.assert_array_equal(ea, ea2)
    assert not np.allclose(ea, eb)
    assert np.isfinite(ea).all() and 0.01 < float(ea.std()) < 10
    assert not mtmd.non_causal(a)  # LLaVA's image attention is causal


def test_marker_count_must_match_images(mtmd):
    with pytest.raises(ValueError, match=r"1 image markers .* for 2 images"):
        mtmd.tokenize(mtmd.marker, [(_image(0), "a"), (_image(1), "b")])
    with pytest.raises(ValueError, match="uint8 RGB"):
        mtmd.tokenize(mtmd.marker, [(np.zeros((4, 4), np.uint8), "a")])


def test_one_owner_freed_once(vision_files):
    model = Model(vision_files[0])
    ctx = MtmdContext(model, vision_files[1], n_threads=1, warmup=False)
    (chunk,) = [c for c in ctx.tokenize(ctx.marker, [(_image(2), "x")]) if isinstance(c, ImageChunk)]
    model.close()  # closes the mtmd context first: it holds the model's pointer
    assert ctx.closed
    ctx.close()
    with pytest.raises(ValueError, match="closed"):
        ctx.encode(chunk)
    chunk.close()
    chunk.close()
    gc.collect()


def test_mismatched_text_model_is_refused(vision_files, tiny_path):
    model = Model(tiny_path)  # n_embd 64 too, so make a projector for another width
    try:
        spec = VisionSpec(text=dataclasses.replace(VisionSpec().text, n_embd=32, name="t32"))
        _, mmproj = make_vision_model(vision_files[0].parent, spec)
        with pytest.raises(ModelLoadError, match="n_embd"):
            MtmdContext(model, mmproj, n_threads=1)
    finally:
        model.close()


def test_missing_file(vision_files, tmp_path):
    model = Model(vision_files[0])
    try:
        with pytest.raises(FileNotFoundError):
            MtmdContext(model, tmp_path / "nope.gguf")
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF" + b"\0" * 64)
        with pytest.raises(ModelLoadError):
            MtmdContext(model, bad)
    finally:
        model.close()


def test_encode_many_equals_one_by_one_encodes(mtmd):
    """Images encoded in ``mtmd_batch`` runs give each image the embeddings a lone encode gives
    (this projector, LLaVA's, takes one image per run; the runs and their order still hold)."""
    images = [(_image(10 + i, 20 + 3 * i, 30), f"m{i}") for i in range(3)]
    text = " ".join(mtmd.marker for _ in images)
    chunks = [c for c in mtmd.tokenize(text, images) if isinstance(c, ImageChunk)]
    many = mtmd.encode_many([chunks[2], chunks[0], chunks[1], chunks[0]])
    alone = [mtmd.encode(c) for c in (chunks[2], chunks[0], chunks[1], chunks[0])]
    assert len(many) == 4
    for got, want in zip(many, alone, strict=True):
        np.testing.assert_array_equal(got, want)
    assert mtmd.encode_many([]) == []
