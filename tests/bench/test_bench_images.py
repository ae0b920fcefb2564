"""``bench-serve --images``: the image workload, small, against ``llamabatch serve`` with the
random-weight vision model; and its PNGs decode to the pixels they were made from."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from llamabatch import LLM
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.bench.images import ImageWorkload, make_png
from llamabatch.cli import main
from llamabatch.testing import make_vision_model

pytestmark = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")


def test_png_decodes_to_its_seeded_pixels() -> None:
    image = pytest.importorskip("PIL.Image")
    png = make_png(23, 17, seed=5)
    pixels = np.asarray(image.open(io.BytesIO(png)).convert("RGB"))
    assert pixels.shape == (17, 23, 3)
    assert np.array_equal(pixels, np.random.default_rng(5).integers(0, 256, (17, 23, 3), dtype=np.uint8))
    w = ImageWorkload()
    urls = {w.image(phase, i) for phase in range(3) for i in range(3)}
    assert len(urls) == 9  # every phase has images of its own
    assert base64.b64decode(w.image(1, 0).split(",", 1)[1]) == make_png(256, 256, 1_000_003)


def test_workload_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="n_images"):
        ImageWorkload(n_images=0)
    with pytest.raises(ValueError, match="text_streams"):
        ImageWorkload(text_streams=-1)
    with pytest.raises(SystemExit):
        main(["bench-serve", "--images", "2", "--image-size", "12"])


@pytest.mark.timeout(120)
def test_bench_serve_images_against_our_server(tmp_path, capsys) -> None:
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import serve

    from llamabatch.server.app import create_app

    model, mmproj = make_vision_model(tmp_path)
    argv = [
        "bench-serve", "--images", "3", "--image-size", "40x24", "--image-repeats", "2",
        "--image-concurrency", "2", "--image-max-tokens", "3", "--ttft-images", "1",
        "--text-streams", "2", "--text-tokens", "256", "--gap-images", "2", "--json",
    ]  # fmt: skip
    with (
        LLM(model, mmproj=str(mmproj), n_ctx=2048, n_parallel=4, n_threads=1, chunk_size=8) as llm,
        serve(create_app(llm, chat_template="chatml")) as url,
    ):
        assert main([*argv, "--url", url]) == 0
        stats = llm.stats()
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert row["workload"] == "images" and row["image_requests"] == 6
    assert row["images_per_s"] > 0 and row["bulk_ttft_p50_ms"] > 0
    for key in ("ttft_first_ms", "ttft_same_ms", "ttft_new_question_ms", "same_over_first"):
        assert row[key] > 0
    for key in ("text_gap_max_ms", "text_gap_max_before_ms", "text_gap_p50_ms", "gap_image_ttft_p50_ms"):
        assert row[key] is not None and row[key] > 0, key
    # 1 + 3 + 2 distinct images, each encoded once: the same request again reuses its prompt's
    # cached positions, the new question before the image the encoder cache
    assert stats.encoder_encoded == 6
    assert stats.encoder_cache_hits >= 1
