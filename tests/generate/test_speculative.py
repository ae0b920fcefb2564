"""Speculative decoding (``speculative_config``, n-gram method) on real llama.cpp.

Greedy outputs with speculation are checked against a teacher-forced reference
(log-probabilities within float noise, as the other fidelity tests); stops, limits,
grammars, penalties and seeds see exactly the tokens of a run without speculation.
"""

from __future__ import annotations

import argparse
import random

import pytest
from llama_reference import check_against_reference

from llamabatch import LLM, EngineConfig, SamplingParams
from llamabatch._core.slots import MAX_DRAFT
from llamabatch.generate import speculative
from llamabatch.generate.spec_config import MAX_SPECULATIVE_TOKENS, validate_speculative_config
from llamabatch.generate.spec_policy import SpecPolicy
from llamabatch.generate.speculative import DraftJob, NgramDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "one two three one two three one two",
    "hello world",
    "a b c d e f a b c d e f a b c",
]


@pytest.fixture(autouse=True)
def always_draft(monkeypatch):
    """These tests check what verification does with drafts: drafting must happen whatever
    this machine's timings say it is worth (margin -1: any draft beats none; no bound on
    what drafts cost)."""
    monkeypatch.setattr(speculative, "SpecPolicy", lambda: SpecPolicy(margin=-1.0, loss_share=None))


def _llm(path, spec=NGRAM, **kw):
    kw.setdefault("n_ctx", 2048)
    kw.setdefault("n_parallel", 4)
    return LLM(path, speculative_config=spec, flash_attn=False, **kw)


def _completions(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"method": "ngram", "bogus": 1}, "bogus"),
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"method": "ngram", "model": "x.gguf"}, "model"),
        ({"method": "draft_model"}, "model"),
        ({"method": "draft_model", "model": "d.gguf", "prompt_lookup_min": 2}, "prompt_lookup_min"),
        ({"method": "suffix", "prompt_lookup_max": 4}, "prompt_lookup_max"),
        ({"method": "suffix", "suffix_cache_tokens": 10}, "suffix_cache_tokens"),
        ({"method": "suffix", "suffix_cache_tokens": 1.5}, "suffix_cache_tokens"),
        ({"method": "ngram", "suffix_cache_tokens": 1000}, "suffix_cache_tokens"),
        ("ngram", "dict"),
    ],
)
def test_bad_speculative_config_is_a_value_error_naming_it(config, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=config)


def test_speculative_config_is_completed_with_defaults():
    assert MAX_SPECULATIVE_TOKENS == MAX_DRAFT
    # n-gram lengths are the policy's: the default is only the cap; the match is unbounded
    assert validate_speculative_config({"method": "ngram"}) == {
        "method": "ngram",
        "num_speculative_tokens": 64,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": None,
        "grammar_drafts": True,
    }
    assert validate_speculative_config({"method": "suffix", "num_speculative_tokens": 16}) == {
        "method": "suffix",
        "num_speculative_tokens": 16,
        "prompt_lookup_min": 2,
        "suffix_cache_tokens": 65536,
        "grammar_drafts": True,
    }
    assert EngineConfig().speculative_config is None
    config = EngineConfig(speculative_config={"method": "draft_model", "model": "d.gguf"})
    assert config.speculative_config == {
        "method": "draft_model",
        "num_speculative_tokens": 5,
        "model": "d.gguf",
    }


def test_cli_flags_make_the_speculative_config():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--spec-type", "ngram", "--draft-max", "3"])
    config = EngineConfig.from_cli_args(args)
    assert config.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": None,
        "grammar_drafts": True,
    }
    again = EngineConfig.from_cli_args(parser.parse_args(config.to_cli_args()))
    assert again.speculative_config == config.speculative_config
    suffix = EngineConfig.from_cli_args(parser.parse_args(["--spec-type", "suffix"]))
    assert suffix.speculative_config is not None and suffix.speculative_config["method"] == "suffix"
    again = EngineConfig.from_cli_args(parser.parse_args(suffix.to_cli_args()))
    assert again.speculative_config == suffix.speculative_config
    args = parser.parse_args(["--model-draft", "d.gguf", "--draft-max", "4"])
    assert EngineConfig.from_cli_args(args).speculative_config == {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "model": "d.gguf",
    }
    assert EngineConfig.from_cli_args(parser.parse_args([])).speculative_config is None
    with pytest.raises(ValueError, match="--model-draft"):
        EngineConfig.from_cli_args(parser.parse_args(["--spec-type", "draft"]))


