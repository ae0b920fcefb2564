"""Prefix reuse across slots, pinned prefixes and parallel sampling (llama_memory_seq_cp)."""

from __future__ import annotations

import logging

import pytest
from llama_reference import check_against_reference

from llamabatch import LLM, SamplingParams, testing

SYSTEM = " ".join(testing.english_sentences(30))


def completions(outs):
    """Every completion of every prompt's ``RequestOutput``, in order."""
    return [c for o in outs for c in o.outputs]


def _prompts(llm: LLM, n: int, system_tokens: int = 200) -> list[list[int]]:
    system = llm.tokenize(SYSTEM)[:system_tokens]
    tails = testing.english_sentences(100)
    return [system + llm.tokenize(f" {tails[i]}", add_special=False)[:12] for i in range(n)]


@pytest.mark.parametrize(
    ("prefix_cache", "kv_unified"),
    [(True, True), (False, True), (True, False)],
    ids=["on", "off", "on-split-kv"],
)
def test_reuse_never_changes_outputs(tiny_path, reference, prefix_cache, kv_unified):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    kwargs = {"prefix_cache": prefix_cache, "kv_unified": kv_unified}
    with LLM(tiny_path, n_ctx=4096, n_parallel=4, n_batch=128, flash_attn=False, **kwargs) as llm:
        prompts = _prompts(llm, 10)
        together = completions(llm.generate(prompts[:6], params))  # arriving together
        one_by_one = [llm.generate(p, params)[0].outputs[0] for p in prompts[6:]]  # reuse idle slots
        stats = llm.stats()
    outs = together + one_by_one
    check_against_reference(reference, outs)
    reused = sum(o.usage.reused_tokens for o in outs)
    computed = sum(o.usage.prompt_tokens for o in outs) - reused
    assert stats.reused_tokens == reused
    assert stats.prefill_tokens == computed
    if prefix_cache:
        assert reused >= 9 * 190  # every request after the first reuses the system prompt
    else:
        assert reused == 0


def test_prefix_is_computed_once_for_requests_arriving_together(tiny_path):
    with LLM(tiny_path, n_ctx=8192, n_parallel=8, n_batch=256) as llm:
        prompts = _prompts(llm, 16, system_tokens=400)
        outs = completions(llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0)))
        stats = llm.stats()
    assert sum(o.usage.reused_tokens > 0 for o in outs) == 15
    assert stats.prefill_tokens < 400 + 16 * 14


def test_eviction_under_kv_pressure_never_corrupts_live_sequences(tiny_path, reference):
    params = SamplingParams(max_tokens=100, temperature=0, logprobs=1, ignore_eos=True)
    with LLM(tiny_path, n_ctx=512, n_parallel=4, n_batch=64, flash_attn=False, kv_unified=True) as llm:
        # Idle slots cache 4 x 110 unrelated tokens; two requests of 100 + 100 tokens then
        # need room that only evicting those caches gives.
        llm.generate(
            [llm.tokenize(f"warm {i} " + SYSTEM)[:110] for i in range(4)], SamplingParams(max_tokens=1)
        )
        assert llm.stats().cached_prefix_tokens >= 4 * 100
        prompts = _prompts(llm, 2, system_tokens=88)
        outs = completions(llm.generate(prompts, params))
        assert [o.finish_reason for o in outs] == ["length"] * 2
        assert llm.stats().evictions > 0  # cached prefixes made room
        assert llm.stats().finish_reasons.get("error", 0) == 0
    check_against_reference(reference, outs)


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified-kv", "split-kv"])
def test_pinned_prefix(tiny_path, reference, kv_unified):
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    kwargs = {"flash_attn": False, "max_prefixes": 1, "kv_unified": kv_unified}
    with LLM(tiny_path, n_ctx=4096, n_parallel=2, n_batch=128, **kwargs) as llm:
        handle = llm.register_prefix(SYSTEM[:600])
        n_pinned = len(handle.tokens)
        llm.clear_prefix_cache()  # only the pinned copy remains
        assert llm.stats().pinned_prefixes == 1 and llm.stats().cached_prefix_tokens == 0
        with pytest.raises(ValueError, match="max_prefixes"):
            llm.register_prefix(SYSTEM[:300])
        out = llm.generate(SYSTEM[:600] + " and then a question?", params)[0].outputs[0]
        assert out.usage.reused_tokens >= n_pinned - 2
        handle.release()
        handle.release()
        llm.clear_prefix_cache()
        assert all(llm.context.seq_pos_max(s) == -1 for s in range(llm.context.n_seq_max))
        again = llm.register_prefix(SYSTEM[:300])  # the sequence is free again
        again.release()
    check_against_reference(reference, [out])


