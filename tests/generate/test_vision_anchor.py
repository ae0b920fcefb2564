"""Images against llama.cpp itself: the same random-weight vision model files, images and
prompts through llama-server ``--mmproj`` (built from the pinned commit into
``~/.cache/llamabatch-anchors``; the test skips without it) and through ``LLM``: greedy
tokens identical, and the first token's log-probs equal to 5e-3 (alone they agree to 1e-6; a
text stream in the same batches moves ggml's CPU rounding by about 1e-3). Our side runs
twice: images computed whole, and in slices of 4 positions, each beside a text stream. Both
vision models: LLaVA's (1-D positions) and Qwen2-VL's (M-RoPE positions: an image of 12
embeddings takes 4 positions, sliced by rows)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import struct
import subprocess
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from llamabatch import LLM, SamplingParams
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.testing import QWEN2VL_TEXT, VisionSpec, make_vision_model

ANCHORS = Path.home() / ".cache" / "llamabatch-anchors"

pytestmark = [
    pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd"),
    pytest.mark.skipif(not (ANCHORS / "llama-server").exists(), reason="llama-server anchor not built"),
]

CASES = [
    (0, "<__media__>\nWhat is in the image?"),
    (1, "Look: <__media__> describe it."),
    (2, "<__media__>\nHello"),
    (3, "First <__media__> then <__media__>\nCompare them."),
]
N = 8


def _png(seed: int) -> bytes:
    """A 30x20 RGB PNG of random pixels (both sides decode it to the same pixels)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (20, 30, 3), dtype=np.uint8)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + row.tobytes() for row in pixels)
    header = struct.pack(">IIBBBBB", 30, 20, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def _images(seed: int, prompt: str) -> list[bytes]:
    """The images of a case: one per marker, seeds from ``seed`` on."""
    return [_png(seed + i) for i in range(prompt.count("<__media__>"))]


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.load(resp))


@contextlib.contextmanager
def anchor_server(model: Path, mmproj: Path, port: int) -> Iterator[str]:
    """llama-server ``--mmproj`` on ``model`` and ``mmproj`` (one slot, one thread) while the
    block runs; yields its media marker (its own, from ``/props``)."""
    server = subprocess.Popen(
        [str(ANCHORS / "llama-server"), "-m", str(model), "--mmproj", str(mmproj), "--port", str(port),
         "-t", "1", "-c", "1024", "-np", "1", "--no-warmup"],
        env={**os.environ, "LD_LIBRARY_PATH": str(ANCHORS)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=1) as resp:
                    marker = json.load(resp)["media_marker"]
                break
            except (OSError, KeyError):
                if time.monotonic() > deadline:
                    pytest.fail("llama-server did not start")
                time.sleep(0.3)
        yield marker
    finally:
        server.terminate()
        server.wait(10)


def complete(port: int, prompt: str, images: list[bytes], n_predict: int = N) -> dict:
    """llama-server's greedy ``/completion`` of ``prompt`` (its media marker in place) with
    ``images``: ``n_predict`` tokens, the top 3 log-probs of each."""
    body = {
        "prompt": {
            "prompt_string": prompt,
            "multimodal_data": [base64.b64encode(png).decode() for png in images],
        },
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": False,
        "n_probs": 3,
        "return_tokens": True,
    }
    return _post(port, "/completion", body)


SPECS = {
    "llava": VisionSpec(),
    "qwen2vl": VisionSpec(projector="qwen2vl_merger", text=QWEN2VL_TEXT, image_size=16, patch_size=4),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, list[dict]]:
    model, mmproj = make_vision_model(tmp_path_factory.mktemp("vlm-anchor"), SPECS[request.param])
    port = 19000 + os.getpid() % 1000 + sorted(SPECS).index(request.param)
    with anchor_server(model, mmproj, port) as marker:
        answers = [
            complete(port, prompt.replace("<__media__>", marker), _images(seed, prompt))
            for seed, prompt in CASES
        ]
    return model, mmproj, answers


@pytest.mark.timeout(180)
@pytest.mark.parametrize("chunk_size", [512, 4])
def test_greedy_answers_equal_llama_server(reference, chunk_size: int) -> None:
    model, mmproj, answers = reference
    params = SamplingParams(max_tokens=N, temperature=0, logprobs=3)
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=1, chunk_size=chunk_size) as llm:
        for (seed, prompt), answer in zip(CASES, answers, strict=True):
            # a text stream beside it: with chunk_size=4 the image is computed in slices around it
            text = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            images = {"prompt": prompt, "multi_modal_data": {"image": _images(seed, prompt)}}
            outs = llm.generate(
                ["Once upon a time", images],
                [text, params],
                use_tqdm=False,
            )
            ours = outs[1].outputs[0]
            assert ours.token_ids == answer["tokens"], (seed, prompt)
            assert ours.usage.prompt_tokens == answer["tokens_evaluated"]  # an image: its n_tokens
            theirs = {p["id"]: p["logprob"] for p in answer["completion_probabilities"][0]["top_logprobs"]}
            assert ours.logprobs is not None
            for token, logprob in theirs.items():
                assert ours.logprobs[0][token] == pytest.approx(logprob, abs=5e-3)
