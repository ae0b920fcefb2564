"""llama-server's other samplers through the real llama.cpp: DRY, XTC, top-n-sigma and mirostat,
and the prompt that the penalties and DRY see (as llama-server feeds it to its sampler)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import loop_model, loop_prompts, model_path
from llamabatch.testing import real_model_path

GREEDY = {"temperature": 0, "max_tokens": 24}


def longest_repeat(tokens: list[int], start: int) -> int:
    """The longest run of tokens ending at or after ``start`` that also occurs earlier."""
    best = 0
    for end in range(start + 1, len(tokens) + 1):
        for n in range(end - 1, best, -1):
            pattern = tokens[end - n : end]
            if any(tokens[i : i + n] == pattern for i in range(end - n)):
                best = n
                break
    return best


@pytest.fixture(scope="module")
def looping() -> Iterator[tuple[LLM, list[int]]]:
    """The loop model (greedy walks a cycle of tokens) and a prompt holding its cycle."""
    path = loop_model("tiny")
    with LLM(path, n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        yield llm, loop_prompts(path, 1, 24)[0]


def _run(llm: LLM, prompt: list[int], **fields) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**fields), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_dry_stops_the_loop_from_its_prompt_on(looping):
    llm, prompt = looping
    plain = _run(llm, prompt, **GREEDY)
    assert longest_repeat(prompt + plain, len(prompt)) >= len(plain)  # it walks the prompt's cycle
    dry = _run(llm, prompt, **GREEDY, dry_multiplier=5.0, dry_sequence_breakers=[])
    assert longest_repeat(prompt + dry, len(prompt)) <= 3  # dry_allowed_length 2, then penalised
    # DRY sees the prompt, as llama-server's does: the first token already breaks the cycle
    assert dry[0] != plain[0]


def test_dry_windows_and_breakers(looping):
    llm, prompt = looping
    plain = _run(llm, prompt, **GREEDY)
    # a window of one token holds no repeat to extend
    assert _run(llm, prompt, **GREEDY, dry_multiplier=5.0, dry_penalty_last_n=1) == plain
    longer = _run(llm, prompt, **GREEDY, dry_multiplier=5.0, dry_allowed_length=8, dry_sequence_breakers=[])
    assert 3 < longest_repeat(prompt + longer, len(prompt)) <= 9


def test_repeat_penalty_sees_the_prompt(looping):
    """As llama-server (and llama-cpp-python): the penalties' window holds the prompt's last
    tokens, so a first token already in the prompt is penalised."""
    llm, prompt = looping
    plain = _run(llm, prompt, **GREEDY)
    assert plain[0] in prompt
    assert _run(llm, prompt, **GREEDY, repeat_penalty=2.0)[0] != plain[0]
    assert _run(llm, prompt, **GREEDY, presence_penalty=2.0)[0] != plain[0]


@pytest.fixture(scope="module")
def smollm() -> Iterator[LLM]:
    with LLM(real_model_path(), n_ctx=2048, n_parallel=4, n_threads=2) as llm:
        yield llm


CHAT = [{"role": "user", "content": "Name three fruits."}]


def _chat(llm: LLM, **fields) -> list[int]:
    (result,) = llm.chat(CHAT, SamplingParams(max_tokens=16, **fields), use_tqdm=False)
    return list(result.outputs[0].token_ids)


def test_top_n_sigma_and_a_tiny_mirostat_target_are_greedy(smollm):
    greedy = _chat(smollm, temperature=0)
    assert _chat(smollm, temperature=1.5, top_n_sigma=1e-6, seed=1) == greedy  # only the best logit left
    for version in (1, 2):  # a target surprise of ~0 keeps only the likeliest token
        assert _chat(smollm, temperature=1.0, mirostat=version, mirostat_tau=1e-3, seed=2) == greedy


def test_mirostat_is_seeded_and_replaces_the_draw(smollm):
    params = {"temperature": 1.0, "mirostat": 2, "mirostat_tau": 8.0, "seed": 5}
    assert _chat(smollm, **params) == _chat(smollm, **params)
    assert SamplingParams(**params).active_stages == ("temperature", "mirostat")
    assert SamplingParams(mirostat=1, temperature=0).active_stages == ("greedy",)


def test_xtc_excludes_the_top_choices(smollm):
    """With probability 1, every token at least ``xtc_threshold`` likely except the least likely
    of them is removed: a sampled token is never the raw best one while a second one is that
    likely (no truncation before XTC here)."""
    fields = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "logprobs": 2}
    seen = 0
    for seed in range(4):
        params = SamplingParams(max_tokens=12, seed=seed, xtc_probability=1.0, xtc_threshold=0.05, **fields)
        out = smollm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
        for token, top in zip(out.token_ids, out.logprobs, strict=True):
            (best, _), (_, second) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
            if second >= -2.995:  # p >= 0.05 (log 0.05 = -2.996)
                assert token != best
                seen += 1
    assert seen > 0


def test_samplers_keep_outputs_under_speculation():
    """Requests with these samplers are verified by the match rule: the same seeded tokens
    with n-gram drafts as without."""
    prompt = "one two three four five, one two three four five, one two three four five,"
    fields = {"temperature": 0.9, "seed": 3, "max_tokens": 24, "dry_multiplier": 0.5, "xtc_probability": 0.5}
    outs = []
    for spec in (None, {"method": "ngram"}):
        with LLM(model_path("tiny"), n_threads=1, speculative_config=spec) as llm:
            (result,) = llm.generate(prompt, SamplingParams(**fields), use_tqdm=False)
            outs.append(result.outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_allowed_token_ids_are_all_that_is_sampled(looping):
    llm, prompt = looping
    allowed = [5, 9, 11, 300]
    for fields in (GREEDY, {"temperature": 1.5, "top_k": 0, "seed": 4, "max_tokens": 24}):
        out = _run(llm, prompt, **fields, allowed_token_ids=allowed)
        assert len(out) == 24 and set(out) <= set(allowed)
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids: token id 10000000 >= n_vocab"):
        _run(llm, prompt, **GREEDY, allowed_token_ids=[1, 10**7])


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"dry_multiplier": -1.0}, "dry_multiplier"),
        ({"dry_base": 0.5}, "dry_base"),
        ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
        ({"dry_sequence_breakers": ["x"] * 17}, "dry_sequence_breakers"),
        ({"dry_sequence_breakers": ["x" * 41]}, r"dry_sequence_breakers\[0\]"),
        ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
        ({"xtc_probability": 1.5}, "xtc_probability"),
        ({"mirostat": 3}, "mirostat"),
        ({"mirostat_eta": float("nan")}, "mirostat_eta"),
        ({"top_n_sigma": -2.0}, "top_n_sigma"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ],
)
def test_bad_values_name_their_field(fields, name):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}"):
        SamplingParams(**fields)
