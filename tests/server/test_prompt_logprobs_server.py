"""A prompt's log-probabilities over HTTP: ``echo`` with ``logprobs`` on ``/v1/completions``
(what lm-evaluation-harness sends to score a text) and vLLM's ``prompt_logprobs`` field, on
completions and chat; both equal ``SamplingParams(prompt_logprobs=N)`` in process."""

from __future__ import annotations

import math

import pytest

from llamabatch import LLM, SamplingParams

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")


def _in_process(llm: LLM, prompt: list[int], n: int) -> list:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=n)
    return llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(served):
    prompt = served.llm.tokenize("The quick brown fox jumps over the lazy dog")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n = len(prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = _in_process(served.llm, prompt, 1)
    for i in range(1, n):  # lm-eval: token_logprobs[ctxlen:-1], top_logprobs for is_greedy
        assert lp["token_logprobs"][i] == pytest.approx(expected[i][prompt[i]], abs=1e-4)
        assert len(lp["top_logprobs"][i]) in (1, 2)
    assert math.isfinite(lp["token_logprobs"][n])  # the generated token
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    text = r.json()["choices"][0]["text"]
    assert "".join(lp["tokens"]) == text


def test_vllm_prompt_logprobs_on_completions_and_chat(served):
    prompt = served.llm.tokenize("Once upon a time there was")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3, "n": 2}
    choices = served.post("/v1/completions", body).json()["choices"]
    expected = _in_process(served.llm, prompt, 3)
    for choice in choices:  # every choice of the prompt carries them
        scores = choice["prompt_logprobs"]
        assert scores[0] is None and len(scores) == len(prompt)
        for i in range(1, len(prompt)):
            entry = scores[i]
            assert set(entry) >= {str(prompt[i])}
            assert [e["rank"] for e in entry.values()][:3] == [1, 2, 3]
            assert entry[str(prompt[i])]["logprob"] == pytest.approx(expected[i][prompt[i]], abs=1e-4)
            assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    assert choices[0]["logprobs"] is None  # (no echo: the legacy object is not asked for)
    messages = [{"role": "user", "content": "hi"}]
    r = served.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0})
    scores = r.json()["prompt_logprobs"]
    assert len(scores) == r.json()["usage"]["prompt_tokens"] and scores[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] is None for entry in scores[1:])


def test_prompt_logprobs_are_not_streamed_and_are_bounded(served):
    prompt = served.llm.tokenize("Hello there")
    echo = {"prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True, "stream": True}
    r = served.post("/v1/completions", echo)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = served.post("/v1/completions", {"prompt": prompt, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    chat = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True}
    assert served.post("/v1/chat/completions", chat).status_code == 400
    r = served.post("/v1/completions", {"prompt": prompt, "prompt_logprobs": 101})
    assert r.status_code == 400 and "prompt_logprobs" in r.text
    r = served.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None  # echo alone: text only


def test_max_tokens_0_with_echo_scores_the_prompt_alone(served):
    prompt = served.llm.tokenize("The quick brown fox")
    body = {"prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True}
    r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    lp = choice["logprobs"]
    assert (
        len(lp["tokens"]) == len(prompt)
        and lp["token_logprobs"][0] is None
        and usage["completion_tokens"] == 0
    )
    assert choice["text"] == "".join(lp["tokens"])  # the prompt, nothing after it
    expected = _in_process(served.llm, prompt, 1)
    assert lp["token_logprobs"][1:] == pytest.approx(
        [expected[i][prompt[i]] for i in range(1, len(prompt))], abs=1e-4
    )
    assert served.post("/v1/completions", {**body, "stream": True}).json()["error"]["param"] == "max_tokens"
    assert served.post("/v1/completions", {**body, "echo": False}).status_code == 400  # 0 needs echo