def test_sampling_params_speculative_is_checked():
    assert SamplingParams().speculative is True
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")  # type: ignore[arg-type]


# -- n-gram lookup ------------------------------------------------------------------------


def _brute_force(hist: list[int], lo: int, hi: int, k: int) -> list[int]:
    end = len(hist)
    for n in range(hi, lo - 1, -1):
        if end < n:
            continue
        suffix = hist[end - n :]
        for e in range(end - 1, n - 1, -1):  # latest earlier occurrence, ending before the last token
            if hist[e - n : e] == suffix:
                period = end - e  # past the end, the continuation repeats hist[e:]
                return [hist[e + j % period] for j in range(k)]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_incremental_ngram_index_equals_a_full_rescan(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 5)
    drafter = NgramDrafter(lo, hi)
    prompt = [rng.randrange(6) for _ in range(rng.randint(1, 30))]
    output: list[int] = []
    for _ in range(60):
        k = rng.randint(1, 8)
        got = drafter.draft([DraftJob("r", prompt, output, k, SamplingParams())])
        want = _brute_force(prompt + output, lo, hi, k)
        assert (got["r"].tokens if "r" in got else []) == want
        output.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))
    drafter.release("r")
    assert not drafter._index


# -- verification against the reference ----------------------------------------------------


@pytest.mark.parametrize(("kv_unified", "prefix_cache"), [(True, True), (False, False), (False, True)])
def test_greedy_speculation_matches_the_reference(tiny_path, reference, kv_unified, prefix_cache):
    params = SamplingParams(max_tokens=96, temperature=0, logprobs=2)
    with _llm(tiny_path, kv_unified=kv_unified, prefix_cache=prefix_cache) as llm:
        outs = _completions(llm, PROMPTS + PROMPTS[:2], params)  # repeats: prefix reuse
        stats = llm.stats()
    check_against_reference(reference, outs, top_n=2)
    drafted = sum(o.timings.spec_draft_tokens for o in outs)
    accepted = sum(o.timings.spec_accepted_tokens for o in outs)
    assert 0 < accepted <= drafted
    assert all(o.finish_reason == "length" and len(o.token_ids) == 96 for o in outs)
    assert stats.spec_draft_tokens == drafted
    assert stats.spec_accepted_tokens == accepted


def test_speculation_off_and_opt_out_draft_nothing(tiny_path):
    params = SamplingParams(max_tokens=64, temperature=0)
    with _llm(tiny_path) as llm:
        on = _completions(llm, PROMPTS, params)
        opted = _completions(llm, PROMPTS, SamplingParams(max_tokens=64, temperature=0, speculative=False))
    with _llm(tiny_path, spec=None) as llm:
        off = _completions(llm, PROMPTS, params)
    assert sum(o.timings.spec_accepted_tokens for o in on) > 0
    assert all(o.timings.spec_draft_tokens == 0 for o in opted + off)
    assert [o.token_ids for o in on] == [o.token_ids for o in off] == [o.token_ids for o in opted]