def test_parallel_sampling_prefills_once(tiny_path):
    prompt = " ".join(testing.english_sentences(5))
    for prefix_cache, kv_unified in ((True, True), (False, True), (True, False)):
        kwargs = {"prefix_cache": prefix_cache, "kv_unified": kv_unified}
        with LLM(tiny_path, n_ctx=4096, n_parallel=4, n_batch=256, **kwargs) as llm:
            n_prompt = len(llm.tokenize(prompt, parse_special=True))
            params = SamplingParams(
                max_tokens=12, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=7, n=4
            )
            outs = completions(llm.generate([prompt], params))
            stats = llm.stats()
        assert [o.index for o in outs] == [0, 1, 2, 3]
        assert len({tuple(o.token_ids) for o in outs}) > 1  # independent samplers
        assert [o.usage.reused_tokens for o in outs][1:] == [n_prompt - 1] * 3
        assert stats.prefill_tokens == n_prompt + 3  # prompt once, then one token each


def test_handle_results_for_n(tiny_path):
    with LLM(tiny_path, n_ctx=2048, n_parallel=2, n_batch=64) as llm:
        handle = llm.submit("hi there", SamplingParams(max_tokens=3, n=3, seed=1))
        outs = handle.result(timeout=60).outputs
        assert len(outs) == 3 and all(o.finish_reason == "length" for o in outs)
        assert [o.index for o in outs] == [0, 1, 2]
        assert len({o.request_id for o in outs}) == 1


def test_reuse_switches_itself_off_where_unsupported(tiny_path, caplog, monkeypatch):
    import llamabatch.generate.llm_engine

    class RecurrentModel(llamabatch.generate.llm_engine.Model):
        """A model reporting recurrent memory, whose KV cannot be copied in part."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.is_recurrent = True

    monkeypatch.setattr(llamabatch.generate.llm_engine, "Model", RecurrentModel)
    with caplog.at_level(logging.WARNING, logger="llamabatch"):
        llm = LLM(tiny_path, n_ctx=2048, n_parallel=2, n_batch=64)
    with llm:
        assert any("prefix reuse switched off" in r.message for r in caplog.records)
        assert llm.stats().prefix_cache is False
        outs = completions(
            llm.generate(["same prompt here", "same prompt here"], SamplingParams(max_tokens=4, n=2))
        )
        assert all(o.finish_reason == "length" and o.usage.reused_tokens == 0 for o in outs)
        with pytest.raises(ValueError, match="prefix reuse is off"):
            llm.register_prefix("a system prompt")


def test_prefix_benchmark_workloads_run(tiny_path):
    from llamabatch.bench.prefix import multi_turn_chat, shared_system_prompt

    small = {"n_requests": 4, "system_tokens": 64, "unique_tokens": 8, "new_tokens": 4, "n_parallel": 2}
    off = shared_system_prompt(str(tiny_path), prefix_cache=False, **small)
    on = shared_system_prompt(str(tiny_path), prefix_cache=True, **small)
    assert off.prompt_tokens == on.prompt_tokens == 4 * 72
    assert off.prefill_tokens == 4 * 72 and on.prefill_tokens < 72 + 4 * 9
    chat = {"n_conversations": 2, "n_turns": 3, "system_tokens": 32, "user_tokens": 8, "reply_tokens": 4}
    chat_off = multi_turn_chat(str(tiny_path), prefix_cache=False, **chat)
    chat_on = multi_turn_chat(str(tiny_path), prefix_cache=True, **chat)
    assert chat_on.prompt_tokens == chat_off.prompt_tokens == chat_off.prefill_tokens
    assert chat_on.prefill_tokens < 0.5 * chat_off.prefill_tokens


def test_bench_prefix_cli_runs(capsys, monkeypatch):
    import llamabatch.bench.prefix as prefix
    from llamabatch.cli import main

    small_shared = prefix.shared_system_prompt
    small_chat = prefix.multi_turn_chat

    def shared(path, **kwargs):
        return small_shared(path, n_requests=4, system_tokens=48, unique_tokens=4, new_tokens=2, **kwargs)

    def chat(path, **kwargs):
        return small_chat(path, n_conversations=2, n_turns=2, system_tokens=16, user_tokens=4, **kwargs)

    monkeypatch.setattr(prefix, "shared_system_prompt", shared)
    monkeypatch.setattr(prefix, "multi_turn_chat", chat)
    assert main(["bench-prefix", "-m", "tiny", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "shorter" in out and "of the no-reuse run" in out
