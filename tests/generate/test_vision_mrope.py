"""Images on an M-RoPE model (Qwen2-VL style, ``VisionSpec(projector="qwen2vl_merger")``):
an image's embeddings take 4-value positions of its grid and fewer positions than embeddings,
and the engine computes them whole or in slices of rows with the same results. (Token
equality with llama-server is in ``test_vision_anchor.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llamabatch import LLM, LLMEngine, SamplingParams
from llamabatch._ffi.embd_batch import EmbdBatch
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.testing import QWEN2VL_TEXT, VisionSpec, make_vision_model

pytestmark = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")

SPEC = VisionSpec(projector="qwen2vl_merger", text=QWEN2VL_TEXT, image_size=16, patch_size=4)
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=3)


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    return make_vision_model(tmp_path_factory.mktemp("qwen2vl"), SPEC)


@pytest.fixture(scope="module")
def llm(qwen_files):
    model, mmproj = qwen_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1) as engine:
        yield engine


def _image(seed: int, shape: tuple[int, int] = (20, 30)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def _ask(image: np.ndarray, text: str = "<__media__>\nWhat is in the image?") -> dict:
    return {"prompt": text, "multi_modal_data": {"image": image}}


def test_spec_checks():
    with pytest.raises(ValueError, match="projector"):
        VisionSpec(projector="resampler")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 \\* patch_size"):
        VisionSpec(projector="qwen2vl_merger", text=QWEN2VL_TEXT, image_size=12, patch_size=4)


def test_embd_batch_lays_out_mrope_positions_section_major():
    batch = EmbdBatch(8, 2, n_pos_per_embd=4)
    first = np.array([[5, 5], [5, 6], [7, 8], [0, 0]], dtype=np.int32)
    batch.add(np.zeros((2, 2), np.float32), 1, positions=first)
    assert batch.pos[:8].tolist() == [5, 5, 5, 6, 7, 8, 0, 0]
    batch.add(np.ones((1, 2), np.float32), 1, positions=np.array([[9], [9], [9], [0]], dtype=np.int32))
    # the stride of a section is the batch's n_tokens: laid out anew after each add
    assert batch.n_tokens == 3 and batch.pos[:12].tolist() == [5, 5, 9, 5, 6, 9, 7, 8, 9, 0, 0, 0]
    with pytest.raises(ValueError, match="4 position values"):
        batch.add(np.zeros((1, 2), np.float32), 1, pos0=3)
    with pytest.raises(ValueError, match="positions must be"):
        batch.add(np.zeros((1, 2), np.float32), 1, positions=np.zeros((4, 2), np.int32))


def test_an_image_takes_its_grid_positions(llm):
    """A 30x20 image: a 4x3 grid of merged patches, 12 embeddings at 4 positions (the
    longer side); the text after it starts 4 positions on, and the prompt's ids count positions."""
    vision = llm.core.vision
    assert vision.mtmd.mrope
    media = vision.media_prompt(_ask(_image(0)), 1024, 8)
    ((first, chunk),) = media.images
    assert (chunk.n_tokens, chunk.n_pos) == (12, 4) and media.end == first + 4
    assert all(t < 0 for t in media.tokens[first : media.end]) and media.tokens[media.end] >= 0
    grid = vision.mtmd.mrope_positions(chunk, first)
    assert grid.shape == (4, 12)
    assert (grid[0] == first).all() and (grid[3] == 0).all()
    assert grid[1].tolist() == [first + y for y in range(3) for _ in range(4)]
    assert grid[2].tolist() == [first + x for _ in range(3) for x in range(4)]


def _chat(seed: int) -> list[dict]:
    import base64

    from test_vision_anchor import _png

    url = "data:image/png;base64," + base64.b64encode(_png(seed)).decode()
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


