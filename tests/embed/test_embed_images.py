"""Embeddings of prompts with images (``Embedder(model, mmproj=...)``, ``embed/images.py``) on
the random-weight vision models: a prompt of text and images is computed in decodes of its own
and pooled over all of them, as one decode of the whole prompt would pool it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from embed_models import THREADS

from llamabatch import Embedder, EmbedderConfig
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.errors import ImageError, PromptTooLong
from llamabatch.testing import GEMMA3_TEXT, QWEN2VL_TEXT, VisionSpec, make_vision_model

pytestmark = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")

#: each vision model, and an n_batch that splits its prompt into many decodes (a Gemma 3
#: image is bidirectional: it needs one micro-batch of its 256 embeddings)
SPECS = {
    "llava": (None, 16),
    "mrope": (VisionSpec(projector="qwen2vl_merger", text=QWEN2VL_TEXT, image_size=16, patch_size=4), 16),
    "gemma3": (VisionSpec(projector="gemma3", text=GEMMA3_TEXT, image_size=64, patch_size=4), 300),
}
TEXT = "some words first <__media__> between them <__media__> and after, to end"


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (20, 30, 3), dtype=np.uint8)


def _ask(images, text: str = "<__media__>\nWhat is in the image?") -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


@pytest.fixture(scope="module", params=list(SPECS))
def vision_case(request, tmp_path_factory):
    spec, small_batch = SPECS[request.param]
    folder = tmp_path_factory.mktemp(f"vlm-{request.param}")
    return (make_vision_model(folder) if spec is None else make_vision_model(folder, spec)), small_batch


@pytest.fixture(scope="module")
def llava_files(tmp_path_factory):
    return make_vision_model(tmp_path_factory.mktemp("vlm"))


def _embedder(files, pooling: str, n_batch: int) -> Embedder:
    model, mmproj = files
    return Embedder(
        model, mmproj=str(mmproj), pooling=pooling, n_batch=n_batch, n_ctx=1024, n_threads=THREADS
    )


@pytest.mark.timeout(300)
def test_pooled_over_every_decode(vision_case):
    """Rows ("none") of the text before the first image are the plain text's; "mean" is the
    mean of the rows and "last" the last row, whether the prompt takes few decodes or many
    (a bidirectional Gemma 3 image always takes one)."""
    vision_files, small_batch = vision_case
    prompt = _ask([_image(0), _image(1)], TEXT)
    found = {}
    for n_batch in (512, small_batch):
        with _embedder(vision_files, "none", n_batch) as embedder:
            rows = embedder.embed(prompt, normalize=False)
            text_rows = embedder.embed("some words first", normalize=False)
        pooled = {}
        for pooling in ("mean", "last", "cls"):
            with _embedder(vision_files, pooling, n_batch) as embedder:
                pooled[pooling] = embedder.embed(prompt, normalize=False)
                assert embedder.stats().decodes >= 5  # text, image, text, image, text
        n = len(text_rows) - 1  # the plain text's last token is followed by a space here
        np.testing.assert_allclose(rows[:n], text_rows[:n], atol=1e-5)
        np.testing.assert_allclose(pooled["mean"], rows.mean(axis=0), atol=1e-5)
        np.testing.assert_allclose(pooled["last"], rows[-1], atol=1e-5)
        np.testing.assert_allclose(pooled["cls"], rows[0], atol=1e-5)
        found[n_batch] = (rows, pooled["mean"])
    (rows_a, mean_a), (rows_b, mean_b) = found.values()
    np.testing.assert_allclose(rows_a, rows_b, atol=1e-4)
    np.testing.assert_allclose(mean_a, mean_b, atol=1e-4)


@pytest.mark.timeout(300)
def test_images_and_texts_in_one_call(llava_files):
    """Prompts with images mix with plain texts in a call (and from asyncio): a text's vector
    is the one it gets alone, the same image gives the same vector, another image another."""
    with _embedder(llava_files, "mean", 512) as embedder:
        alone = embedder.embed(["plain text", "another"])
        mixed = embedder.embed([_ask(_image(0)), "plain text", _ask(_image(1)), "another", _ask(_image(0))])
        assert mixed.shape == (5, embedder.n_embd)
        np.testing.assert_allclose(mixed[[1, 3]], alone, atol=1e-5)
        np.testing.assert_allclose(mixed[0], mixed[4], atol=1e-6)
        assert np.abs(mixed[0] - mixed[2]).max() > 1e-3
        np.testing.assert_allclose(np.linalg.norm(mixed, axis=1), 1.0, atol=1e-5)  # l2, as text
        single = asyncio.run(embedder.aembed(_ask(_image(1))))
        np.testing.assert_allclose(single, mixed[2], atol=1e-6)
        stats = embedder.stats()
        assert stats.failed_sequences == 0
        assert stats.encoder_images == 4 and stats.encoder_encoded == 2 and stats.encoder_cache_hits == 2
        assert stats.encoder_cache_bytes > 0 and stats.encoder_image_positions > 0


@pytest.mark.timeout(300)
def test_bad_inputs_are_clear_errors(llava_files, tiny_path):
    model, mmproj = llava_files
    with _embedder(llava_files, "mean", 512) as embedder:
        with pytest.raises(ImageError, match=r"multi_modal_data.image\[0\]: not a PNG"):
            embedder.embed(_ask(b"not an image"))
        with pytest.raises(ImageError, match="remote image URLs are off"):
            embedder.embed([_ask("https://example.com/cat.png")])
        with pytest.raises(ValueError, match="text after its last image"):
            embedder.embed(_ask(_image(0), "<__media__>"))
        with pytest.raises(PromptTooLong, match="text 1"):
            embedder.embed(["fine", _ask(_image(0), "word " * 1100 + "<__media__> end")])
        good = embedder.embed(_ask(_image(0)))  # the embedder goes on
        assert np.isfinite(good).all()
    with Embedder(tiny_path, n_threads=THREADS) as plain:
        with pytest.raises(ValueError, match="texts\\[0\\] has images and this Embedder has no mmproj"):
            plain.embed(_ask(_image(0)))
    with pytest.raises(ValueError, match="pooling 'rank'"):
        EmbedderConfig(mmproj=str(mmproj), pooling="rank")
    with pytest.raises(FileNotFoundError, match="mmproj"):
        Embedder(model, mmproj=str(mmproj) + ".missing", n_threads=THREADS)


def test_an_encoder_cannot_embed_images(minilm, llava_files):
    with pytest.raises(ValueError, match="decoder model"):
        Embedder(minilm, mmproj=str(llava_files[1]), n_threads=THREADS)


@pytest.mark.timeout(300)
def test_server_embeds_llama_server_multimodal_prompts(llava_files, tiny_path):
    """``/v1/embeddings`` takes llama-server's ``{"prompt_string", "multimodal_data"}`` items
    (base64 or data: URLs) beside strings, and answers the vectors ``embed`` gives; images
    refused and images sent to a text-only model are 400s naming the input."""
    pytest.importorskip("starlette", reason="the server tests need the server extra")
    import base64
    import io

    from PIL import Image
    from starlette.testclient import TestClient

    from llamabatch.server import create_app
    from llamabatch.server.limits import ServerLimits

    buffer = io.BytesIO()
    Image.fromarray(_image(0)).save(buffer, format="PNG")
    png = base64.b64encode(buffer.getvalue()).decode()
    limits = ServerLimits(allowed_hosts=("testserver",))
    with _embedder(llava_files, "mean", 512) as embedder:
        expected = embedder.embed([_ask(_image(0), "Caption: <__media__> end"), "plain text"])
        with TestClient(create_app(embedder=embedder, embedding_model_name="vlm", limits=limits)) as client:
            items = [{"prompt_string": "Caption: <__media__> end", "multimodal_data": [png]}, "plain text"]
            response = client.post("/v1/embeddings", json={"input": items})
            assert response.status_code == 200, response.text
            got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
            np.testing.assert_allclose(got, expected, atol=1e-5)
            as_url = {
                "prompt_string": "Caption: <__media__> end",
                "multimodal_data": ["data:image/png;base64," + png],
            }
            response = client.post("/v1/embeddings", json={"input": as_url})
            assert response.status_code == 200, response.text
            np.testing.assert_allclose(response.json()["data"][0]["embedding"], expected[0], atol=1e-5)
            bad = client.post(
                "/v1/embeddings",
                json={
                    "input": [{"prompt_string": "x <__media__> y", "multimodal_data": ["bm90IGFuIGltYWdl"]}]
                },
            )
            assert bad.status_code == 400 and "input[0].multimodal_data[0]" in bad.json()["error"]["message"]
            refused = {
                "prompt_string": {"prompt": "x", "images": []},
                "images, more than the 8": {"prompt_string": "x", "multimodal_data": [png] * 9},
                "2 image markers": {
                    "prompt_string": "a <__media__> b <__media__> c",
                    "multimodal_data": [png],
                },
                "tokens of this vocabulary": {
                    "prompt_string": "w" * 100_000 + "<__media__> x",
                    "multimodal_data": [png],
                },
                "KV cells": {"prompt_string": "word " * 800 + "<__media__> x", "multimodal_data": [png]},
            }
            for message, item in refused.items():
                response = client.post("/v1/embeddings", json={"input": [item]})
                assert response.status_code == 400 and message in response.json()["error"]["message"], message
            assert client.get("/health").status_code == 200
    with Embedder(tiny_path, n_threads=THREADS) as plain:
        with TestClient(create_app(embedder=plain, embedding_model_name="t", limits=limits)) as client:
            response = client.post(
                "/v1/embeddings", json={"input": [{"prompt_string": "x", "multimodal_data": [png]}]}
            )
            assert response.status_code == 400 and "--embedding-mmproj" in response.json()["error"]["message"]
