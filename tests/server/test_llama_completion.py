"""llama-server's own ``POST /completion`` (and ``/completions``): its request fields and its
answer's shape, whole and streamed, on the tiny model. The text is the engine's: the same as
``/v1/completions`` for the same greedy request."""

from __future__ import annotations

import json

import pytest

from llamabatch import LLM, testing
from llamabatch.prompts.infill import infill_tokens

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

FIELDS = {
    "index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
    "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
    "tokens_cached", "timings",
}  # fmt: skip
TIMINGS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
    "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}  # fmt: skip


def test_an_answer_in_llama_servers_shape(served):
    body = {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0, "return_tokens": True}
    r = served.post("/completion", body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert set(d) == FIELDS and set(d["timings"]) == TIMINGS
    assert d["stop"] is True and d["stop_type"] == "limit" and d["tokens_predicted"] == 6
    assert len(d["tokens"]) == 6 and served.llm.detokenize(d["tokens"]).strip() == d["content"].strip()
    prompt = served.llm.tokenize("Once upon a time")
    assert d["tokens_evaluated"] == len(prompt) and d["tokens_cached"] == len(prompt) + 5
    assert d["generation_settings"]["n_predict"] == 6 and d["generation_settings"]["temperature"] == 0
    assert d["model"] == "tiny" and d["prompt"].endswith("Once upon a time")  # (BOS and all)
    oai = served.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0})
    assert oai.json()["choices"][0]["text"] == d["content"]
    again = served.post("/completions", {**body, "return_tokens": False}).json()
    assert again["content"] == d["content"] and again["tokens"] == []  # /completions: the same
    assert again["timings"]["cache_n"] == len(prompt) - 1  # the prefix cache


def test_stop_words_probabilities_and_streaming(served):
    whole = served.post("/completion", {"prompt": "Hello", "n_predict": 12, "temperature": 0}).json()
    word = whole["content"].split()[-1]
    body = {"prompt": "Hello", "n_predict": 12, "temperature": 0, "stop": [word]}
    d = served.post("/completion", body).json()
    assert d["stop_type"] == "word" and d["stopping_word"] == word
    assert word not in d["content"] and whole["content"].startswith(d["content"])
    d = served.post("/completion", {"prompt": "Hello", "n_predict": 3, "temperature": 0, "n_probs": 2}).json()
    probs = d["completion_probabilities"]
    assert len(probs) == 3 and all(len(p["top_logprobs"]) == 2 for p in probs)
    assert all(
        p["logprob"] <= 0 and set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} for p in probs
    )
    assert probs[0]["top_logprobs"][0]["logprob"] == pytest.approx(probs[0]["logprob"])  # greedy: the best
    with httpx.stream(
        "POST",
        f"{served.url}/completion",
        json={"prompt": "Hello", "n_predict": 12, "temperature": 0, "stream": True},
        headers=served.auth,
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]  # (no [DONE] event)
    assert [e["tokens_predicted"] for e in events[:-1]] == list(range(1, len(events)))
    assert sum(len(e["tokens"]) for e in events[:-1]) == 12 and events[-1]["timings"]["predicted_n"] == 12


def test_llama_server_request_forms(served):
    hello = served.llm.tokenize("Hello", add_special=False)
    mixed = served.post("/completion", {"prompt": [*hello, " world"], "n_predict": 2, "temperature": 0})
    text = served.post("/completion", {"prompt": "Hello world", "n_predict": 2, "temperature": 0})
    assert mixed.status_code == 200 and mixed.json()["tokens_evaluated"] == len(
        hello + served.llm.tokenize(" world", add_special=False)
    )
    assert text.status_code == 200
    many = served.post("/completion", {"prompt": ["Hi", "Bye"], "n_predict": 2, "temperature": 0}).json()
    assert [d["index"] for d in many] == [0, 1]
    best = served.post(
        "/completion", {"prompt": "Hi", "n_predict": 1, "temperature": 0, "return_tokens": True}
    )
    token = best.json()["tokens"][0]
    banned = {
        "prompt": "Hi",
        "n_predict": 1,
        "temperature": 0,
        "return_tokens": True,
        "logit_bias": [[token, False]],
    }
    assert served.post("/completion", banned).json()["tokens"][0] != token
    only = {"prompt": "Hi", "n_predict": 2, "response_fields": ["content", "timings/prompt_n", "missing"]}
    assert set(served.post("/completion", only).json()) == {"content", "timings/prompt_n"}
    evaluated = served.post("/completion", {"prompt": "Hi there", "n_predict": 0}).json()
    assert evaluated["content"] == "" and evaluated["tokens_predicted"] == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "logit_bias": [[1, 2, 3]]}, "logit_bias"),
        ({"prompt": "Hi", "n_probs": 101}, "n_probs"),
        ({"prompt": "Hi", "n_predict": -2}, "n_predict"),
        ({"prompt": [1, "a", None]}, "prompt"),
        ({"prompt": "Hi", "response_fields": [1]}, "response_fields"),
        ({"prompt": "word " * 5000}, "prompt"),
    ],
)
def test_bad_fields_are_400s_naming_them(served, body, param):
    r = served.post("/completion", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def fim_url(tmp_path_factory):
    """The tiny model with fill-in-the-middle tokens (a code model's), served."""
    from test_server import serve

    from llamabatch.server import create_app

    path = testing.write_llama_gguf(
        tmp_path_factory.mktemp("fim") / "tiny-fim.gguf", testing.PRESETS["tiny"], fim=True
    )
    with LLM(path, n_ctx=4096, n_batch=512, n_parallel=1, n_threads=1) as llm, serve(create_app(llm)) as url:
        yield url, llm


def test_infill_fills_in_the_middle(fim_url):
    url, llm = fim_url
    body = {
        "input_prefix": "def add(a, b):\n    ",
        "input_suffix": "\n\nprint(add(1, 2))\n",
        "input_extra": [{"filename": "util.py", "text": "x = 1\n"}],
        "prompt": "return",
        "n_predict": 4,
        "temperature": 0,
    }
    d = httpx.post(f"{url}/infill", json=body, timeout=60).json()
    ids = [testing.FIM_IDS[k] for k in ("pre", "suf", "mid", "rep", "sep")]
    expected = infill_tokens(
        llm.model.fim,
        lambda text: llm.tokenize(text, add_special=False),
        body["input_prefix"],
        body["input_suffix"],
        extra=[("util.py", "x = 1\n")],
        prompt="return",
        bos=llm.model.bos,
        n_batch=512,
        n_predict=4,
        n_ctx=llm.n_ctx_seq,
    )
    assert d["tokens_evaluated"] == len(expected) and d["tokens_predicted"] == 4
    assert all(token in expected for token in ids)  # the other file is in: the context has room
    completion = httpx.post(f"{url}/completion", json={"prompt": expected, "n_predict": 4, "temperature": 0})
    assert d["content"] == completion.json()["content"]  # the same prompt, the same text
    r = httpx.post(f"{url}/infill", json={"input_prefix": "a"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix"
    r = httpx.post(f"{url}/infill", json={**body, "input_extra": [{"filename": 3, "text": ""}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_extra"


def test_infill_needs_a_model_with_fim_tokens(served):
    r = served.post("/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 501 and "fill-in-the-middle" in r.json()["error"]["message"]
