"""Images in the engine (``generate/vision.py``): prompts with ``multi_modal_data`` on the
random-weight vision model, the prefix cache keyed by image content, and the limits."""

from __future__ import annotations

import numpy as np
import pytest

from llamabatch import LLM, SamplingParams
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.config import EngineConfig
from llamabatch.errors import ImageError
from llamabatch.testing import make_vision_model

pytestmark = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory):
    return make_vision_model(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def llm(vision_files):
    model, mmproj = vision_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1) as engine:
        yield engine


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (20, 30, 3), dtype=np.uint8)


def _ask(image, text: str = "<__media__>\nWhat is in the image?") -> dict:
    return {"prompt": text, "multi_modal_data": {"image": image}}


def test_same_image_same_answer_other_image_other_answer(llm):
    a, b = _image(0), _image(1)
    first = llm.generate(_ask(a), GREEDY)[0].outputs[0].token_ids
    other = llm.generate(_ask(b), GREEDY)[0].outputs[0].token_ids
    again = llm.generate(_ask(a.copy()), GREEDY)[0].outputs[0]
    assert again.token_ids == first
    assert other != first
    # right after, the same image again: the whole prompt but its last token from the prefix cache
    cached = llm.generate(_ask(a), GREEDY)[0]
    assert cached.outputs[0].usage.reused_tokens == len(cached.prompt_token_ids) - 1
    assert cached.outputs[0].token_ids == first


