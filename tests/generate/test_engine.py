"""The generation engine on real llama.cpp with project-made models."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from llama_reference import check_against_reference

from llamabatch import LLM, EngineClosed, PromptTooLong, QueueFull, SamplingParams, testing
from llamabatch.bench.runners.llama_cpp import load_llama_cpp
from llamabatch.runtime.telemetry import RequestEvent, TickEvent

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_path):
    # Flash attention off on both sides of the reference checks: on CPU it rounds
    # differently (~1e-3 in log-probs), which would hide real errors.
    with LLM(tiny_path, n_ctx=4096, n_parallel=8, n_batch=128, n_threads=2, flash_attn=False) as llm:
        yield llm


def _assert_no_kv(llm: LLM) -> None:
    """Nothing but the prefix cache holds KV cells once requests have ended, and llama.cpp
    holds exactly what the slot table records."""
    table = llm.core.table
    for seq in range(llm.n_parallel):
        assert llm.context.seq_pos_max(seq) == table.seq_len(seq) - 1
    llm.clear_prefix_cache()
    for seq in range(llm.context.n_seq_max):
        assert llm.context.seq_pos_max(seq) == -1, f"seq {seq} still holds KV cells"


def _wait_idle(llm: LLM, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while llm.stats().busy_slots and time.monotonic() < deadline:
        time.sleep(0.01)


def firsts(outs):
    """The first completion of each prompt's ``RequestOutput``."""
    return [o.outputs[0] for o in outs]


def _prompt(i: int) -> str:
    sentences = testing.english_sentences(64)
    return " ".join(sentences[i % 64 : i % 64 + 1 + i % 4])


# -- correctness against the reference ----------------------------------------------------------


