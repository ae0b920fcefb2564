"""What one request may hold, and the errors a request's own sampling constraints cause.

- Sampler chains (a grammar's parser each) are built when a completion is admitted, not at
  submit, freed when it ends, and a flood of grammar requests leaves the process's RSS near
  where it was (measured in a subprocess); a chain that cannot be built at admission ends its
  request only; a bad grammar still raises at submit.
- A request's estimated memory is checked against ``max_request_memory_mb``
  (``RequestTooLarge``, a 400 from the server); checked grammars are remembered by digest, not
  by their text.
- A dead end the request's own grammar causes (``min_tokens`` past ``root ::= "a"``) is a
  ``GrammarDeadEnd`` in the output and a 400 from the server, not a 500.
- ``stop_token_ids`` outside the vocabulary are refused at submit, naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

import llamabatch.generate.request_memory as request_memory
from llamabatch import (
    LLM,
    GrammarDeadEnd,
    LLMEngine,
    RequestTooLarge,
    SamplingParams,
)
from llamabatch.generate.request_memory import estimate_request_bytes, grammar_parser_bytes
from llamabatch.gguf.testing import model_path
from llamabatch.prompts.grammar_check import check_grammar

N_PARALLEL = 2
#: a grammar whose parser holds about 1 MB: 400 rules, each entered through the one before
DEEP_GRAMMAR = (
    "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "z" | "x{i}"' for i in range(400)) + '\nr400 ::= "e"\n'
)
DEAD_END = {"grammar": 'root ::= "a"', "min_tokens": 5, "max_tokens": 8}


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    with LLMEngine(model_path("tiny"), n_parallel=N_PARALLEL, n_ctx=1024, n_threads=1) as eng:
        yield eng


def live_samplers(requests) -> int:
    return sum(1 for r in requests if r.sampler is not None and not r.sampler.closed)


# -- samplers at admission ------------------------------------------------------------------


def test_samplers_are_built_at_admission_and_freed_at_the_end(engine):
    params = SamplingParams(grammar="root ::= [a-z]+", n=6, max_tokens=4, temperature=1.0, seed=5)
    rid = engine.add_request("Hello", params)
    requests = list(engine.core.requests.values())
    assert len(requests) == 6 and all(r.request_id == rid for r in requests)
    assert live_samplers(requests) == 0, "a queued completion holds a sampler"
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, live_samplers(requests))
    assert most == N_PARALLEL  # only running completions hold one
    assert live_samplers(requests) == 0
    assert all(r.sampler is not None and r.sampler.closed for r in requests)
    outputs = [r.output for r in requests]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in outputs)
    assert len({tuple(o.token_ids) for o in outputs}) > 1  # seed + index: completions differ


def test_a_bad_grammar_still_raises_at_submit(engine):
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("Hello", SamplingParams(grammar="root ::= [b-a]", max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_a_sampler_that_cannot_be_built_at_admission_ends_only_its_request(engine, monkeypatch):
    build = request_memory.build_sampler

    def flaky(model, params, index, n_ctx_seq, masks=None, prompt=()):
        if index == 1:
            raise MemoryError("no memory for this parser")
        return build(model, params, index, n_ctx_seq, masks, prompt)

    monkeypatch.setattr(request_memory, "build_sampler", flaky)
    params = SamplingParams(grammar="root ::= [a-z]+", n=3, max_tokens=3, temperature=1.0)
    rid = engine.add_request("Hello", params)  # the trial build at submit is completion 0's
    ends: dict[int, int] = {}
    outputs = {}
    while engine.has_unfinished_requests():
        for step in engine.step():
            if step.finished:
                ends[step.index] = ends.get(step.index, 0) + 1
                outputs[step.index] = step.output
    assert ends == {0: 1, 1: 1, 2: 1}
    assert outputs[1].finish_reason == "error" and "no memory for this parser" in outputs[1].error
    assert outputs[1].error_type is MemoryError
    assert outputs[0].finish_reason == outputs[2].finish_reason == "length"
    assert all(o.request_id == rid for o in outputs.values())
    # the engine goes on
    engine.add_request("Hello", SamplingParams(max_tokens=2))
    (out,) = engine.run_until_complete()
    assert out.finish_reason == "length"


# -- the memory estimate --------------------------------------------------------------------


def test_the_estimate_counts_running_parsers_and_every_output():
    parser = grammar_parser_bytes(DEEP_GRAMMAR)
    assert 1 << 20 < parser < 4 << 20  # measured about 1.4 MB per parser
    one = estimate_request_bytes(SamplingParams(grammar=DEEP_GRAMMAR, max_tokens=1), 4)
    many = estimate_request_bytes(SamplingParams(grammar=DEEP_GRAMMAR, max_tokens=1, n=100), 4)
    assert 4 * parser < many < 4 * parser + 100 * 1000  # waiting completions hold no parser
    assert parser < one < parser + 1000
    plain = estimate_request_bytes(SamplingParams(max_tokens=1000, n=10), 4)
    with_logprobs = estimate_request_bytes(SamplingParams(max_tokens=1000, n=10, logprobs=20), 4)
    assert with_logprobs > 10 * plain


def test_a_request_over_the_memory_budget_is_refused_at_submit():
    with LLMEngine(model_path("tiny"), n_parallel=2, n_ctx=1024, n_threads=1, max_request_memory_mb=2) as eng:
        with pytest.raises(RequestTooLarge, match="max_request_memory_mb=2") as info:
            eng.add_request("Hello", SamplingParams(n=16, max_tokens=200, logprobs=20))
        assert isinstance(info.value, ValueError)
        assert not eng.has_unfinished_requests()
        eng.add_request("Hello", SamplingParams(n=2, max_tokens=4, logprobs=2))
        assert [o.finish_reason for o in eng.run_until_complete()] == ["length", "length"]


def test_checked_grammars_are_remembered_without_their_text():
    """A grammar that passed ``check_grammar`` is remembered by digest: 256 remembered grammars
    of 256 KiB kept 64 MiB alive (and a second copy under each name they were checked as)."""
    grammar = 'root ::= "' + "ab" * 50_000 + '"'
    before = sys.getrefcount(grammar)
    first = check_grammar(grammar, what="SamplingParams.json_schema (the grammar made from it)")
    assert sys.getrefcount(grammar) == before
    assert check_grammar(grammar, what="SamplingParams.grammar") is first  # one entry, any name
    assert grammar_parser_bytes(grammar) > 100_000


_FLOOD_SCRIPT = """
import json, os, sys, time
from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import model_path

