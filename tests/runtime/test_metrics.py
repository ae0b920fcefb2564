"""``llamabatch.runtime.metrics.PrometheusListener`` on real engines: counters match the work done and
the exposition parses with prometheus_client's own parser."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llamabatch import LLM, Embedder, SamplingParams
from llamabatch.gguf.testing import english_sentences, model_path
from llamabatch.runtime.metrics import PrometheusListener
from llamabatch.runtime.telemetry import RequestEvent

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model_path("tiny"), n_ctx=4096, n_parallel=4, n_threads=1) as llm:
        yield llm


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_generation_counters_match_requests(llm):
    metrics = PrometheusListener()
    metrics.attach(llm, model_name="tiny")
    prompts = english_sentences(5)
    stop_prompt = "Count: one two"
    outs = llm.generate(prompts, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True), use_tqdm=False)
    # one request that stops on an end-of-generation token: biased so it comes first
    stop = llm.generate(stop_prompt, SamplingParams(max_tokens=5, logit_bias={2: 100.0}), use_tqdm=False)[0]
    completions = [o for out in [*outs, stop] for o in out.outputs]
    assert stop.outputs[0].finish_reason == "stop"

    s = _samples(metrics.generate_latest().decode())
    prompt_tokens = sum(c.usage.prompt_tokens for c in completions)
    generated = sum(c.usage.completion_tokens for c in completions)
    assert _value(s, "llamabatch:prompt_tokens_total", model_name="tiny") == prompt_tokens
    assert _value(s, "llamabatch:generation_tokens_total", model_name="tiny") == generated
    assert _value(s, "llamabatch:request_success_total", model_name="tiny", finished_reason="length") == 5
    assert _value(s, "llamabatch:request_success_total", model_name="tiny", finished_reason="stop") == 1
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds"):
        assert _value(s, f"llamabatch:{name}_count", model_name="tiny") == 6
        assert _value(s, f"llamabatch:{name}_bucket", model_name="tiny", le="+Inf") == 6
    gaps = sum(max(0, c.usage.completion_tokens - 1) for c in completions)
    assert _value(s, "llamabatch:inter_token_latency_seconds_count", model_name="tiny") == gaps
    assert _value(s, "llamabatch:inter_token_latency_seconds_sum", model_name="tiny") > 0
    assert _value(s, "llamabatch:request_generation_tokens_sum", model_name="tiny") == generated
    assert _value(s, "llamabatch:prefix_cache_queries_total", model_name="tiny") == prompt_tokens
    reused = sum(c.usage.reused_tokens for c in completions)
    assert _value(s, "llamabatch:prefix_cache_hits_total", model_name="tiny") == reused
    assert _value(s, "llamabatch:forward_passes_total", model_name="tiny") >= 7
    assert _value(s, "llamabatch:iteration_tokens_total", model_name="tiny") >= generated
    # gauges come from llm.stats() at scrape time: idle now
    assert _value(s, "llamabatch:num_requests_running", model_name="tiny") == 0
    assert _value(s, "llamabatch:num_requests_waiting", model_name="tiny") == 0
    assert _value(s, "llamabatch:num_slots", model_name="tiny") == 4
    usage = _value(s, "llamabatch:kv_cache_usage_perc", model_name="tiny")
    assert 0 <= usage <= 1
    assert _value(s, "llamabatch:num_preemptions_total", model_name="tiny") == llm.stats().preemptions
    metrics.detach(llm)


def test_gauges_see_running_and_waiting(llm):
    metrics = PrometheusListener()
    metrics.attach(llm)
    name = model_path("tiny").stem  # the default label: the GGUF's file stem
    params = SamplingParams(max_tokens=900, ignore_eos=True)
    handles = [llm.submit(p, params) for p in english_sentences(6)]  # 4 slots: 2 wait
    try:
        for _ in range(200):
            s = _samples(metrics.generate_latest().decode())
            if _value(s, "llamabatch:num_requests_running", model_name=name) == 4:
                break
        assert _value(s, "llamabatch:num_requests_running", model_name=name) == 4
        assert _value(s, "llamabatch:num_requests_waiting", model_name=name) == 2
        assert _value(s, "llamabatch:kv_cache_usage_perc", model_name=name) > 0
    finally:
        for handle in handles:
            handle.cancel()
        for handle in handles:
            handle.result(30)
    s = _samples(metrics.generate_latest().decode())
    assert _value(s, "llamabatch:request_success_total", model_name=name, finished_reason="cancelled") == 6
    metrics.detach(llm)


def test_plain_listener_and_shared_registry(llm):
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusListener(registry, model_name="app")
    llm.add_listener(metrics)  # events only (no gauges without attach)
    try:
        llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        llm.remove_listener(metrics)
    s = _samples(prometheus_client.generate_latest(registry).decode())
    assert _value(s, "llamabatch:generation_tokens_total", model_name="app") == 3
    with pytest.raises(ValueError):  # one listener per registry: names would collide
        PrometheusListener(registry)


def test_direct_events_without_an_engine():
    metrics = PrometheusListener(model_name="m")
    metrics(RequestEvent(1, "stop", 10, 5, 4, 0.01, 0.1, 0.5, 100.0, 10.0))
    metrics(RequestEvent(2, "error", 3, 0, 0, 0.0, None, 0.2, None, None))
    s = _samples(metrics.generate_latest().decode())
    assert _value(s, "llamabatch:request_success_total", model_name="m", finished_reason="error") == 1
    assert _value(s, "llamabatch:time_to_first_token_seconds_count", model_name="m") == 1
    assert _value(s, "llamabatch:inter_token_latency_seconds_count", model_name="m") == 4
    assert _value(s, "llamabatch:inter_token_latency_seconds_sum", model_name="m") == pytest.approx(0.4)
    assert _value(s, "llamabatch:inter_token_latency_seconds_bucket", model_name="m", le="0.1") == 4
    assert _value(s, "llamabatch:inter_token_latency_seconds_bucket", model_name="m", le="0.075") == 0
    assert _value(s, "llamabatch:prefix_cache_hits_total", model_name="m") == 4


def test_embedder_packs_and_closed_sources():
    metrics = PrometheusListener()
    texts = english_sentences(20)
    with Embedder(model_path("tiny"), pooling="mean", n_batch=512, n_seq_max=8, n_threads=1) as emb:
        metrics.attach(emb, model_name="emb")
        emb.embed(texts)
        stats = emb.stats()
        s = _samples(metrics.generate_latest().decode())
        assert _value(s, "llamabatch:embedding_sequences_total", model_name="emb") == 20
        assert _value(s, "llamabatch:embedding_packs_total", model_name="emb") == stats.packs
        assert _value(s, "llamabatch:embedding_tokens_total", model_name="emb") == stats.tokens
        assert _value(s, "llamabatch:embedding_pack_utilisation_count", model_name="emb") == stats.packs
        assert _value(s, "llamabatch:embedding_queue_texts", model_name="emb") == 0
    # closed: the scrape still works, the counts stay
    s = _samples(metrics.generate_latest().decode())
    assert _value(s, "llamabatch:embedding_sequences_total", model_name="emb") == 20
