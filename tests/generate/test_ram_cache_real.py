"""The host-RAM prompt cache and persistent prefixes on real llama.cpp: a restored prefix
gives the log-probabilities a computed one gives; pinned prefixes survive a restart; a
corrupt or mismatched prefix file is refused and the prefix computed."""

from __future__ import annotations

import logging
import shutil

import pytest
from llama_reference import check_against_reference

from llamabatch import LLM, SamplingParams, testing
from llamabatch.generate.prefix_store import SUFFIX, PrefixStore

PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=2)


def _texts(llm: LLM, n: int, n_tokens: int) -> list[list[int]]:
    words = " ".join(testing.english_sentences(300)).split()
    return [llm.tokenize(" ".join(words[41 * i :]))[:n_tokens] for i in range(n)]


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "split"])
def test_restored_prefix_gives_the_computed_logprobs(tiny_path, reference, kv_unified):
    options = dict(n_ctx=2048, n_parallel=2, n_batch=256, flash_attn=False, kv_unified=kv_unified)
    with LLM(tiny_path, cache_ram=64, **options) as llm:
        convs = _texts(llm, 3, 120)
        firsts = [llm.generate(c, PARAMS)[0].outputs[0] for c in convs]  # 3 conversations, 2 slots
        follow = convs[0] + firsts[0].token_ids + llm.tokenize(" And then?", add_special=False)
        out = llm.generate(follow, PARAMS)[0].outputs[0]
        stats = llm.stats()
    assert stats.ram_cache_saves >= 1 and stats.ram_cache_restores == 1, stats
    assert out.usage.reused_tokens >= 120
    assert stats.ram_cache_restored_tokens == out.usage.reused_tokens
    check_against_reference(reference, [*firsts, out])


@pytest.mark.parametrize("flash_attn", [False, True], ids=["v-transposed", "flash"])
def test_restored_conversation_shares_the_system_prompt(tiny_path, reference, flash_attn):
    """Issue 23's chat in small: conversations sharing a system prompt, more than the slots.
    The restored one takes the system prompt from the cells the other slot holds (not its
    own copy: only the state's cells after it are loaded) and gives the computed logprobs."""
    options = dict(n_ctx=2048, n_parallel=2, n_batch=256, flash_attn=flash_attn, kv_unified=True)
    with LLM(tiny_path, cache_ram=64, **options) as llm:
        system = _system(llm)[:100]
        convs = [system + tail[1:41] for tail in _texts(llm, 3, 41)]
        firsts = [llm.generate(c, PARAMS)[0].outputs[0] for c in convs]  # 3 conversations, 2 slots
        follow = convs[0] + firsts[0].token_ids + llm.tokenize(" And then?", add_special=False)
        out = llm.generate(follow, PARAMS)[0].outputs[0]
        stats = llm.stats()
    assert stats.ram_cache_restores == 1 and out.usage.reused_tokens >= 140, stats
    assert stats.ram_cache_shared_tokens >= 100  # the system prompt: shared cells, not a copy
    if not flash_attn:
        check_against_reference(reference, [*firsts, out])
        return
    # flash attention's f16 tiles round by batch shape (3e-3 here before the state was cut)
    with LLM(tiny_path, cache_ram=0, **options) as llm:
        computed = llm.generate(follow, PARAMS)[0].outputs[0]
    for a, b in zip(out.logprobs, computed.logprobs, strict=True):
        for token, value in b.items():
            assert a[token] == pytest.approx(value, abs=0.02)


def test_a_flood_of_one_client_keeps_another_clients_conversation(tiny_path, reference):
    """One client's conversation, then another client's distinct prompts until the 1 MiB tier
    has dropped states for them: the first client's next turn still comes back from RAM (with
    one LRU for everyone, the flood pushed it out), with the computed log-probabilities."""
    options = dict(n_ctx=2048, n_parallel=2, n_batch=256, flash_attn=False, kv_unified=True)
    with LLM(tiny_path, cache_ram=1, **options) as llm:
        convs = _texts(llm, 80, 120)
        first = llm.submit(convs[0], PARAMS, client="b").result().outputs[0]
        for conv in convs[1:]:
            llm.submit(conv, PARAMS, client="flood").result()
            if llm.stats().ram_cache_evictions >= 4:
                break
        flooded = llm.stats()
        follow = convs[0] + first.token_ids + llm.tokenize(" And then?", add_special=False)
        out = llm.submit(follow, PARAMS, client="b").result().outputs[0]
        stats = llm.stats()
    assert flooded.ram_cache_evictions >= 4, flooded  # the flood filled the tier
    assert flooded.ram_cache_clients == 2 and 0 < flooded.ram_cache_largest_client_bytes <= 2**20
    assert stats.ram_cache_restores == flooded.ram_cache_restores + 1
    assert out.usage.reused_tokens >= 120
    check_against_reference(reference, [first, out])