def test_32_prompts_from_8_threads_match_teacher_forced_reference(tiny_path, llm):
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3)
    prompts = [_prompt(i) for i in range(32)]
    handles: list = [None] * 32

    def worker(k: int) -> None:
        for i in range(k, 32, 8):
            handles[i] = llm.submit(prompts[i], params)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [h.result(timeout=120).outputs[0] for h in handles]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)

    reference = load_llama_cpp(
        str(tiny_path), n_ctx=1024, n_batch=512, logits_all=True, verbose=False, flash_attn=False
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == reference.tokenize(prompt.encode(), add_bos=True, special=True)
    check_against_reference(reference, outs, top_n=3)
    _wait_idle(llm)
    _assert_no_kv(llm)


def test_single_greedy_matches_llama_cpp_python_completion(tiny_path, llm):
    prompt = "The history of the city begins with a small settlement"
    ours = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    reference = load_llama_cpp(str(tiny_path), n_ctx=512, verbose=False, flash_attn=False)
    theirs = reference.create_completion(prompt, max_tokens=16, temperature=0)
    assert ours.text == theirs["choices"][0]["text"]
    assert theirs["usage"]["completion_tokens"] == len(ours.token_ids)


def test_generate_keeps_input_order_and_usage(llm):
    prompts = [_prompt(i) for i in range(12)]
    outs = firsts(llm.generate(prompts, GREEDY))
    assert [o.prompt_token_ids for o in outs] == [llm.tokenize(p, parse_special=True) for p in prompts]
    for o in outs:
        assert o.usage.prompt_tokens == len(o.prompt_token_ids)
        assert o.usage.completion_tokens == len(o.token_ids) == 12
        assert o.timings.total >= (o.timings.time_to_first_token or 0) >= o.timings.queue_wait >= 0


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a = firsts(llm.generate(["tell me", "tell me"], params))
    b = llm.generate("tell me", params)[0].outputs[0]
    assert a[0].token_ids == a[1].token_ids == b.token_ids
    c = llm.generate("tell me", SamplingParams(max_tokens=16, temperature=1.0, top_k=0, seed=99))[0].outputs[
        0
    ]
    assert c.token_ids != a[0].token_ids


# -- streaming, async, handles ------------------------------------------------------------------


def test_stream_deltas_add_up(llm):
    deltas = list(llm.stream("streaming works", SamplingParams(max_tokens=9, temperature=0)))
    final = deltas[-1]
    assert final.finish_reason == "length" and final.output is not None
    assert "".join(d.text for d in deltas) == final.output.text
    assert [t for d in deltas for t in d.token_ids] == final.output.token_ids


def test_stream_closed_early_cancels(llm):
    stream = llm.stream("cancel me please", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    next(stream)
    stream.close()
    _wait_idle(llm)
    assert llm.stats().busy_slots == 0
    _assert_no_kv(llm)


def test_astream_and_task_cancellation(llm):
    async def main():
        texts = [
            d.text async for d in llm.astream("async hello", SamplingParams(max_tokens=5, temperature=0))
        ]
        got = []

        async def consume():
            async for delta in llm.astream("forever", SamplingParams(max_tokens=400, ignore_eos=True)):
                got.append(delta)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        out = await llm.agenerate("again", SamplingParams(max_tokens=4, temperature=0))
        return texts, out

    texts, out = asyncio.run(main())
    assert len(texts) >= 5 and out.outputs[0].finish_reason == "length"
    _wait_idle(llm)
    _assert_no_kv(llm)


def test_handle_iteration_cancel_and_timeout(llm):
    handle = llm.submit("a long one", SamplingParams(max_tokens=400, ignore_eos=True))
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.01)
    handle.cancel()
    out = handle.result(timeout=30).outputs[0]
    assert out.finish_reason == "cancelled"
    assert list(handle)[-1].finish_reason == "cancelled"
    handle.cancel()  # idempotent


def test_chat_uses_the_gguf_template(llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = llm.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\nbe brief<|im_end|>")
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    assert out.prompt_token_ids[:2] == [testing.BOS_ID, testing.IM_START_ID]
    assert out.finish_reason == "length"


def test_chat_pairs_params_with_conversations_one_by_one(llm):
    """As ``generate`` (and vLLM's ``LLM.chat``): a list of params goes one per conversation."""
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]]
    params = [SamplingParams(max_tokens=2, temperature=0), SamplingParams(max_tokens=5, temperature=0)]
    lengths = [len(r.outputs[0].token_ids) for r in llm.chat(conversations, params, use_tqdm=False)]
    assert lengths == [2, 5]
    alone = llm.chat(conversations[1], params[1])[0].outputs[0].token_ids
    assert llm.chat(conversations, params, priority=[1, 0], use_tqdm=False)[1].outputs[0].token_ids == alone
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 conversations"):
        llm.chat(conversations, params[:1])
    with pytest.raises(ValueError, match="got 3 priorities for 2 conversations"):
        llm.chat(conversations, params, priority=[0, 0, 0])


def test_tokenize_detokenize(llm):
    tokens = llm.tokenize("hello world")
    assert tokens[0] == testing.BOS_ID
    assert llm.detokenize(tokens[1:]).strip() == "hello world"


# -- sampling features --------------------------------------------------------------------------


def test_stop_strings_are_cut_and_held_back(llm):
    free = llm.generate("stop here", SamplingParams(max_tokens=30, temperature=0))[0].outputs[0]
    assert len(free.text) > 8
    stop = free.text[5:9]
    deltas = list(llm.stream("stop here", SamplingParams(max_tokens=30, temperature=0, stop=[stop, "zzzz"])))
    out = deltas[-1].output
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    assert "".join(d.text for d in deltas) == out.text
    kept = SamplingParams(max_tokens=30, temperature=0, stop=[stop, "zzzz"], include_stop_str_in_output=True)
    deltas = list(llm.stream("stop here", kept))
    out = deltas[-1].output
    assert out.stop_reason == stop and out.text == free.text[: free.text.index(stop) + len(stop)]
    assert "".join(d.text for d in deltas) == out.text


def test_eos_and_ignore_eos(llm):
    # A strong bias makes EOS the greedy choice after the first token.
    params = SamplingParams(max_tokens=10, temperature=0, logit_bias={testing.EOS_ID: 100.0})
    out = llm.generate("finish", params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [testing.EOS_ID] and out.text == ""
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias={testing.EOS_ID: 100.0}, ignore_eos=True)
    out = llm.generate("finish", params)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == [testing.EOS_ID] * 5


