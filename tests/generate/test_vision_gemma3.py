"""Images on a Gemma 3 model (``VisionSpec(projector="gemma3")``): libmtmd asks for the image's
embeddings to attend to each other both ways (``mtmd_decode_use_non_causal``), so the engine
decodes each image whole, in one batch with the causal mask off, as llama.cpp's mtmd-helper
does, even when a small ``chunk_size`` slices other images around decoding streams.

Against llama-server ``--mmproj`` (built from the pinned commit into
``~/.cache/llamabatch-anchors``; those tests skip without it): the same files, images and
prompts, greedy tokens identical and every step's top log-probs equal to 5e-3 (a text stream
in the same batches moves ggml's CPU rounding by about 1e-3). The random Gemma 3 model mostly
repeats a token, so the log-probs, which differ from image to image, tell answers apart.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_vision_anchor import ANCHORS, CASES, _images, _png, _post, anchor_server, complete

from llamabatch import LLM, LLMEngine, SamplingParams
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.testing import GEMMA3_TEXT, SWASpec, VisionSpec, make_vision_model

pytestmark = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")
needs_server = pytest.mark.skipif(
    not (ANCHORS / "llama-server").exists(), reason="llama-server anchor not built"
)

#: 64x64 pixels, 16x16 patches pooled 4x4: 16 embeddings an image
SPEC = VisionSpec(projector="gemma3", text=GEMMA3_TEXT, image_size=64, patch_size=4)
N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0, logprobs=3)


@pytest.fixture(scope="module")
def gemma3_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_vision_model(tmp_path_factory.mktemp("gemma3-vlm"), SPEC)


@pytest.fixture(scope="module")
def llm(gemma3_files):
    model, mmproj = gemma3_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1) as engine:
        yield engine


def _ask(seed: int, text: str = "<__media__>\nWhat is in the image?") -> dict:
    return {"prompt": text, "multi_modal_data": {"image": _images(seed, text)}}


def _chat(seed: int) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(_png(seed)).decode()
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


def _assert_logprobs_close(ours: list[dict[int, float]], theirs: list[dict[int, float]], tol: float) -> None:
    assert len(ours) == len(theirs)
    for step, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        for token, logprob in other.items():
            assert mine[token] == pytest.approx(logprob, abs=tol), (step, token)


def test_spec_checks():
    with pytest.raises(ValueError, match="Gemma 3 text model"):
        VisionSpec(projector="gemma3")  # a Llama text model
    with pytest.raises(ValueError, match="Gemma 3 text model"):
        VisionSpec(text=GEMMA3_TEXT)  # LLaVA's projector
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionSpec(projector="gemma3", text=GEMMA3_TEXT, image_size=40, patch_size=4)
    assert SPEC.n_image_tokens == 16 and isinstance(SPEC.text, SWASpec)


def test_the_image_is_decoded_with_bidirectional_attention(llm):
    """libmtmd loads the projector, gives an image 16 embeddings at 16 positions, wraps it in
    Gemma 3's markers and says it needs bidirectional attention."""
    vision = llm.core.vision
    assert not vision.mtmd.mrope
    media = vision.media_prompt(_ask(0), 1024, 8)
    ((first, chunk),) = media.images
    assert vision.mtmd.non_causal(chunk)
    assert (chunk.n_tokens, chunk.n_pos) == (SPEC.n_image_tokens, SPEC.n_image_tokens)
    assert media.end == first + 16
    assert llm.detokenize(media.tokens[:first]).endswith("<start_of_image>")
    assert llm.detokenize(media.tokens[media.end :]).startswith("<end_of_image>")


def test_a_prefix_ending_inside_an_image_restarts_it(llm):
    """Cells of a bidirectional image attended to the whole image: a reused prefix that ends
    inside it cannot keep part of it, and the slot is cut back to the image's first position."""
    from test_vision_mrope import assert_a_prefix_inside_the_image_restarts_it

    assert_a_prefix_inside_the_image_restarts_it(llm, _ask(6), slot=2, inside=5)


@pytest.fixture(scope="module")
def reference(gemma3_files) -> dict[str, list[dict]]:
    """llama-server's answers: the prompts of ``CASES`` (``/completion``), and the chats of
    :func:`_chat` (its chat template applied by ``/apply-template``, then ``/completion``)."""
    if not (ANCHORS / "llama-server").exists():
        pytest.skip("llama-server anchor not built")
    model, mmproj = gemma3_files
    port = 19500 + os.getpid() % 400
    with anchor_server(model, mmproj, port) as marker:
        prompts = [
            complete(port, prompt.replace("<__media__>", marker), _images(seed, prompt), N)
            for seed, prompt in CASES
        ]
        chats = []
        for seed in (3, 4):
            text = _post(port, "/apply-template", {"messages": _chat(seed)})["prompt"]
            assert text.count(marker) == 1
            chats.append(complete(port, text, [_png(seed)], N))
    return {"prompts": prompts, "chats": chats}


def _theirs(answer: dict) -> list[dict[int, float]]:
    return [
        {p["id"]: p["logprob"] for p in step["top_logprobs"]} for step in answer["completion_probabilities"]
    ]