def test_ram_tier_in_metrics(tiny_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from llamabatch.runtime.metrics import PrometheusListener

    metrics = PrometheusListener(prometheus_client.CollectorRegistry())
    with LLM(tiny_path, n_ctx=2048, n_parallel=2, cache_ram=64) as llm:
        metrics.attach(llm, model_name="tiny")
        convs = _texts(llm, 3, 100)
        outs = [llm.generate(c, PARAMS)[0].outputs[0] for c in convs]
        llm.generate(convs[0] + outs[0].token_ids + [5, 6, 7], PARAMS)
        stats = llm.stats()
        text = metrics.generate_latest().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["llamabatch:ram_cache_restores"] == stats.ram_cache_restores == 1
    assert samples["llamabatch:ram_cache_bytes"] == stats.ram_cache_bytes > 0
    assert samples["llamabatch:ram_cache_saves"] == stats.ram_cache_saves >= 1
    assert samples["llamabatch:ram_cache_entries"] == stats.ram_cache_entries >= 1


def _system(llm: LLM) -> list[int]:
    return llm.tokenize(" ".join(testing.english_sentences(40)))[:200]


def _pin_and_generate(path, cache_dir, **options):
    options = {"cache_ram": 0, **options}  # pinned prefixes only (no RAM tier files at close)
    with LLM(
        path,
        n_ctx=2048,
        n_parallel=2,
        kv_unified=True,
        flash_attn=False,
        prefix_cache_dir=str(cache_dir),
        **options,
    ) as llm:
        system = _system(llm)
        handle = llm.register_prefix(system)
        tail = llm.tokenize(" What next?", add_special=False)
        out = llm.generate(system + tail, PARAMS)[0].outputs[0]
        handle.release()
        stats = llm.stats()
    return out, stats


def test_pinned_prefix_survives_a_restart(tiny_path, reference, tmp_path):
    first, stats = _pin_and_generate(tiny_path, tmp_path)
    assert (stats.prefix_files_saved, stats.prefix_files_loaded) == (1, 0)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    assert not list(tmp_path.glob(".tmp-*"))  # written atomically, nothing left over
    again, stats = _pin_and_generate(tiny_path, tmp_path)  # a new engine: loaded, not computed
    assert (stats.prefix_files_saved, stats.prefix_files_loaded, stats.prefix_files_refused) == (0, 1, 0)
    assert stats.prefill_tokens < 20  # only the tail and the generated tokens were computed
    assert again.usage.reused_tokens >= 199
    check_against_reference(reference, [first, again])


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_a_corrupt_prefix_file_is_refused_and_recomputed(tiny_path, reference, tmp_path, caplog, damage):
    _pin_and_generate(tiny_path, tmp_path)
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"\x00" * len(data))
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="llamabatch"):
        out, stats = _pin_and_generate(tiny_path, tmp_path)
    assert (stats.prefix_files_refused, stats.prefix_files_loaded, stats.prefix_files_saved) == (1, 0, 1)
    assert "refused" in caplog.text
    check_against_reference(reference, [out])
    _, stats = _pin_and_generate(tiny_path, tmp_path)  # rewritten by the recompute: good again
    assert stats.prefix_files_loaded == 1


def test_another_models_file_is_refused(tiny_path, tmp_path):
    small = testing.model_path("small")
    _pin_and_generate(tiny_path, tmp_path)
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    # put tiny's file where small's store looks for the same tokens
    with LLM(small, n_ctx=2048, n_parallel=2, kv_unified=True, flash_attn=False) as llm:
        system = _system(llm)
    store = PrefixStore(tmp_path, small, "unused")
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    options = dict(
        n_ctx=2048,
        n_parallel=2,
        kv_unified=True,
        flash_attn=False,
        cache_ram=0,
        prefix_cache_dir=str(other_dir),
    )
    with LLM(small, **options) as llm:
        target = llm.core.kv.store.path_for(system)
        shutil.copy(path, target)
        llm.register_prefix(system).release()
        stats = llm.stats()
    assert store.model_id != PrefixStore(tmp_path, tiny_path, "unused").model_id
    assert (stats.prefix_files_refused, stats.prefix_files_loaded, stats.prefix_files_saved) == (1, 0, 1)