def test_grammar_constrains_output_and_utf8_is_never_split(llm):
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5, grammar='root ::= "€ü日" "€ü日"')
    deltas = list(llm.stream("x", params))
    out = deltas[-1].output
    assert out.text == "€ü日€ü日"
    assert all("\ufffd" not in d.text for d in deltas)


def test_logit_bias_and_penalties(llm):
    out = llm.generate("bias", SamplingParams(max_tokens=3, temperature=0, logit_bias={400: 50.0}))[
        0
    ].outputs[0]
    assert out.token_ids == [400, 400, 400]
    penalised = SamplingParams(max_tokens=3, temperature=0, logit_bias={400: 5.0}, repeat_penalty=1e9)
    assert len(set(llm.generate("bias", penalised)[0].outputs[0].token_ids)) == 3


def test_logprobs_shape(llm):
    out = llm.generate("lp", SamplingParams(max_tokens=4, temperature=0.7, seed=1, logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and 5 <= len(entry) <= 6
        assert all(v <= 0 for v in entry.values())


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="empty"):
        llm.submit(prompt, GREEDY)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"top_k": -1}, "top_k"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"seed": -5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 1000}, "logprobs"),
        ({"n": 0}, "n"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_invalid_requests(llm):
    with pytest.raises(ValueError, match="grammar"):
        llm.submit("x", SamplingParams(grammar="root ::= ("))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.submit("x", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="token id"):
        llm.submit([1, 10**6], GREEDY)
    with pytest.raises(TypeError, match="bogus"):
        llm.submit("x", {"max_tokens": 3, "bogus": 1})
    assert llm.generate("x", {"max_tokens": 3, "temperature": 0})[0].outputs[0].usage.completion_tokens == 3


def test_prompt_too_long_or_truncated(tiny_path):
    with LLM(tiny_path, n_ctx=256, n_parallel=1, n_batch=32) as small:
        limit = small.n_ctx_seq
        long_prompt = " ".join(testing.english_sentences(40))
        with pytest.raises(PromptTooLong, match=f"per-request context of {limit}"):
            small.submit(long_prompt, SamplingParams(max_tokens=8))
        out = small.generate(long_prompt, SamplingParams(max_tokens=8, temperature=0, truncate=True))[
            0
        ].outputs[0]
        assert out.usage.prompt_tokens == limit - 8 and out.finish_reason == "length"
        with pytest.raises(PromptTooLong):
            small.submit("hi", SamplingParams(max_tokens=limit))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n_parallel": 0}, "n_parallel"),
        ({"n_batch": 0}, "n_batch"),
        ({"max_queue": 0}, "max_queue"),
        ({"chunk_size": -1}, "chunk_size"),
        ({"strategy": "fastest"}, "strategy"),
        ({"n_ctx": 0}, "n_ctx"),
    ],
)
def test_invalid_llm_params(tiny_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(tiny_path, **kwargs)


def test_queue_full_and_backpressure(tiny_path):
    with LLM(tiny_path, n_ctx=1024, n_parallel=1, n_batch=32, max_queue=2) as small:
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        running = small.submit("one", params)
        while small.stats().busy_slots == 0:
            time.sleep(0.001)
        queued = [small.submit("two", params), small.submit("three", params)]
        with pytest.raises(QueueFull, match="max_queue=2"):
            small.submit("four", params)
        # generate() waits for room instead of failing
        outs = firsts(small.generate(["a", "b", "c", "d"], SamplingParams(max_tokens=2, temperature=0)))
        assert len(outs) == 4
        for h in [running, *queued]:
            assert h.result(timeout=60).outputs[0].finish_reason == "length"


# -- faults -------------------------------------------------------------------------------------


def test_kv_pressure_preempts_instead_of_failing(tiny_path):
    events = []
    with LLM(tiny_path, n_ctx=256, n_parallel=4, n_batch=64, kv_unified=True) as small:
        small.add_listener(events.append)
        params = SamplingParams(max_tokens=180, temperature=0, ignore_eos=True)
        outs = firsts(small.generate([f"request number {i}" for i in range(4)], params))
        # every request fits alone, so every one completes: the others wait or are preempted
        assert [o.finish_reason for o in outs] == ["length"] * 4
        assert all(len(o.token_ids) == 180 for o in outs)
        stats = small.stats()
        assert stats.preemptions > 0 and stats.decode_retries > 0
        assert sum(o.timings.preemptions for o in outs) == stats.preemptions
        assert any(isinstance(e, TickEvent) and e.preemptions for e in events)
        _assert_no_kv(small)
        assert (
            small.generate("still alive", SamplingParams(max_tokens=3))[0].outputs[0].finish_reason
            == "length"
        )


def test_decode_error_fails_affected_requests_and_engine_continues(tiny_path):
    with LLM(tiny_path, n_ctx=1024, n_parallel=2, n_batch=64) as small:
        small.context.abort()  # the next llama_decode returns 2 (aborted): a real decode error
        out = small.generate("doomed", SamplingParams(max_tokens=5))[0].outputs[0]
        assert out.finish_reason == "error" and "aborted" in out.error
        assert small.generate("fine", SamplingParams(max_tokens=5))[0].outputs[0].finish_reason == "length"
        _assert_no_kv(small)


def test_listener_and_strategy_exceptions_never_kill_the_engine(tiny_path):
    class Broken:
        def plan(self, view, budget, chunk_size, queue_depth):
            raise RuntimeError("strategy bug")

    def bad_listener(event):
        raise RuntimeError("listener bug")

    with LLM(tiny_path, n_ctx=1024, n_parallel=2, n_batch=64, strategy=Broken()) as small:
        small.add_listener(bad_listener)
        outs = firsts(small.generate(["a", "b"], SamplingParams(max_tokens=4)))
        assert [o.finish_reason for o in outs] == ["length", "length"]


def test_close_with_requests_in_flight_cancels_each_once(tiny_path):
    small = LLM(tiny_path, n_ctx=2048, n_parallel=2, n_batch=64)
    ended = []
    small.add_listener(lambda e: isinstance(e, RequestEvent) and ended.append(e.request_id))
    handles = [small.submit(f"p{i}", SamplingParams(max_tokens=1000, ignore_eos=True)) for i in range(6)]
    time.sleep(0.05)
    small.close()
    outs = [h.result(timeout=10).outputs[0] for h in handles]
    assert {o.finish_reason for o in outs} <= {"cancelled", "length"}
    assert any(o.finish_reason == "cancelled" for o in outs)
    assert sorted(ended) == sorted(o.request_id for o in outs)  # each ended exactly once
    with pytest.raises(EngineClosed):
        small.submit("late", GREEDY)
    small.close()


def test_every_request_ends_exactly_once_under_churn(llm):
    ended: list[int] = []
    listener = lambda e: isinstance(e, RequestEvent) and ended.append(e.request_id)  # noqa: E731
    llm.add_listener(listener)
    try:
        handles = []
        for i in range(40):
            params = SamplingParams(
                max_tokens=1 + i % 7, temperature=0.5, seed=i, stop=["ab"] if i % 3 else ()
            )
            handles.append(llm.submit(_prompt(i), params))
            if i % 5 == 0:
                handles[-1].cancel()
        outs = [h.result(timeout=60).outputs[0] for h in handles]
        _wait_idle(llm)
    finally:
        llm.remove_listener(listener)
    assert sorted(ended) == sorted(o.request_id for o in outs)
    _assert_no_kv(llm)


# -- scheduling, from telemetry ------------------------------------------------------------------


def test_long_prefill_never_stalls_decoding_slots(tiny_path):
    n_batch = 64
    events: list = []
    with LLM(tiny_path, n_ctx=4096, n_parallel=8, n_batch=n_batch, chunk_size=32) as small:
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        decoding = [small.submit(f"d{i}", params) for i in range(7)]
        while small.stats().busy_slots < 7 or small.stats().decode_tokens < 7:
            time.sleep(0.001)
        small.add_listener(events.append)
        long_prompt = small.tokenize(" ".join(testing.english_sentences(200)))[: 4 * n_batch]
        long = small.submit(long_prompt, SamplingParams(max_tokens=2))
        long.result(timeout=60)
        for h in decoding:
            h.cancel()
    ticks = [e for e in events if isinstance(e, TickEvent) and e.prefill_tokens > 0]
    assert sum(e.prefill_tokens for e in ticks) >= 4 * n_batch - 1
    assert len(ticks) >= (4 * n_batch) // 32
    assert all(e.decode_tokens == 7 for e in ticks)  # every decoding slot got its token each tick


@pytest.mark.parametrize("strategy", ["decode_maximal", "prefill_priority", "balanced"])
def test_strategy_shapes_the_batch(tiny_path, strategy):
    n_batch = 16
    events: list = []
    with LLM(
        tiny_path, n_ctx=4096, n_parallel=12, n_batch=n_batch, chunk_size=16, strategy=strategy
    ) as small:
        params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)
        decoding = [small.submit(f"d{i}", params) for i in range(10)]
        while small.stats().decode_tokens < 20:
            time.sleep(0.001)
        small.add_listener(events.append)
        long = small.submit(
            small.tokenize(" ".join(testing.english_sentences(20)))[:100], SamplingParams(max_tokens=1)
        )
        long.result(timeout=60)
        for h in decoding:
            h.cancel()
    mixed = [e for e in events if isinstance(e, TickEvent) and e.prefill_tokens > 0]
    assert mixed and all(e.batch_tokens <= n_batch for e in mixed)
    first = mixed[0]
    if strategy == "decode_maximal":  # all 10 decode tokens first, prefill gets the rest
        assert (first.decode_tokens, first.prefill_tokens) == (10, 6)
    elif strategy == "prefill_priority":  # the chunk first; one token kept so decode never starves
        assert (first.decode_tokens, first.prefill_tokens) == (1, 15)
    else:  # half each; decode capped at 8, prefill 8
        assert (first.decode_tokens, first.prefill_tokens) == (8, 8)


