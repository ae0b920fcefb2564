"""The default KV cache (n_ctx from the model's trained context under a budget, the layout chosen
at load, whole context per request) and the KV cache types (type_k / type_v), on real llama.cpp."""

from __future__ import annotations

import dataclasses
import logging
import re

import numpy as np
import pytest

from llamabatch import LLM, EngineConfig, LLMEngine, SamplingParams
from llamabatch._ffi.context import Context
from llamabatch._ffi.kv_types import KV_TYPES, kv_bytes_per_cell
from llamabatch._ffi.model import Model
from llamabatch.cli import build_parser
from llamabatch.generate import kv_memory
from llamabatch.generate.kv_memory import MIN_N_CTX, plan_kv
from llamabatch.generate.slot_count import MAX_SLOTS
from llamabatch.gguf.testing import PRESETS, model_path

#: the documented tolerance (README, "KV cache types") against an f16 cache, over a 200-token
#: prompt on the "small" test model: (mean, max) absolute difference of the next-token
#: log-probabilities over the whole vocabulary (measured: q8_0 0.014 / 0.15, q4_0 0.19 / 2.0)
LOGPROB_TOLERANCE = {"q8_0": (0.03, 0.3), "q4_0": (0.3, 3.0)}


@pytest.fixture(scope="module")
def model_8k() -> str:
    """The "small" shape trained (as the GGUF says) for 8192 tokens."""
    spec = dataclasses.replace(PRESETS["small"], n_ctx_train=8192, name="llamabatch-small-8k")
    return str(model_path(spec))


def test_defaults_are_the_trained_context_in_a_layout_chosen_at_load() -> None:
    config = EngineConfig()
    assert config.n_ctx is None and config.kv_unified is None
    assert (config.type_k, config.type_v) == ("f16", "f16")


def test_default_batch_sizes_are_llama_cpps(model_8k: str) -> None:
    with LLMEngine(model_8k) as engine:
        assert (engine.context.n_batch, engine.context.n_ubatch) == (2048, 512)


def test_default_serves_a_2000_token_prompt_on_an_8k_model(model_8k: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="llamabatch")
    with LLM(model_8k) as llm:
        assert llm.n_ctx_seq == 8192  # every request may use it all, in either layout
        assert llm.n_batch == 2048  # llama.cpp's default
        prompt = [(i * 7) % 3000 + 10 for i in range(2000)]
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
        assert len(out.token_ids) == 4
        stats = llm.stats()
    # this small model's streams of 8,192 cells (16 MiB each) fit the per-stream budget: as many
    # slots as the tick's cost allows (generate/slot_count.py), each with a stream
    n = stats.n_parallel
    assert n == MAX_SLOTS and "tick's cost" in stats.n_parallel_reason
    assert not stats.kv_unified and stats.kv_layout_reason.startswith(f"per-stream: {n} streams")
    assert stats.n_ctx == n * 8192 and "trained context" in stats.n_ctx_reason
    cell = 4 * 4 * 32 * 2 * 2  # layers x kv heads x head size x (K, V) x f16
    assert stats.kv_bytes == stats.kv_bytes_f16 == n * 8192 * cell
    assert stats.kv_budget_bytes and stats.kv_budget_bytes > stats.kv_bytes
    lines = [r.getMessage() for r in caplog.records if f"n_ctx={n * 8192}" in r.getMessage()]
    assert len(lines) == 1 and f"{n * 16}.0 MiB" in lines[0] and "budget" in lines[0]
    assert f"{n} streams" in lines[0] and f"n_parallel={n}" in lines[0]