def _three_conversations_then_close(path, options):
    """3 conversations over 2 slots in an engine that persists its RAM tier at close: the
    conversations and the first one's reply."""
    with LLM(path, **options) as llm:
        convs = _texts(llm, 3, 120)
        first = llm.generate(convs[0], PARAMS)[0].outputs[0]
        for c in convs[1:]:
            llm.generate(c, PARAMS)
    return convs, first


def _follow_up_after_restart(path, options, convs, first):
    """A new engine continues the first conversation: its reply and the engine's stats."""
    with LLM(path, **options) as llm:
        follow = convs[0] + first.token_ids + llm.tokenize(" And then?", add_special=False)
        return llm.generate(follow, PARAMS)[0].outputs[0], llm.stats()


def test_ram_tier_survives_a_restart(tiny_path, reference, tmp_path):
    options = dict(n_ctx=2048, n_parallel=2, flash_attn=False, cache_ram=64, prefix_cache_dir=str(tmp_path))
    convs, first = _three_conversations_then_close(tiny_path, options)
    # at close the RAM tier (and the idle slots' tokens) went to files
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) >= 2
    out, stats = _follow_up_after_restart(tiny_path, options, convs, first)
    assert (stats.prefix_files_loaded, stats.ram_cache_restores, stats.prefix_files_refused) == (1, 1, 0)
    assert out.usage.reused_tokens >= 120
    check_against_reference(reference, [first, out])


def test_a_corrupt_ram_tier_file_is_refused_and_recomputed(tiny_path, reference, tmp_path):
    options = dict(n_ctx=2048, n_parallel=2, flash_attn=False, cache_ram=64, prefix_cache_dir=str(tmp_path))
    convs, first = _three_conversations_then_close(tiny_path, options)
    for path in tmp_path.glob(f"*{SUFFIX}"):  # the headers stay, the payloads rot
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    out, stats = _follow_up_after_restart(tiny_path, options, convs, first)
    assert (stats.prefix_files_refused, stats.prefix_files_loaded, stats.ram_cache_restores) == (1, 0, 0)
    check_against_reference(reference, [out])


def _room_case(path, cache_ram: int) -> tuple[list, object]:
    """The issue's case at a quarter of its size: a 375-token prompt, four 750-token prompts one
    after another, then the first prompt plus two tokens (``n_ctx=1024``, 2 slots: the last
    750-token prefix, idle and sharing only the BOS token, holds the room the state needs)."""
    with LLM(path, n_ctx=1024, n_parallel=2, n_batch=512, flash_attn=False, cache_ram=cache_ram) as llm:
        texts = _texts(llm, 6, 750)
        first = texts[0][:375]
        outs = [llm.generate(first, PARAMS)[0].outputs[0]]
        for text in texts[1:5]:
            llm.generate(text, PARAMS)
        outs.append(llm.generate(first + texts[5][1:3], PARAMS)[0].outputs[0])
        return outs, llm.stats()


def test_idle_prefixes_make_room_for_a_restore(tiny_path, reference):
    outs, stats = _room_case(tiny_path, cache_ram=64)
    assert stats.ram_cache_restores == 1 and stats.ram_cache_restore_skipped == {}, stats
    assert outs[-1].usage.reused_tokens == 375
    plain, _ = _room_case(tiny_path, cache_ram=0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    check_against_reference(reference, outs)


def test_restore_waits_for_a_running_request(tiny_path, reference):
    """The room a saved state needs is held by a request running its last tokens: the next
    prompt matching the state waits for it, then restores instead of computing."""
    from llamabatch import LLMEngine

    options = dict(n_ctx=1024, n_parallel=2, n_batch=512, flash_attn=False, kv_unified=True, cache_ram=64)
    with LLMEngine(tiny_path, **options) as engine:
        texts = [engine.tokenize(" ".join(testing.english_sentences(300)[5 * i :]))[:700] for i in range(3)]
        for tokens in (texts[0][:420], texts[1]):  # the second evicts (saves) the first
            engine.add_request(tokens, PARAMS)
            engine.run_until_complete()
        engine.add_request(texts[2][:620], SamplingParams(max_tokens=6, temperature=0))
        while not any(out.new_token_ids for out in engine.step()):
            pass
        later = texts[0][:300] + texts[1][1:21]
        engine.add_request(later, PARAMS)
        outs = [o for o in engine.run_until_complete() if o.prompt_token_ids == later]
        stats = engine.stats()
    assert (stats.ram_cache_restores, stats.ram_cache_restore_waits) == (1, 1), stats
    assert stats.ram_cache_restore_skipped == {}
    assert outs[0].usage.reused_tokens == 300
    check_against_reference(reference, outs)