def test_stops_and_limits_inside_accepted_runs_truncate_them(tiny_path):
    base = SamplingParams(max_tokens=96, temperature=0, logprobs=0)
    with _llm(tiny_path, spec=None) as llm:
        plain = _completions(llm, PROMPTS, base)
    cases = []
    for i, out in enumerate(plain):
        for j in (5, 17, 33, 50, 71):
            cases.append((i, SamplingParams(max_tokens=j, temperature=0, logprobs=0)))
            cases.append((i, SamplingParams(max_tokens=96, temperature=0, stop_token_ids=[out.token_ids[j]])))
            text = out.text
            if len(text) > 40:
                cases.append(
                    (i, SamplingParams(max_tokens=96, temperature=0, stop=[text[j % 30 + 5 : j % 30 + 8]]))
                )
    with _llm(tiny_path) as llm:
        with_spec = [_completions(llm, [PROMPTS[i]], p)[0] for i, p in cases]
    with _llm(tiny_path, spec=None) as llm:
        without = [_completions(llm, [PROMPTS[i]], p)[0] for i, p in cases]
    assert sum(o.timings.spec_accepted_tokens for o in with_spec) > 0
    for a, b in zip(with_spec, without, strict=True):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
        assert a.logprobs is None or len(a.logprobs) == len(a.token_ids)


def test_a_run_that_fills_the_context(tiny_path):
    outs = {}
    for spec in (NGRAM, None):
        with _llm(tiny_path, spec=spec, n_ctx=256, n_parallel=1, kv_unified=False) as llm:
            limit = 256 - len(llm.tokenize(PROMPTS[1]))
            params = SamplingParams(max_tokens=limit, temperature=0)
            outs[spec is None] = _completions(llm, [PROMPTS[1]], params)[0]
    assert outs[False].finish_reason == outs[True].finish_reason == "length"
    assert outs[False].token_ids == outs[True].token_ids
    assert outs[False].timings.spec_accepted_tokens > 0


def test_sampled_penalised_and_grammar_requests_match_a_run_without_speculation(tiny_path):
    grammar = 'root ::= ("ab " | "cd " | "ab cd ")+'
    params = [
        SamplingParams(max_tokens=80, temperature=0.7, seed=11, repeat_penalty=1.1),
        SamplingParams(max_tokens=80, temperature=0.9, seed=12, top_k=5, logprobs=1),
        SamplingParams(max_tokens=80, temperature=0, presence_penalty=0.3, frequency_penalty=0.2),
        SamplingParams(max_tokens=40, temperature=0, grammar=grammar),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, grammar=grammar, min_tokens=10),
        SamplingParams(max_tokens=60, temperature=0, logit_bias={5: 2.0}),
    ]
    runs = []
    for spec in (NGRAM, NGRAM, None):
        with _llm(tiny_path, spec=spec) as llm:
            runs.append([_completions(llm, [prompt], p)[0] for prompt in PROMPTS for p in params])
    a, b, c = runs
    for x, y, z in zip(a, b, c, strict=True):
        assert x.token_ids == y.token_ids == z.token_ids  # reproducible, and as without speculation
        assert x.text == z.text
    assert sum(o.timings.spec_accepted_tokens for o in a) > 0


def test_streaming_with_speculation_delivers_every_token_once(tiny_path):
    params = SamplingParams(max_tokens=64, temperature=0)
    with _llm(tiny_path) as llm:
        deltas = list(llm.stream(PROMPTS[1], params))
        (full,) = _completions(llm, [PROMPTS[1]], params)
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text


def test_serve_and_generate_take_llama_servers_flags():
    from llamabatch.cli import build_parser
    from llamabatch.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["-m", "x.gguf", "--spec-type", "ngram", "--draft-max", "7"])
    assert EngineConfig.from_cli_args(args).speculative_config["num_speculative_tokens"] == 7
    args = build_parser().parse_args(["generate", "-m", "x.gguf", "--spec-type", "draft", "-md", "d.gguf"])
    assert EngineConfig.from_cli_args(args).speculative_config["model"] == "d.gguf"