def test_stats_and_request_events(llm):
    events = []
    llm.add_listener(events.append)
    try:
        llm.generate(["s1", "s2"], SamplingParams(max_tokens=6, temperature=0))
    finally:
        llm.remove_listener(events.append)
    requests = [e for e in events if isinstance(e, RequestEvent)]
    assert len(requests) == 2 and all(e.finish_reason == "length" and e.time_to_first_token for e in requests)
    stats = llm.stats()
    assert stats.ticks > 0 and stats.tokens_per_s > 0 and stats.n_parallel == 8
    assert stats.queue_depth == 0


class PrefillWhenQueued:
    """The README's adaptive strategy."""

    def __init__(self) -> None:
        self.seen_queue_depths: set[int] = set()

    def plan(self, view, budget, chunk_size, queue_depth):
        self.seen_queue_depths.add(queue_depth)
        decode = [(slot, 1) for slot in view.decode_slots]
        prefill = [(slot, min(view.n_pending(slot), chunk_size)) for slot in view.prefill_slots]
        plan, left = [], budget
        for slot, n in (prefill + decode) if queue_depth else (decode + prefill):
            if left == 0:
                break
            plan.append((slot, min(n, left)))
            left -= min(n, left)
        return plan


def test_user_strategy_sees_queue_depth(tiny_path):
    strategy = PrefillWhenQueued()
    with LLM(tiny_path, n_ctx=2048, n_parallel=2, n_batch=16, strategy=strategy) as small:
        outs = firsts(
            small.generate([_prompt(i) for i in range(6)], SamplingParams(max_tokens=5, temperature=0))
        )
    assert all(o.finish_reason == "length" and len(o.token_ids) == 5 for o in outs)
    assert 0 in strategy.seen_queue_depths and max(strategy.seen_queue_depths) >= 1