def test_the_layout_chosen_at_load(model_8k: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-stream while n_seq_max streams of the whole context (or of a given n_ctx) fit half
    the KV budget; unified when they do not, on a GPU, for one slot; a given layout wins. (On a
    CPU whose per-stream default is the plain attention path, which keeps a scores buffer.)"""
    monkeypatch.setattr(kv_memory, "has_amx_build", lambda: True)
    with Model(model_8k) as model:
        cell = kv_bytes_per_cell(model)
        stream = 8192 * cell
        scores = 8192 * 512 * model.n_head * 4  # one ubatch's f32 attention scores, without flash attention
        fits = 2 * (8 * stream + scores)  # the per-stream budget is half the KV budget

        def layout(budget: int | None, **options) -> tuple[bool, str]:
            plan = plan_kv(model, EngineConfig(**options), budget=budget)
            return plan.kv_unified, plan.layout_reason

        assert layout(fits) == (False, layout(fits)[1]) and "8 streams" in layout(fits)[1]
        assert plan_kv(model, EngineConfig(), budget=fits).n_ctx == 8 * 8192
        unified, why = layout(fits - 1)
        assert unified and "over the per-stream budget" in why
        assert plan_kv(model, EngineConfig(), budget=fits - 1).n_ctx == 8192  # unified: the whole context
        assert "attention scores without flash attention: 128 MiB" in layout(fits)[1]
        assert not layout(2 * 8 * stream, flash_attn=True)[0]  # no scores buffer with flash attention
        assert layout(fits, max_prefixes=2)[0]  # 10 streams no longer fit
        assert not layout(2 * (10 * stream + scores), max_prefixes=2)[0]
        # a given n_ctx is a request's context: streams of it while they fit, as for the trained one
        given = plan_kv(model, EngineConfig(n_ctx=4096, n_parallel=8), budget=fits)
        assert (
            not given.kv_unified
            and given.n_ctx == 8 * 4096
            and given.reason == "n_ctx given, in each of 8 streams"
        )
        squeezed = plan_kv(model, EngineConfig(n_ctx=8192, n_parallel=8), budget=fits - 1)
        assert squeezed.kv_unified and squeezed.n_ctx == 8192 and squeezed.reason == "n_ctx given"
        divided = plan_kv(model, EngineConfig(n_ctx=4096, n_parallel=8, kv_unified=False), budget=fits)
        assert not divided.kv_unified and divided.n_ctx == 4096  # kv_unified=False: llama.cpp divides it
        assert layout(fits, n_gpu_layers=-1)[0] and layout(fits, n_parallel=1)[0]
        assert layout(None)[0]  # physical memory unknown
        assert layout(fits - 1, kv_unified=False) == (False, "kv_unified given")
        assert layout(fits, kv_unified=True) == (True, "kv_unified given")
        assert EngineConfig(kv_unified=False).n_prefixes == 0 and EngineConfig().n_prefixes == 4


@pytest.mark.parametrize("amx", [True, False], ids=["amx-cpu", "other-cpu"])
def test_flash_attention_chosen_with_the_layout(
    model_8k: str, monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    """With a stream per sequence on the CPU: off where the CPU backend has AMX kernels (the
    Intel Xeon measured), on elsewhere (the AMD EPYC measured; llama.cpp's default); on with
    one unified buffer or a quantized V cache, llama.cpp's own choice (None) on a GPU; a given
    value wins."""
    monkeypatch.setattr(kv_memory, "has_amx_build", lambda: amx)
    per_stream = not amx
    with Model(model_8k) as model:

        def flash(**options) -> bool | None:
            return plan_kv(model, EngineConfig(**options), budget=1 << 40).flash_attn

        assert flash() is per_stream and flash(kv_unified=False) is per_stream  # per-stream (fits)
        assert flash(kv_unified=True) is True and flash(n_ctx=4096, kv_unified=True) is True  # unified
        assert flash(n_ctx=4096) is per_stream  # streams of the given n_ctx (they fit)
        assert flash(kv_unified=False, type_v="q8_0") is True  # V transposed without it
        assert flash(kv_unified=False, type_k="q8_0") is per_stream  # a quantized K is fine without
        assert flash(n_gpu_layers=-1) is None
        assert flash(flash_attn=True) is True and flash(kv_unified=True, flash_attn=False) is False
        assert flash(flash_attn="auto") is per_stream
    with LLM(model_8k, n_parallel=2) as llm:
        assert llm.stats().flash_attn is per_stream and llm.config.flash_attn is per_stream


def test_per_stream_by_default_pins_no_prefix_until_asked(model_8k: str) -> None:
    with LLM(model_8k, n_parallel=2) as llm:
        assert not llm.stats().kv_unified
        with pytest.raises(ValueError, match="max_prefixes is 0"):
            llm.register_prefix([5, 6, 7, 8])
    with LLM(model_8k, n_parallel=2, max_prefixes=1) as llm:
        assert llm.n_ctx == 3 * 8192
        with llm.register_prefix([5, 6, 7, 8]):
            assert llm.stats().pinned_prefixes == 1


def test_default_capacity_is_the_whole_context(model_8k: str) -> None:
    from llamabatch.errors import PromptTooLong

    with LLM(model_8k) as llm:
        prompt = [(i * 7) % 3000 + 10 for i in range(8190)]
        with pytest.raises(PromptTooLong, match="8192"):
            llm.submit(prompt, SamplingParams(max_tokens=8))
        with pytest.raises(PromptTooLong, match="8192"):  # prompt + max_tokens over the context
            llm.submit(prompt[:8000], SamplingParams(max_tokens=500))


def test_budget_caps_the_default_n_ctx(model_8k: str) -> None:
    with Model(model_8k) as model:
        cell = kv_bytes_per_cell(model)
        plan = plan_kv(model, EngineConfig(), budget=3000 * cell)
        assert plan.n_ctx == 2816 and "capped by the KV budget" in plan.reason  # 3000 down to 256s
        assert plan_kv(model, EngineConfig(), budget=10 * cell).n_ctx == MIN_N_CTX  # the floor
        assert plan_kv(model, EngineConfig(n_ctx=512), budget=10).n_ctx == 512  # given wins
        half = plan_kv(model, EngineConfig(type_k="q8_0", type_v="q8_0"), budget=3000 * cell)
        assert half.n_ctx == 5632  # a smaller KV type fits more cells in the same budget


@pytest.mark.parametrize(
    ("options", "mib", "cells"),
    [
        ({"kv_unified": True}, "16.00", 8192),
        ({"kv_unified": True, "type_k": "q8_0", "type_v": "q8_0"}, "8.50", 8192),
        # one stream per slot, each the whole trained context: 8 x 8192 cells
        ({"kv_unified": False, "n_parallel": 8, "type_k": "q4_0", "type_v": "bf16"}, "82.00", 8 * 8192),
    ],
)
def test_kv_bytes_match_llama_cpp(model_8k: str, options: dict, mib: str, cells: int, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="llamabatch.llama_cpp")
    with LLM(model_8k, **options) as llm:
        stats = llm.stats()
        assert (llm.n_ctx, llm.n_ctx_seq) == (cells, 8192)
    said = [
        m for r in caplog.records if (m := re.search(r"llama_kv_cache: size = +([\d.]+) MiB", r.getMessage()))
    ]
    assert said and said[-1].group(1) == mib
    assert stats.kv_bytes == float(mib) * 2**20
    assert stats.kv_bytes_f16 == 16 * 2**20 * cells // 8192
    assert stats.kv_bytes_saved == stats.kv_bytes_f16 - stats.kv_bytes
    assert (stats.kv_type_k, stats.kv_type_v) == (options.get("type_k", "f16"), options.get("type_v", "f16"))


def test_per_stream_default_gives_every_stream_the_whole_context(model_8k: str) -> None:
    from llamabatch.errors import PromptTooLong

    with LLM(model_8k, kv_unified=False, n_parallel=4) as llm:
        assert (llm.n_ctx, llm.n_ctx_seq) == (4 * 8192, 8192)
        assert "in each of 4 streams" in llm.stats().n_ctx_reason
        prompt = [(i * 7) % 3000 + 10 for i in range(2000)]
        outs = llm.generate([prompt, prompt[:1500]], SamplingParams(max_tokens=4, temperature=0))
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
        with pytest.raises(PromptTooLong, match="8192"):
            llm.submit(prompt * 5, SamplingParams(max_tokens=8))


def test_budget_caps_each_stream(model_8k: str) -> None:
    with Model(model_8k) as model:
        cell = kv_bytes_per_cell(model)
        config = EngineConfig(kv_unified=False, n_parallel=4)
        plan = plan_kv(model, config, budget=4 * 3000 * cell)
        assert plan.n_ctx == 4 * 2816 and "capped by the KV budget" in plan.reason  # per stream
        assert "in each of 4 streams" in plan.reason
        assert plan_kv(model, config, budget=10 * cell).n_ctx == 4 * MIN_N_CTX  # the floor, per stream
        assert plan_kv(model, config, budget=None).n_ctx == 4 * 8192  # unknown memory: no cap
        assert plan_kv(model, EngineConfig(kv_unified=False, n_ctx=4096), budget=10).n_ctx == 4096  # given


def _prompt_logprobs(model: Model, tokens: list[int], type_k: str, type_v: str) -> np.ndarray:
    with Context(model, n_ctx=512, n_batch=512, type_k=type_k, type_v=type_v, n_threads=2) as ctx:
        ctx.decode_tokens(tokens, all_logits=True)
        logits = ctx.logits_rows(len(tokens)).astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_stays_close_to_f16(model_8k: str, kv: str) -> None:
    tokens = [(i * 13) % 4000 + 5 for i in range(200)]
    with Model(model_8k) as model:
        reference = _prompt_logprobs(model, tokens, "f16", "f16")
        quantized = _prompt_logprobs(model, tokens, kv, kv)
    diff = np.abs(quantized - reference)
    mean, most = LOGPROB_TOLERANCE[kv]
    assert 0 < diff.mean() <= mean and diff.max() <= most


def test_quantized_kv_generates_through_the_engine(model_8k: str) -> None:
    with LLM(model_8k, n_ctx=1024, type_k="q8_0", type_v="q8_0") as llm:
        outs = llm.generate(["hello there", "a b c"], SamplingParams(max_tokens=8, temperature=0))
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        assert llm.stats().kv_bytes * 2 < llm.stats().kv_bytes_f16 * 1.1  # about halved


def test_bad_kv_types_are_refused() -> None:
    with pytest.raises(ValueError, match="type_k must be one of"):
        EngineConfig(type_k="q9_9")
    with pytest.raises(ValueError, match="needs flash attention"):
        EngineConfig(type_v="q8_0", flash_attn=False)
    EngineConfig(type_k="q8_0", flash_attn=False)  # a quantized K is fine without it
    with pytest.raises(ValueError, match="head size"):  # "tiny" has 16-value heads
        LLM(str(model_path("tiny")), n_ctx=256, type_k="q4_0")
    with Model(model_path("tiny")) as model, pytest.raises(ValueError, match="needs flash attention"):
        Context(model, n_ctx=256, type_k="f32", type_v="q8_0", flash_attn=False)


def test_kv_types_are_all_known_to_ggml() -> None:
    assert {"f16", "bf16", "f32", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"} == set(KV_TYPES)
    assert set(EngineConfig.__dataclass_fields__["type_k"].metadata["cli"][1]["choices"]) == set(KV_TYPES)


def test_cli_flags_as_llama_cpp() -> None:
    args = build_parser().parse_args(["serve", "-m", "x.gguf", "-ctk", "q8_0", "--cache-type-v", "q4_0"])
    assert (args.type_k, args.type_v) == ("q8_0", "q4_0")
    assert args.n_ctx is None and args.kv_unified is None  # chosen at load
    args = build_parser().parse_args(["serve", "-m", "x.gguf", "--no-kv-unified", "-c", "4096"])
    assert args.kv_unified is False and args.n_ctx == 4096
    assert build_parser().parse_args(["serve", "-m", "x.gguf", "--kv-unified"]).kv_unified is True