def test_chat_with_an_image_answers_and_reuses_its_prefix(llm):
    out = llm.chat(_chat(3), GREEDY, chat_template="chatml")[0]
    assert len(out.outputs[0].token_ids) == 6
    again = llm.chat(_chat(3), GREEDY, chat_template="chatml")[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.outputs[0].usage.reused_tokens == again.outputs[0].usage.prompt_tokens - 1  # KV cells
    other = llm.chat(_chat(4), GREEDY, chat_template="chatml")[0]
    assert other.outputs[0].token_ids != out.outputs[0].token_ids


@pytest.mark.timeout(120)
def test_sliced_image_decode_equals_whole(qwen_files, llm):
    """With chunk_size=4 and text streams decoding, a 40-embedding image (8 positions) is
    computed in slices of rows over several ticks: same tokens and log-probs as computed whole."""
    image = _image(5, (64, 40))
    whole = llm.generate(_ask(image), GREEDY)[0].outputs[0]
    model, mmproj = qwen_files
    engine = LLMEngine(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1, chunk_size=4)
    try:
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        texts = [engine.add_request(prompt, long) for prompt in ("Once upon a time", "The quick brown fox")]
        for _ in range(2):
            engine.step()
        image_id = engine.add_request(_ask(image), GREEDY)
        answer = None
        while answer is None and engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == image_id and out.finished:
                    answer = out.output
        for text in texts:  # they decoded beside every slice; their end does not matter
            engine.abort_request(text)
        while engine.has_unfinished_requests():
            engine.step()
        vision = engine.core.vision
        assert vision.counters.image_slices >= 40 // 4
        assert answer is not None and answer.token_ids == whole.token_ids
        assert answer.logprobs is not None and whole.logprobs is not None
        for ours, theirs in zip(answer.logprobs, whole.logprobs, strict=True):
            for token, logprob in theirs.items():
                assert ours[token] == pytest.approx(logprob, abs=1e-3)
    finally:
        engine.close()


def test_a_prefix_ending_inside_an_image_restarts_it(llm):
    """M-RoPE image cells share one temporal position, so a reused prefix that ends inside
    the image cannot keep part of it: the slot is cut back to the image's first position."""
    assert_a_prefix_inside_the_image_restarts_it(llm, _ask(_image(6)), slot=3, inside=2)


def assert_a_prefix_inside_the_image_restarts_it(llm, prompt, slot: int, inside: int) -> None:
    """``llm``'s vision, on ``prompt`` (one image): a reused prefix ending ``inside`` positions
    into the image is cut back to the image's first position (KV and slot table); one that
    ends before the image keeps what it has."""
    from llamabatch.generate.vision import Vision

    shared = llm.core.vision
    vision = Vision(shared.mtmd, shared.limits, shared.n_batch)  # not the engine thread's
    media = vision.media_prompt(prompt, 1024, 8)
    ((first, _),) = media.images
    calls: list[tuple] = []
    core = SimpleNamespace(
        context=SimpleNamespace(seq_rm=lambda *a: calls.append(("seq_rm", *a))),
        table=SimpleNamespace(trim=lambda *a: calls.append(("trim", *a))),
    )
    request = SimpleNamespace(media=media)
    assert vision.prefill(core, slot, request, first + inside) == first
    assert calls == [("seq_rm", slot, first, -1), ("trim", slot, first)]
    assert vision.holds[slot].pos == first and vision.holds[slot].row == 0
    calls.clear()
    assert vision.prefill(core, slot, request, first - 1) == first - 1 and calls == []


@pytest.mark.timeout(120)
def test_a_full_kv_cache_mid_image_computes_the_image_again(qwen_files, llm, monkeypatch):
    """A slice of an M-RoPE image that finds the KV cache full: the image's earlier rows
    share its temporal position, so they are dropped with it and the image is computed again
    from its first row (after an eviction); the answer is the one computed whole."""
    import llamabatch.generate.vision as vision_module
    from llamabatch.errors import KVCacheFull

    image = _image(7, (64, 40))
    whole = llm.generate(_ask(image), GREEDY)[0].outputs[0].token_ids
    model, mmproj = qwen_files
    engine = LLMEngine(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1, chunk_size=4)
    real = vision_module.check_decode
    image_decodes: list[int] = []

    def full_once(code: int, what: str) -> None:
        real(code, what)
        if what == "llama_decode (image)":
            image_decodes.append(code)
            if len(image_decodes) == 3:  # this slice's cells are in: as a decode failing midway
                raise KVCacheFull(1, "no room")

    monkeypatch.setattr(vision_module, "check_decode", full_once)
    monkeypatch.setattr(engine.core.kv, "evict_one", lambda: True)
    try:
        text = engine.add_request(
            "Once upon a time", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        )
        engine.step()
        image_id = engine.add_request(_ask(image), GREEDY)
        answer = None
        while answer is None and engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == image_id and out.finished:
                    answer = out.output
        engine.abort_request(text)
        while engine.has_unfinished_requests():
            engine.step()
        assert answer is not None and answer.token_ids == whole
        # sliced (the text stream decoding beside it), failed at the third slice, then redone
        assert engine.core.vision.counters.image_slices >= 40 // 4 and len(image_decodes) > 40 // 4
    finally:
        engine.close()
