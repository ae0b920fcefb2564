"""``LLMEngine``: the engine core on the caller's own loop, and its parity with ``LLM``."""

from __future__ import annotations

import pytest

from llamabatch import LLM, EngineClosed, LLMEngine, QueueFull, SamplingParams, StepOutput, testing

OPTIONS = {"n_ctx": 4096, "n_parallel": 4, "n_batch": 64, "chunk_size": 32, "n_threads": 2}


def _mixed_requests(n: int = 16) -> list[tuple[str, SamplingParams]]:
    sentences = testing.english_sentences(64)
    return [
        (
            " ".join(sentences[i : i + 1 + i % 5]),  # 1 to 5 sentences: short and long prompts
            SamplingParams(max_tokens=4 + 3 * (i % 6), temperature=0, ignore_eos=True),
        )
        for i in range(n)
    ]


def test_engine_and_llm_give_identical_greedy_tokens(tiny_path):
    requests = _mixed_requests()
    with LLMEngine(tiny_path, **OPTIONS) as engine:
        for prompt, params in requests:
            engine.add_request(prompt, params)
        ours = engine.run_until_complete()
        engine_ticks = engine.stats().ticks
    with LLM(tiny_path, **OPTIONS) as llm:
        outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
        llm_ticks = llm.stats().ticks
    theirs = [o.outputs[0] for o in outs]
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert [len(o.token_ids) for o in ours] == [sp.max_tokens for _, sp in requests]
    assert engine_ticks == llm_ticks  # the same ticks, the same batches


def test_step_outputs_add_up_to_the_final_output(tiny_path):
    with LLMEngine(tiny_path, **OPTIONS) as engine:
        a = engine.add_request("the first prompt", SamplingParams(max_tokens=6, temperature=0, logprobs=2))
        b = engine.add_request([1, 5, 9, 13], {"max_tokens": 3, "temperature": 0}, request_id="mine")
        assert b == "mine"
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("again", request_id="mine")
        seen: dict[object, list[StepOutput]] = {a: [], b: []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out)
        for rid, n in ((a, 6), (b, 3)):
            steps = seen[rid]
            final = steps[-1]
            assert final.finished and final.finish_reason == "length" and final.output is not None
            assert sum(not s.finished for s in steps) == n  # one step output per generated token
            assert "".join(s.text for s in steps) == final.output.text
            assert [t for s in steps for t in s.new_token_ids] == final.output.token_ids
        logprobs = [s.logprobs[0] for s in seen[a] if s.new_token_ids]
        assert logprobs == seen[a][-1].output.logprobs
        assert engine.run_until_complete() == []  # step() already reported both


def test_abort_and_run_until_complete_order(tiny_path):
    with LLMEngine(tiny_path, **OPTIONS) as engine:
        ids = [
            engine.add_request(f"prompt {i}", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
            for i in range(3)
        ]
        pair = engine.add_request("twice", SamplingParams(max_tokens=2, n=2, seed=3))
        engine.step()
        engine.abort_request(ids[1])
        engine.abort_request("unknown id")  # ignored
        outs = engine.run_until_complete()
        assert [o.request_id for o in outs] == [ids[0], ids[1], ids[2], pair, pair]
        assert [o.index for o in outs] == [0, 0, 0, 0, 1]
        assert [o.finish_reason for o in outs] == ["length", "cancelled", "length", "length", "length"]
        assert engine.stats().finish_reasons == {"length": 4, "cancelled": 1}
        table = engine.core.table
        assert table.busy_slots == 0 and not engine.has_unfinished_requests()


def test_queue_limit_and_close(tiny_path):
    engine = LLMEngine(tiny_path, max_queue=2, **OPTIONS)
    engine.add_request("a")
    engine.add_request("b")
    with pytest.raises(QueueFull):
        engine.add_request("c")
    with pytest.raises(QueueFull):  # n > max_queue is refused before any sampler is built
        LLMEngine.add_request(engine, "x", SamplingParams(n=128))
    engine.close()
    engine.close()
    with pytest.raises(EngineClosed):
        engine.add_request("late")
    with pytest.raises(EngineClosed):
        engine.stats()