grammar, n_parallel = sys.argv[1], 4

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

with LLM(model_path("tiny"), n_parallel=n_parallel, n_ctx=512, n_threads=1) as llm:
    def run(n, k):
        params = SamplingParams(grammar=grammar, n=n, max_tokens=2, temperature=1.0, seed=1)
        handles = [llm.submit("Hello", params) for _ in range(k)]
        queued = rss_mb()
        for handle in handles:
            handle.result(timeout=120)
        time.sleep(0.2)
        return queued

    run(n_parallel, 1)  # warm-up: as many parsers as can run at once
    warm = rss_mb()
    floods = [(run(32, 4), rss_mb()) for _ in range(2)]
print(json.dumps({"warm": warm, "floods": floods}))
"""


def test_rss_returns_near_its_start_after_a_flood_of_grammar_requests():
    """Four requests of n=32 with a grammar whose parser takes about 1 MB: built at submit,
    their 128 parsers took some 40 MB more while they waited, and the process kept it."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FLOOD_SCRIPT), DEEP_GRAMMAR],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    warm = figures["warm"]
    for queued, after in figures["floods"]:
        assert queued < warm * 1.15, figures  # queued requests hold no parser
        assert after < warm * 1.15, figures


# -- errors the request's own constraints cause ----------------------------------------------