def test_answers_do_not_depend_on_the_batch(llm):
    """An image request decoded alone and among text streams and other images: same tokens."""
    alone = [llm.generate(_ask(_image(s)), GREEDY)[0].outputs[0].token_ids for s in (10, 11)]
    mixed = llm.generate(
        [_ask(_image(10)), "The quick brown fox", _ask(_image(11)), "Tell me a story about"],
        GREEDY,
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_two_images_in_one_prompt(llm):
    a, b = _image(20), _image(21)
    ab = llm.generate(
        {"prompt": "<__media__> and <__media__>?", "multi_modal_data": {"image": [a, b]}}, GREEDY
    )
    ba = llm.generate(
        {"prompt": "<__media__> and <__media__>?", "multi_modal_data": {"image": [b, a]}}, GREEDY
    )
    assert ab[0].outputs[0].token_ids != ba[0].outputs[0].token_ids


def test_images_without_markers_go_first(llm):
    image = _image(30)
    marked = llm.generate(_ask(image, "<__media__>\nDescribe."), GREEDY)[0].outputs[0].token_ids
    unmarked = llm.generate(_ask(image, "Describe."), GREEDY)[0].outputs[0].token_ids
    assert marked == unmarked


def test_encoder_cache_counts(llm):
    vision = llm.core.vision
    before = dict(vision.counters.as_dict())
    image = _image(40)
    llm.generate(_ask(image, "<__media__>\nOne."), GREEDY)
    llm.generate(_ask(image, "<__media__>\nTwo, another text after the same image."), GREEDY)
    after = vision.counters.as_dict()
    assert after["encoded"] == before["encoded"] + 1
    assert after["cache_bytes"] > 0
    llm.generate(_ask(image, "Text before: <__media__>\nThree."), GREEDY)  # no prefix: the encoder cache
    after = vision.counters.as_dict()
    assert after["encoded"] == before["encoded"] + 1
    assert after["cache_hits"] == before["cache_hits"] + 1
    stats = llm.stats()
    assert (stats.encoder_encoded, stats.encoder_cache_hits) == (after["encoded"], after["cache_hits"])
    assert stats.encoder_cache_bytes == after["cache_bytes"] > 0
    assert stats.encoder_image_positions > 0 and stats.encoder_images >= 2


def test_encoder_counters_in_metrics(llm):
    from llamabatch.metrics import PrometheusListener

    llm.generate(_ask(_image(41)), GREEDY)
    listener = PrometheusListener()
    listener.attach(llm, model_name="vlm")
    try:
        text = listener.generate_latest().decode()
    finally:
        listener.detach(llm)
    encoded = llm.stats().encoder_encoded
    assert f'llamabatch:encoder_encoded{{model_name="vlm"}} {float(encoded)}' in text
    assert 'llamabatch:encoder_cache_bytes{model_name="vlm"}' in text


def test_refusals(llm, vision_files):
    with pytest.raises(ValueError, match="markers"):
        llm.generate({"prompt": "<__media__> <__media__>", "multi_modal_data": {"image": _image(0)}}, GREEDY)
    with pytest.raises(ValueError, match="text after its last image"):
        llm.generate({"prompt": "<__media__>", "multi_modal_data": {"image": _image(0)}}, GREEDY)
    with pytest.raises(ImageError, match=r"multi_modal_data.image\[0\]: not a PNG"):
        llm.generate(_ask(b"not an image"), GREEDY)
    with pytest.raises(ImageError, match="more than the 8 allowed"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": [_image(0)] * 9}}, GREEDY)
    with pytest.raises(ImageError, match="remote image URLs are off"):
        llm.generate(_ask("https://example.com/cat.png"), GREEDY)
    with pytest.raises(ValueError, match="'image'"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": b""}}, GREEDY)


def test_images_need_an_mmproj(tiny_path):
    with LLM(tiny_path, n_ctx=256, n_parallel=1) as engine:
        with pytest.raises(ValueError, match="no mmproj"):
            engine.generate(_ask(_image(0)), GREEDY)


def test_config_refuses_what_images_cannot_run_with():
    with pytest.raises(ValueError, match="max_image_pixels"):
        EngineConfig(max_image_pixels=0)
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(mmproj="x.gguf", speculative_config={"method": "draft_model", "model": "d.gguf"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout", [{"n_ctx": 1024}, {"n_ctx": 256, "kv_unified": True}], ids=["room", "preempting"]
)
def test_images_without_the_prefix_cache(vision_files, layout):
    """``prefix_cache=False`` computes every prompt's images anew (nothing reused, parallel
    sampling included), and answers as the engine with the cache does: the image positions
    are the request's own, computed into its slot, with or without preemption."""
    model, mmproj = vision_files
    prompts = [
        _ask(_image(0)),
        _ask([_image(0), _image(3)], "Look: <__media__> and <__media__> now"),
        _ask(_image(2), "tell me " * 30 + "<__media__> ok"),
    ] * 2
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, n=2)
    answers = {}
    for prefix_cache in (True, False):
        with LLM(
            model, mmproj=str(mmproj), n_parallel=4, n_threads=1, prefix_cache=prefix_cache, **layout
        ) as engine:
            answers[prefix_cache] = engine.generate(prompts, params)
            stats = engine.stats()
        assert stats.prefix_cache is prefix_cache
    # a leader computes its whole prompt without the cache (its samples may share it)
    assert all(out.outputs[0].usage.reused_tokens == 0 for out in answers[False])
    assert any(out.outputs[0].usage.reused_tokens > 0 for out in answers[True][3:])
    for cached, fresh in zip(answers[True], answers[False], strict=True):
        for mine, theirs in zip(cached.outputs, fresh.outputs, strict=True):
            assert len(mine.token_ids) == len(theirs.token_ids) == 16
            for step, (a, b) in enumerate(zip(mine.logprobs, theirs.logprobs, strict=True)):
                for token in set(a) & set(b):
                    assert a[token] == pytest.approx(b[token], abs=0.05), step
                if mine.token_ids[step] != theirs.token_ids[step]:
                    break  # a near tie flipped between batch shapes (random weights)


@pytest.mark.timeout(120)
def test_a_failing_image_ends_only_its_request(vision_files, monkeypatch):
    """The encoder failing on one request's image ends that request with its error; the text
    request beside it and later image requests are served."""
    model, mmproj = vision_files
    with LLM(model, mmproj=str(mmproj), n_ctx=512, n_parallel=2, n_threads=1) as engine:
        mtmd = engine.core.vision.mtmd
        encode = mtmd.encode

        def failing(chunk):
            raise RuntimeError("libmtmd could not encode the image (error 1)")

        monkeypatch.setattr(mtmd, "encode", failing)
        text, image = engine.generate(["Once upon a time", _ask(_image(50))], GREEDY, use_tqdm=False)
        assert text.outputs[0].finish_reason == "length" and len(text.outputs[0].token_ids) == 6
        assert image.outputs[0].finish_reason == "error"
        assert "could not encode the image" in (image.outputs[0].error or "")
        monkeypatch.setattr(mtmd, "encode", encode)
        again = engine.generate(_ask(_image(50)), GREEDY)[0].outputs[0]
        assert again.finish_reason == "length" and len(again.token_ids) == 6


@pytest.mark.timeout(120)
def test_text_streams_decode_between_image_slices(vision_files, llm):
    """With chunk_size=4, an image's 16 positions take several ticks, and its encode runs on
    the encoder thread; every tick meanwhile the text streams decode a token too, and the
    image's answer is the one computed whole."""
    from llamabatch import LLMEngine

    model, mmproj = vision_files
    engine = LLMEngine(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1, chunk_size=4)
    try:
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        texts = {engine.add_request(p, long) for p in ("Once upon a time", "The quick brown fox")}
        for _ in range(3):
            engine.step()
        image_id = engine.add_request(_ask(_image(60)), GREEDY)
        vision = engine.core.vision
        tick = vision.tick
        held_after_tick: list[bool] = []

        def watched(core, budget):
            left = tick(core, budget)
            held_after_tick.append(bool(vision.holds))
            return left

        vision.tick = watched
        produced: list[set] = []
        answer = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            produced.append({o.request_id for o in outputs if o.new_token_ids})
            answer = next((o.output for o in outputs if o.request_id == image_id and o.finished), answer)
        held = [i for i, h in enumerate(held_after_tick) if h]
        assert len(held) >= 3  # the image took several ticks
        assert all(texts <= produced[i] for i in held)  # and the text streams decoded in each
        assert vision.counters.image_slices >= 16 // 4  # 16 image positions, 4 a tick
        assert vision.counters.cache_hits == 0  # one image, encoded once (on the encoder thread)
        whole = llm.generate(_ask(_image(60)), GREEDY)[0].outputs[0].token_ids
        assert answer is not None and answer.token_ids == whole
    finally:
        engine.close()


# -- chat: OpenAI image_url content parts ---------------------------------------------------


def _data_url(seed: int) -> str:
    import base64

    from test_vision_anchor import _png

    return "data:image/png;base64," + base64.b64encode(_png(seed)).decode()


def _chat(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_image_parts(llm):
    """An image_url part becomes the media marker where the template renders it; the answer
    is the one of the same text and image through generate."""
    url = _data_url(70)
    out = llm.chat(_chat(_image_part(url)), GREEDY, chat_template="chatml")[0]
    # as llama-server joins the parts: no newline before or after a marker
    assert out.prompt.count("<__media__>") == 1 and "What is this?<__media__><|im_end|>" in out.prompt
    same = llm.generate({"prompt": out.prompt, "multi_modal_data": {"image": url}}, GREEDY)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids and out.outputs[0].token_ids
    other = llm.chat(_chat(_image_part(_data_url(71))), GREEDY, chat_template="chatml")[0]
    assert other.outputs[0].token_ids != out.outputs[0].token_ids


def test_chat_image_errors_name_the_part(llm, tiny_path):
    from llamabatch.chat import ChatRequestError

    bad = "data:image/png;base64," + "aGVsbG8="
    with pytest.raises(ChatRequestError, match=r"messages\[0\]\.content\[1\]: ") as info:
        llm.chat(_chat(_image_part(bad)), GREEDY, chat_template="chatml")
    assert info.value.param == "messages[0].content[1]"
    with pytest.raises(ChatRequestError, match="remote image URLs are off"):
        llm.chat(_chat(_image_part("https://example.com/a.png")), GREEDY, chat_template="chatml")
    with pytest.raises(ChatRequestError, match="needs its URL"):
        llm.chat(_chat({"type": "image_url", "image_url": {}}), GREEDY, chat_template="chatml")
    with LLM(tiny_path, n_ctx=256, n_parallel=1) as text_only:
        with pytest.raises(ChatRequestError, match="mmproj") as info:
            text_only.chat(_chat(_image_part(_data_url(0))), GREEDY, chat_template="chatml")
        assert info.value.param == "messages[0].content[1]"


def test_server_chat_with_images(llm):
    """/v1/chat/completions: an image_url part answers as LLM.chat does; a bad image is a 400
    naming the part, and the server goes on."""
    import json

    from starlette.testclient import TestClient

    from llamabatch.server.app import create_app
    from llamabatch.server.limits import ServerLimits

    url = _data_url(72)
    expected = llm.chat(_chat(_image_part(url)), GREEDY, chat_template="chatml")[0].outputs[0].text
    app = create_app(llm, chat_template="chatml", limits=ServerLimits(allowed_hosts=("testserver",)))
    with TestClient(app) as client:

        def post(messages: list[dict]):
            body = {"messages": messages, "max_tokens": 6, "temperature": 0}
            return client.post(
                "/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"}
            )

        r = post(_chat(_image_part(url)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected
        r = post(_chat(_image_part("data:image/png;base64,aGVsbG8=")))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"
        assert post(_chat(_image_part(url))).status_code == 200


def test_hold_strategy_plans_only_slots_not_held():
    from types import SimpleNamespace

    from llamabatch.generate.vision import HoldStrategy

    class Nothing:
        def plan(self, view, budget, chunk_size, queue_depth):
            return [(s, 1) for s in view.decode_slots if s == 99]  # plans nothing here

    class Every:
        def plan(self, view, budget, chunk_size, queue_depth):
            return [(s, 1) for s in view.decode_slots] + [(s, 2) for s in view.prefill_slots]

    view = SimpleNamespace(decode_slots=[0, 1], prefill_slots=[2, 3], n_parallel=4, n_pending=lambda s: 10)
    holds = {1: object(), 3: object()}
    assert HoldStrategy(Every(), holds).plan(view, 8, 4, 0) == [(0, 1), (2, 2)]
    # the inner strategy planning nothing while others have work: decode tokens, then a chunk
    assert HoldStrategy(Nothing(), holds).plan(view, 8, 4, 0) == [(0, 1), (2, 4)]
    assert HoldStrategy(Nothing(), {0: None, 1: None, 2: None, 3: None}).plan(view, 8, 4, 0) == []


@pytest.mark.timeout(120)
def test_cancelling_a_held_request(vision_files):
    """A request cancelled while its image is being computed frees its slot; the text stream
    beside it goes on, and the next image request is served."""
    from llamabatch import LLMEngine

    model, mmproj = vision_files
    engine = LLMEngine(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=1, chunk_size=4)
    try:
        vision = engine.core.vision
        text = engine.add_request("Once upon a time", SamplingParams(max_tokens=30, temperature=0))
        engine.step()
        image = engine.add_request(_ask(_image(80)), GREEDY)
        while not vision.holds:
            engine.step()
        engine.abort_request(image)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.finish_reason
        assert finished == {text: "length", image: "cancelled"} and not vision.holds
        again = engine.add_request(_ask(_image(80)), GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.finish_reason
        assert finished[again] == "length"
    finally:
        engine.close()


def test_images_of_several_requests_go_to_the_encoder_together(vision_files, llm, monkeypatch):
    """Requests admitted together hand their images to the encoder thread as one group (in
    ``mtmd_batch`` runs), each encoded once, with the answers each gets alone."""
    from llamabatch._ffi.mtmd import MtmdContext

    groups: list[int] = []
    real = MtmdContext.encode_runs

    def spy(self, chunks):
        groups.append(len(chunks))
        return real(self, chunks)

    seeds = (90, 91, 92)
    alone = [llm.generate(_ask(_image(s)), GREEDY)[0].outputs[0].token_ids for s in seeds]
    monkeypatch.setattr(MtmdContext, "encode_runs", spy)
    model, mmproj = vision_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=4, n_threads=1) as engine:
        outs = engine.generate([_ask(_image(s)) for s in seeds], GREEDY, use_tqdm=False)
        stats = engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert groups and groups[0] == 3 and sum(groups) == 3
    assert stats.encoder_encoded == 3 and stats.encoder_cache_hits == 0


def test_a_failing_group_encode_ends_only_the_request_whose_image_fails(vision_files, monkeypatch):
    """A group's batched encode failing falls back to one encode per image: the image that
    fails alone ends its own request; the other request of the group is answered."""
    from llamabatch._ffi.mtmd import MtmdContext
    from llamabatch.prompts.images import image_key

    bad = image_key(_image(61))
    groups: list[int] = []

    def failing_runs(self, chunks):
        groups.append(len(chunks))
        raise RuntimeError("libmtmd could not encode the images")
        yield  # a generator, as the real one

    model, mmproj = vision_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=1) as engine:
        mtmd = engine.core.vision.mtmd
        encode = mtmd.encode

        def encode_unless_bad(chunk):
            if chunk.key == bad:
                raise RuntimeError("libmtmd could not encode the image (error 1)")
            return encode(chunk)

        monkeypatch.setattr(MtmdContext, "encode_runs", failing_runs)
        monkeypatch.setattr(mtmd, "encode", encode_unless_bad)
        good, failed = engine.generate([_ask(_image(60)), _ask(_image(61))], GREEDY, use_tqdm=False)
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 6
    assert failed.outputs[0].finish_reason == "error"
    assert "could not encode the image" in (failed.outputs[0].error or "")
    assert groups == [2]


@pytest.mark.parametrize(
    ("n_threads", "cores", "overlap"), [(1, {0, 1}, True), (2, {0, 1}, False), (2, {0, 1, 2, 3}, True)]
)
def test_encodes_run_beside_decodes_only_where_the_cores_hold_both(
    vision_files, monkeypatch, n_threads, cores, overlap
):
    # on 2 cores an encode beside a decode made ggml's spinning threads take turns (bulk
    # captioning at 0.85x llama-server's serial pace): there the engine waits for the encoder
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores, raising=False)
    model, mmproj = vision_files
    with LLM(str(model), mmproj=str(mmproj), n_threads=n_threads, n_parallel=2, n_ctx=1024) as llm:
        assert llm.core.vision.overlap is overlap
        out = llm.generate([_ask(_image(0))], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert out[0].outputs[0].finish_reason == "length"