@needs_server
@pytest.mark.timeout(180)
@pytest.mark.parametrize("chunk_size", [512, 4])
def test_greedy_answers_equal_llama_server(gemma3_files, reference, chunk_size: int, monkeypatch) -> None:
    """Beside a text stream; with ``chunk_size=4`` a causal image would be computed in
    slices of 4 around it, but a Gemma 3 image goes whole into one decode, causal mask off."""
    import llamabatch.generate.vision as vision_module

    model, mmproj = gemma3_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=1, chunk_size=chunk_size) as llm:
        vision = llm.core.vision
        events: list[tuple[str, object]] = []
        set_causal_attn, check_decode = vision.mtmd.set_causal_attn, vision_module.check_decode

        def causal(context, value: bool) -> None:
            events.append(("causal", value))
            set_causal_attn(context, value)

        def decoded(code: int, what: str) -> None:
            if what == "llama_decode (image)":
                events.append(("image", vision._batch.n_tokens))
            check_decode(code, what)

        monkeypatch.setattr(vision.mtmd, "set_causal_attn", causal)
        monkeypatch.setattr(vision_module, "check_decode", decoded)
        for (seed, prompt), answer in zip(CASES, reference["prompts"], strict=True):
            events.clear()
            text = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            outs = llm.generate(["Once upon a time", _ask(seed, prompt)], [text, GREEDY], use_tqdm=False)
            ours = outs[1].outputs[0]
            assert ours.token_ids == answer["tokens"], (seed, prompt)
            assert ours.usage.prompt_tokens == answer["tokens_evaluated"]
            assert ours.logprobs is not None
            _assert_logprobs_close(ours.logprobs, _theirs(answer), 5e-3)
            # each image: one decode of its 16 embeddings with the causal mask off
            n_images = prompt.count("<__media__>")
            assert events == [("causal", False), ("image", 16), ("causal", True)] * n_images


@needs_server
@pytest.mark.timeout(120)
def test_chat_answers_equal_llama_server(llm, reference) -> None:
    """A chat message with an image: ours (the model's ChatML template) and llama-server's
    template applied to the same message, then completed: the same prompt and answer."""
    for seed, answer in zip((3, 4), reference["chats"], strict=True):
        ours = llm.chat(_chat(seed), GREEDY)[0].outputs[0]
        assert ours.token_ids == answer["tokens"], seed
        assert ours.usage.prompt_tokens == answer["tokens_evaluated"]
        assert ours.logprobs is not None
        _assert_logprobs_close(ours.logprobs, _theirs(answer), 1e-3)
    first, second = (_theirs(a)[0] for a in reference["chats"])
    assert first != second  # the image is what moved them


@pytest.mark.timeout(120)
def test_two_images_in_one_batch_answer_as_alone(gemma3_files, llm) -> None:
    """Two requests with different images admitted together, beside two text streams and
    with ``chunk_size=4``: each image decoded whole on its own, each answer its own alone."""
    alone = [llm.generate(_ask(seed), GREEDY)[0].outputs[0] for seed in (20, 21)]
    assert alone[0].logprobs != alone[1].logprobs
    model, mmproj = gemma3_files
    engine = LLMEngine(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1, chunk_size=4)
    try:
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        texts = [engine.add_request(prompt, long) for prompt in ("Once upon a time", "The quick brown fox")]
        engine.step()
        ids = [engine.add_request(_ask(seed), GREEDY) for seed in (20, 21)]
        answers: dict[str, object] = {}
        while len(answers) < 2 and engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id in ids and out.finished:
                    answers[out.request_id] = out.output
        for text in texts:
            engine.abort_request(text)
        while engine.has_unfinished_requests():
            engine.step()
        for request_id, whole in zip(ids, alone, strict=True):
            answer = answers[request_id]
            assert answer.token_ids == whole.token_ids  # type: ignore[attr-defined]
            assert whole.logprobs is not None
            _assert_logprobs_close(answer.logprobs, whole.logprobs, 1e-3)  # type: ignore[attr-defined]
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_an_image_larger_than_n_ubatch_is_refused(gemma3_files) -> None:
    """llama.cpp computes a non-causal batch in one micro-batch and aborts the process
    (GGML_ASSERT) when it holds more than ``n_ubatch`` tokens: an image of 16 embeddings with
    ``n_ubatch=8`` is refused with a ValueError before it reaches llama_decode, and
    ``n_ubatch=16`` computes it. In a subprocess: the abort, were it back, would end pytest."""
    model, mmproj = gemma3_files
    script = textwrap.dedent(
        f"""
        import numpy as np
        from llamabatch import LLM, SamplingParams
        image = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
        ask = {{"prompt": "<__media__>\\nWhat?", "multi_modal_data": {{"image": image}}}}
        params = SamplingParams(max_tokens=2, temperature=0)
        for n_ubatch in (8, 16):
            with LLM({str(model)!r}, mmproj={str(mmproj)!r}, n_ctx=512, n_batch=64, n_ubatch=n_ubatch,
                     n_threads=1) as llm:
                try:
                    out = llm.generate(ask, params)[0].outputs[0]
                    print(n_ubatch, "answered", out.finish_reason, len(out.token_ids))
                except ValueError as exc:
                    print(n_ubatch, "refused", exc)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("8 refused") and "n_ubatch=8" in lines[0], run.stdout
    assert lines[1] == "16 answered length 2", run.stdout
