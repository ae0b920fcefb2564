"""KV cells of M-RoPE images (Qwen2-VL style): an image holds ``n_tokens`` cells for its
``n_pos`` positions. Admission counts the cells (two image prompts whose positions fit the
KV cache but whose cells do not run one after the other, none fails), and usage counts
them as llama-server does (``n_tokens`` per image)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llamabatch import LLM, SamplingParams
from llamabatch._ffi.mtmd import mtmd_available
from llamabatch.errors import PromptTooLong
from llamabatch.generate.image_cells import ImageCells, prompt_cells, surcharge
from llamabatch.testing import QWEN2VL_TEXT, VisionSpec, make_vision_model

pytestmark = pytest.mark.skipif(not mtmd_available(), reason="this llama.cpp build has no libmtmd")

SPEC = VisionSpec(projector="qwen2vl_merger", text=QWEN2VL_TEXT, image_size=16, patch_size=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TEXT = "<__media__>\nWhat is in the image?"


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    return make_vision_model(tmp_path_factory.mktemp("qwen2vl-cells"), SPEC)


def _ask(seed: int, shape: tuple[int, int] = (128, 128), text: str = TEXT) -> dict:
    image = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    return {"prompt": text, "multi_modal_data": {"image": image}}


@pytest.mark.timeout(180)
def test_image_prompts_whose_cells_do_not_fit_together_run_in_turn(qwen_files):
    """A 128x128 image: 256 embeddings at 16 positions. Each prompt takes 64 positions but
    304 cells: two fit a 512-cell cache by positions, not by cells (nor beside the cached
    prefixes of earlier ones). Every request answers, as it does alone."""
    model, mmproj = qwen_files
    with LLM(model, mmproj=str(mmproj), n_ctx=512, n_parallel=2, n_threads=1) as llm:
        media = llm.core.vision.media_prompt(_ask(0), 512, 8)
        ((_, chunk),) = media.images
        assert (chunk.n_tokens, chunk.n_pos) == (256, 16)
        assert 2 * len(media.tokens) < 512 < 2 * (len(media.tokens) + 240)
        answers = {}
        for seeds in ((1, 2), (3, 4)):
            outs = llm.generate([_ask(seed) for seed in seeds], GREEDY, use_tqdm=False)
            assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"], seeds
            answers.update({seed: o.outputs[0].token_ids for seed, o in zip(seeds, outs, strict=True)})
        for seed, tokens in answers.items():
            assert llm.generate(_ask(seed), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_usage_counts_image_embeddings_as_llama_server(qwen_files):
    """llama-server counts an image's n_tokens in a prompt's tokens (a 30x20 image: 12
    embeddings at 4 positions, so 8 more than the prompt's positions); ``prompt_token_ids``
    keep one id per position. A cached prefix counts its image's cells too."""
    model, mmproj = qwen_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        first = llm.generate(_ask(3, (20, 30)), GREEDY, use_tqdm=False)[0]
        assert first.outputs[0].usage.prompt_tokens == len(first.prompt_token_ids) + 8
        again = llm.generate(_ask(3, (20, 30)), GREEDY, use_tqdm=False)[0]
        usage = again.outputs[0].usage
        assert usage.prompt_tokens == len(again.prompt_token_ids) + 8
        assert usage.reused_tokens == usage.prompt_tokens - 1


def test_a_chat_prompt_counts_its_image_cells_against_the_context(qwen_files):
    """A chat's images are tokenized before the length check: its cells are counted there too."""
    model, mmproj = qwen_files
    with LLM(model, mmproj=str(mmproj), n_ctx=512, n_parallel=1, n_threads=1) as llm:
        media = llm.core.vision.media_prompt(_ask(4), 512, 1)
        n_cells = len(media.tokens) + 240
        fits = SamplingParams(max_tokens=512 - n_cells, temperature=0)
        assert llm.generate(media, fits, use_tqdm=False)[0].outputs[0].finish_reason in ("length", "stop")
        with pytest.raises(PromptTooLong, match="KV cells"):
            llm.generate(media, SamplingParams(max_tokens=512 - n_cells + 1, temperature=0), use_tqdm=False)


def _media(images: list[tuple[int, int, int]], n: int) -> SimpleNamespace:
    """A prompt of ``n`` positions with images ``(first, n_pos, n_tokens)``: negative
    stand-in ids at each image's positions, ``-(first + 1)`` at its first (as ``Vision``'s)."""
    tokens = list(range(1, n + 1))
    for first, n_pos, _ in images:
        tokens[first : first + n_pos] = [-(first + 1)] + [-1000 * (first + 1) - i for i in range(1, n_pos)]
    chunks = [(first, SimpleNamespace(n_pos=n_pos, n_tokens=n_tokens)) for first, n_pos, n_tokens in images]
    return SimpleNamespace(tokens=tokens, images=chunks)


def test_cells_of_prompts_and_what_admitting_them_adds():
    media = _media([(2, 4, 12), (10, 3, 3)], 20)  # an M-RoPE image, then a 1-D one
    assert prompt_cells(media, 20) == 28 and prompt_cells(media, 2) == 2
    assert prompt_cells(media, 3) == 3 + 11  # its cells sit at its first position: all or none
    assert surcharge(media, 0) == 8 and surcharge(media, 6) == 0  # the image cached whole
    assert surcharge(media, 4) == 8 + 2  # inside it: it is computed again from position 2


def test_resident_cells_count_a_shared_image_once_and_in_tokens_counts_a_state():
    cells = ImageCells(limit=2)
    media = _media([(2, 4, 12)], 10)
    cells.note(media)
    seqs = [media.tokens, media.tokens[:8], [5, -3, -3001], []]  # a copy, and another place
    table = SimpleNamespace(n_seq=4, seq_tokens=lambda s: np.asarray(seqs[s], dtype=np.int32))
    assert cells.resident(table) == 8 + (12 - 2)
    assert cells.in_tokens(media.tokens) == 8 and cells.in_tokens([1, 2, 3]) == 0
    cells.note(_media([(0, 2, 4)], 4))
    cells.note(_media([(1, 2, 4)], 4))
    assert cells.in_tokens(media.tokens) == 0  # forgotten (LRU): counted by its positions


def test_the_ram_tier_counts_a_saved_states_image_cells(qwen_files):
    model, mmproj = qwen_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        media = llm.core.vision.media_prompt(_ask(5), 1024, 8)
        extra = llm.core.kv.extra_cells
        assert extra is not None and extra(np.asarray(media.tokens, dtype=np.int32)) == 240


def test_server_chat_usage_counts_image_cells(qwen_files):
    """/v1/chat/completions, whole and streamed: usage is the engine's (cells), not the
    prompt's positions."""
    import base64
    import json

    from starlette.testclient import TestClient
    from test_vision_anchor import _png

    from llamabatch.server.app import create_app
    from llamabatch.server.limits import ServerLimits

    url = "data:image/png;base64," + base64.b64encode(_png(6)).decode()  # 30x20: 12 cells, 4 positions
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": parts}]
    model, mmproj = qwen_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        n_positions = len(llm.chat(messages, GREEDY, chat_template="chatml")[0].prompt_token_ids)
        app = create_app(llm, chat_template="chatml", limits=ServerLimits(allowed_hosts=("testserver",)))
        with TestClient(app) as client:
            for stream in (False, True):
                body = {"messages": messages, "max_tokens": 3, "temperature": 0, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                headers = {"content-type": "application/json"}
                r = client.post("/v1/chat/completions", content=json.dumps(body), headers=headers)
                assert r.status_code == 200, r.text
                if stream:
                    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
                    usage = json.loads(events[-1])["usage"]
                else:
                    usage = r.json()["usage"]
                assert usage["prompt_tokens"] == n_positions + 8, stream
                assert usage["prompt_tokens_details"]["cached_tokens"] == n_positions + 8 - 1


def test_admission_weighs_an_image_prompt_by_its_cells(qwen_files, monkeypatch):
    """Issue 38: the admission policy (and the tick cost model behind ``target_itl_ms`` and
    the SLOs) was told a prompt's positions: a 128x128 image counted 16 where it computes
    256 embeddings. It is told the cells now."""
    from llamabatch.generate.admission import PriorityAdmission

    seen: list[int] = []
    admits = PriorityAdmission.admits

    def spy(self, request, n_prompt, table, busy):
        seen.append(n_prompt)
        return admits(self, request, n_prompt, table, busy)

    monkeypatch.setattr(PriorityAdmission, "admits", spy)
    model, mmproj = qwen_files
    with LLM(model, mmproj=str(mmproj), n_ctx=1024, n_parallel=1, n_threads=1) as llm:
        media = llm.core.vision.media_prompt(_ask(5), 1024, 1)
        llm.generate(_ask(5), SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert seen == [len(media.tokens) + 240]