def test_a_dead_end_of_the_requests_own_grammar_is_a_grammar_dead_end(engine):
    engine.add_request("Hello", SamplingParams(**DEAD_END))
    (out,) = engine.run_until_complete()
    assert out.finish_reason == "error" and "admits no token" in out.error
    assert out.error_type is not None and issubclass(out.error_type, GrammarDeadEnd)
    assert issubclass(GrammarDeadEnd, ValueError)


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_submit(engine):
    n_vocab = engine.model.n_vocab
    with pytest.raises(ValueError, match=rf"SamplingParams\.stop_token_ids: token id {n_vocab} "):
        engine.add_request("Hello", SamplingParams(stop_token_ids=[3, n_vocab], max_tokens=2))
    with pytest.raises(ValueError, match="stop_token_ids"):  # min_tokens bans them while sampling
        engine.add_request("Hello", SamplingParams(stop_token_ids=[n_vocab + 10**6], min_tokens=2))
    assert not engine.has_unfinished_requests()
    engine.add_request("Hello", SamplingParams(stop_token_ids=[n_vocab - 1], max_tokens=2))
    assert engine.run_until_complete()[0].finish_reason in ("length", "stop")


# -- the server's statuses ------------------------------------------------------------------

httpx = pytest.importorskip("httpx")

from test_server import serve  # noqa: E402 (after the skip: it needs the server extra)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    pytest.importorskip("starlette")
    from llamabatch.server import create_app

    with LLM(model_path("tiny"), n_parallel=2, n_ctx=1024, n_threads=1, max_request_memory_mb=4) as llm:
        with serve(create_app(llm, model_name="tiny")) as url:
            yield url


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": "tiny", **body}, timeout=60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_a_dead_end_of_the_requests_grammar_is_a_400(base_url, path):
    prompt = {"prompt": "Hello"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]}
    answer = post(base_url, path, {**prompt, **DEAD_END})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "grammar_dead_end" and "admits no token" in error["message"]
    # streamed: the headers are sent; the error event carries the 400's body
    answer = post(base_url, path, {**prompt, **DEAD_END, "stream": True})
    assert answer.status_code == 200
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert any(e.get("error", {}).get("code") == "grammar_dead_end" for e in events), answer.text


def test_server_stop_token_ids_outside_the_vocabulary_are_a_400(base_url):
    answer = post(
        base_url, "/v1/completions", {"prompt": "Hello", "stop_token_ids": [1 << 20], "max_tokens": 2}
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "stop_token_ids" and "n_vocab" in error["message"]


def test_server_a_request_over_the_memory_budget_is_a_400(base_url):
    body = {"prompt": "Hello", "n": 16, "max_tokens": 500, "logprobs": 5}
    answer = post(base_url, "/v1/completions", body)
    assert answer.status_code == 400, answer.text
    assert "max_request_memory_mb=4" in answer.json()["error"]["message"]
    answer = post(base_url, "/v1/completions", {**body, "n": 1, "max_tokens": 2})
    assert answer.status_code == 200, answer.text


def test_the_idle_engine_trims_the_heap_after_a_flood_of_plain_requests(monkeypatch):
    """Not only grammars: after ``TRIM_AFTER_COMPLETIONS`` admitted completions of any kind,
    the engine gives the freed C heap back once it goes idle (once: nothing since, no trim)."""
    from llamabatch.generate.request import Request
    from llamabatch.generate.request_memory import TRIM_AFTER_COMPLETIONS, SamplerBuilder

    trims: list[int] = []
    monkeypatch.setattr(request_memory, "trim_heap", lambda: trims.append(1) or True)
    builder = SamplerBuilder(None, 256)  # type: ignore[arg-type]  # plain greedy builds nothing
    for _ in range(TRIM_AFTER_COMPLETIONS - 1):
        assert builder.attach(Request([1], SamplingParams(max_tokens=1, temperature=0))) is None
    builder.when_idle()
    assert trims == []
    builder.attach(Request([1], SamplingParams(max_tokens=1, temperature=0)))
    builder.when_idle()
    builder.when_idle()
    assert trims == [1] and builder.heap_trims == 1
