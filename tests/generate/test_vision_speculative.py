"""Speculative decoding on prompts with images: the ``ngram`` and ``suffix`` methods draft text
only (a lookup that runs into an image's stand-in ids stops there, ``draft_cuts.text_drafts``),
outputs stay those of the same engine without drafts, and a draft model, which cannot see the
images, is refused with ``mmproj``."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import pytest

import llamabatch.generate.speculative as speculative
from llamabatch import LLM, SamplingParams
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.config import EngineConfig
from llamabatch.generate.draft_cuts import text_drafts
from llamabatch.generate.draft_model import Draft, DraftJob
from llamabatch.testing import QWEN2VL_TEXT, VisionSpec, make_vision_model

needs_mtmd = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")

QWEN = VisionSpec(projector="qwen2vl_merger", text=QWEN2VL_TEXT, image_size=16, patch_size=4)


def test_text_drafts_stop_at_the_first_stand_in_id():
    q = np.full((3, 4), 0.25, dtype=np.float32)
    drafts = {
        "through": Draft([5, 6, -3, 7], "match"),
        "at_once": Draft([-1, 2], "match"),
        "text": Draft([1, 2, 3], "sampled", q),
        "sampled": Draft([4, -9, 4], "sampled", q),
    }
    out = text_drafts(drafts)
    assert out["through"].tokens == [5, 6] and out["through"].rule == "match"
    assert "at_once" not in out
    assert out["text"] is drafts["text"]
    assert out["sampled"].tokens == [4] and out["sampled"].q is not None and len(out["sampled"].q) == 1


def test_a_draft_model_with_images_is_refused(tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"")
    spec = {"method": "draft_model", "model": str(draft)}
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(mmproj="projector.gguf", speculative_config=spec)
    for method in ("ngram", "suffix"):  # text drafts are fine
        EngineConfig(mmproj="projector.gguf", speculative_config={"method": method})


class _IntoTheImage:
    """A drafter whose every draft runs into the prompt's image (the prompt's first stand-in
    id: what a history lookup gives where the match continues into an image) at once or after
    the pending token, in turn, with the real drafter's draft beyond it."""

    def __init__(self, inner: speculative.Drafter) -> None:
        self.inner = inner
        self.into_image = 0

    def draft(self, jobs: Sequence[DraftJob]) -> dict[Hashable, Draft]:
        out = self.inner.draft(jobs)
        for job in jobs:
            stand_in = next((t for t in job.prompt if t < 0), None)
            if stand_in is None:
                continue
            rest = out[job.key].tokens if job.key in out else []
            head = [stand_in] if self.into_image % 2 == 0 else [job.output[-1], stand_in]
            out[job.key] = Draft([*head, *rest][: job.k], "match")
            self.into_image += 1
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@needs_mtmd
@pytest.mark.parametrize("spec", [None, QWEN], ids=["clip", "mrope"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("kv_unified", [False, True], ids=["streams", "unified"])
def test_drafts_beside_images_keep_the_answers(tmp_path, monkeypatch, spec, method, kv_unified):
    """Drafts that run into an image are cut there and the tokens are those of the same
    requests without drafts, on a projector with plain positions and on an M-RoPE one (whose
    images hold more KV cells than positions: the drafts' room in one buffer counts them,
    ``EngineCore.kv_cells_free``), in either KV layout."""
    model, mmproj = make_vision_model(tmp_path, spec) if spec else make_vision_model(tmp_path)
    drafters: list[_IntoTheImage] = []
    lookup = speculative.lookup_drafter

    def wrapped(config):
        drafters.append(_IntoTheImage(lookup(config)))
        return drafters[-1]

    monkeypatch.setattr(speculative, "lookup_drafter", wrapped)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (20, 30, 3), dtype=np.uint8) for _ in range(2)]
    text = "one two three four five one two three four five"
    prompts = [
        {"prompt": f"{text} <__media__> {text}", "multi_modal_data": {"image": images[0]}},
        {"prompt": f"<__media__> and <__media__>: {text}", "multi_modal_data": {"image": images}},
        text,
    ]
    off = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculative=False)
    on = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    config = {"method": method}
    options = {"n_ctx": 1024, "n_parallel": 4, "n_threads": 1, "kv_unified": kv_unified}
    with LLM(model, mmproj=str(mmproj), speculative_config=config, **options) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, off, use_tqdm=False)]
        drafted = llm.generate(prompts, on, use_tqdm=False)
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in drafted] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in drafted)
    assert drafters and drafters[0].into_image > 0
    assert stats.spec_draft_tokens > 0


@needs_mtmd
def test_server_chat_with_an_image_speculates_and_answers_as_without(tmp_path, monkeypatch):
    """/v1/chat/completions with an image_url part on an engine with n-gram speculation whose
    drafts run into the image: the answer is the one without drafts (the request's
    ``speculative: false``)."""
    import json

    from starlette.testclient import TestClient

    from llamabatch.bench.images import data_url, make_png
    from llamabatch.server.app import create_app
    from llamabatch.server.limits import ServerLimits

    lookup = speculative.lookup_drafter
    monkeypatch.setattr(speculative, "lookup_drafter", lambda config: _IntoTheImage(lookup(config)))
    model, mmproj = make_vision_model(tmp_path)
    options = {"n_ctx": 1024, "n_parallel": 2, "n_threads": 1, "speculative_config": {"method": "ngram"}}
    with LLM(model, mmproj=str(mmproj), **options) as llm:
        app = create_app(llm, chat_template="chatml", limits=ServerLimits(allowed_hosts=("testserver",)))
        image = {"type": "image_url", "image_url": {"url": data_url(make_png(30, 20, seed=80))}}
        text = {"type": "text", "text": "What is this? one two three one two three"}
        messages = [{"role": "user", "content": [text, image]}]
        with TestClient(app) as client:
            answers = []
            for drafts_on in (False, True):
                body = {"messages": messages, "max_tokens": 24, "temperature": 0, "speculative": drafts_on}
                headers = {"content-type": "application/json"}
                r = client.post("/v1/chat/completions", content=json.dumps(body), headers=headers)
                assert r.status_code == 200, r.text
                answers.append(r.json()["choices"][0]["message"]["content"])
        drafted = llm.stats().spec_draft_tokens
    assert answers[0] == answers[1]
    assert drafted > 0