def test_metrics_export_the_spec_decode_counters(tiny_path):
    from llamabatch.runtime.metrics import PrometheusListener

    metrics = PrometheusListener()
    with _llm(tiny_path) as llm:
        metrics.attach(llm)
        outs = _completions(llm, PROMPTS, SamplingParams(max_tokens=64, temperature=0))
        text = metrics.generate_latest().decode()
        stats = llm.stats()
    accepted = sum(o.timings.spec_accepted_tokens for o in outs)
    assert accepted == stats.spec_accepted_tokens == sum(stats.spec_accepted_per_pos) > 0
    assert stats.spec_drafts > 0
    assert (
        f'llamabatch:spec_decode_num_accepted_tokens_total{{model_name="{tiny_path.stem}"}} {float(accepted)}'
        in text
    )
    assert "llamabatch:spec_decode_num_draft_tokens_total" in text
    assert "llamabatch:spec_decode_num_drafts_total" in text
    assert 'llamabatch:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
    assert "llamabatch:spec_decode_num_grammar_draft_tokens_total" in text  # (0: no grammar here)


def test_bench_repeat_workload_with_speculation(tiny_path, capsys):
    import json

    from llamabatch.bench.workloads import REPEAT_PASSAGE, open_tokenizer, repeat_requests
    from llamabatch.cli import main

    vocab = open_tokenizer(tiny_path)
    try:
        requests = repeat_requests(vocab, 100, 8, 2)
    finally:
        vocab.close()
    assert len(requests) == 2 and requests[0].prompt != requests[1].prompt
    for r in requests:
        assert len(r.prompt) == 100 and r.prompt[REPEAT_PASSAGE:] == r.prompt[: 100 - REPEAT_PASSAGE]
    argv = [
        "bench",
        "-m",
        str(tiny_path),
        "--workload",
        "repeat",
        "--npp",
        "64",
        "--ntg",
        "16",
        "--npl",
        "1,2",
    ]
    argv += ["--spec-type", "ngram", "--draft-max", "4", "-t", "2", "--json", "--no-progress"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["workload"], r["npl"], r["speculative"]) for r in rows] == [
        ("repeat", 1, "ngram:4"),
        ("repeat", 2, "ngram:4"),
    ]
    assert all(r["gen_tokens"] == 16 * r["npl"] for r in rows)


def test_an_http_request_can_opt_out_of_speculation():
    from llamabatch.server.protocol import Body, sampling_params

    body = Body({"prompt": "x", "speculative": False}, "/v1/completions")
    assert (
        sampling_params(body, chat=False, prompt_tokens=3, n_ctx_seq=64, logprobs=None).speculative is False
    )
    body = Body({"prompt": "x"}, "/v1/completions")
    assert sampling_params(body, chat=False, prompt_tokens=3, n_ctx_seq=64, logprobs=None).speculative is True


def test_a_copied_paragraph_drafts_nothing_past_its_end(smollm2_path):
    """SmolLM2 asked to copy a paragraph word for word: the lookup finds the paragraph in the
    prompt and would draft on past its end, through ``<|im_end|>`` (the end-of-generation
    token the answer ends with) into the chat template and the copy so far. Drafts are cut
    before the end-of-generation token: the answer is the plain run's token for token, and
    (the copy being exact) next to no drafted token goes unused."""
    paragraph = (
        "The river rose slowly through the night, and by morning the lower fields were under a "
        "sheet of brown water. The farmers moved their animals to the hill behind the church, "
        "where the old stone wall kept the wind off, and waited for the rain to stop."
    )
    chat = [{"role": "user", "content": f"Copy this paragraph word for word:\n\n{paragraph}"}]
    params = SamplingParams(max_tokens=100, temperature=0)
    outs = []
    for spec in (None, NGRAM):
        with LLM(smollm2_path, n_ctx=1024, n_parallel=1, n_threads=1, speculative_config=spec) as llm:
            outs.append(llm.chat(chat, params)[0].outputs[0])
    plain, speculated = outs
    assert speculated.token_ids == plain.token_ids and plain.text == paragraph
    assert plain.finish_reason == "stop"
    timings = speculated.timings
    assert timings.spec_accepted_tokens >= len(plain.token_ids) // 2, timings
    # (drafted 46, kept 41 before the cut; 41 and 41 with it)
    assert timings.spec_draft_tokens - timings.spec_accepted_tokens <= 2, timings
