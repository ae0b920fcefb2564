"""``batch_invariant=True``: a request's tokens and log-probs are bit-identical to the same
request run alone, whatever else runs, on the real SmolLM2-135M and on a sliding-window
(Gemma 3) model. Exact equality: random weights would do, but real ones are the point."""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamabatch import LLM, EngineConfig, SamplingParams, testing
from llamabatch.metrics import PrometheusListener

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The chemical symbol for gold is",
    "Translate to French: Good morning, my friend.",
    "Explain why the sky is blue in one sentence.",
    "1, 1, 2, 3, 5, 8,",
    "What is the boiling point of water in Celsius?",
]
MAX_TOKENS = 8
ENGINE = dict(n_threads=2, n_threads_batch=2, batch_invariant=True)


def _params(seeded: bool, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=7, ignore_eos=True, logprobs=2)
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)


def _key(output) -> tuple:
    """A completion's tokens and its log-probs, exactly (floats compared bit for bit)."""
    c = output.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted(d.items())) for d in c.logprobs)


def _prefix(key: tuple, n: int) -> tuple:
    return key[0][:n], key[1][:n]


class Alone:
    """Each prompt's completion run alone (one slot, no prefix reuse), computed once."""

    def __init__(self, path, **options) -> None:
        self.llm = LLM(path, n_parallel=1, prefix_cache=False, cache_ram=0, **ENGINE, **options)
        self.done: dict[tuple, tuple] = {}

    def __call__(self, prompt: str, seeded: bool = False, max_tokens: int = MAX_TOKENS) -> tuple:
        if (prompt, seeded) not in self.done:
            out = self.llm.generate(prompt, _params(seeded), use_tqdm=False)[0]
            self.done[prompt, seeded] = _key(out)
        return _prefix(self.done[prompt, seeded], max_tokens)


@pytest.fixture(scope="module")
def alone(smollm2_path):
    ref = Alone(smollm2_path, n_ctx=512)
    yield ref
    ref.llm.close()


@pytest.fixture(scope="module")
def busy(smollm2_path):
    """One engine for every example: its history (cached prefixes, slots) must not matter."""
    with LLM(smollm2_path, n_parallel=4, n_ctx=4 * 512, **ENGINE) as llm:
        yield llm


def _submit_all(llm, prompts, params, delays):
    handles = []
    for prompt, p, delay in zip(prompts, params, delays, strict=True):
        handles.append(llm.submit(prompt, p))
        time.sleep(delay)
    return [_key(h.result(timeout=300)) for h in handles]


# -- the property ----------------------------------------------------------------------------


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    picks=st.lists(st.sampled_from(range(len(PROMPTS))), min_size=2, max_size=6),
    data=st.data(),
)
def test_any_mix_and_arrival_order_equals_alone(busy, alone, picks, data):
    n = len(picks)
    max_tokens = data.draw(st.lists(st.integers(1, MAX_TOKENS), min_size=n, max_size=n))
    seeded = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    delays = data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.01, 0.05]), min_size=n, max_size=n))
    prompts = [PROMPTS[i] for i in picks]
    params = [_params(s, m) for s, m in zip(seeded, max_tokens, strict=True)]
    got = _submit_all(busy, prompts, params, delays)
    for prompt, s, m, key in zip(prompts, seeded, max_tokens, got, strict=True):
        assert key == alone(prompt, s, m), prompt


# -- the paths where a batch could leak in ---------------------------------------------------


def test_chunked_prefill_with_a_tiny_budget_equals_alone(smollm2_path, alone):
    with LLM(smollm2_path, n_parallel=4, n_ctx=4 * 256, n_batch=8, chunk_size=3, **ENGINE) as llm:
        got = [_key(o) for o in llm.generate(PROMPTS[4:8], _params(False), use_tqdm=False)]
    assert got == [alone(p) for p in PROMPTS[4:8]]


def test_prefix_reuse_equals_alone(smollm2_path, alone):
    system = "You are a helpful assistant who answers briefly, precisely and politely. Question: "
    prompts = [system + q for q in ("What is two plus two?", "Name a planet.", "Who wrote Hamlet?")]
    with LLM(smollm2_path, n_parallel=3, n_ctx=3 * 256, **ENGINE) as llm:
        first = _key(llm.generate(prompts[0], _params(False), use_tqdm=False)[0])
        rest = [_key(o) for o in llm.generate(prompts[1:], _params(False), use_tqdm=False)]
        assert llm.stats().reused_tokens > 0
    assert [first, *rest] == [alone(p) for p in prompts]


def test_preemption_and_recompute_equal_alone(smollm2_path, alone):
    params = _params(False, 24)
    with LLM(smollm2_path, n_parallel=1, n_ctx=256, **ENGINE) as llm:
        low = llm.submit(PROMPTS[4], params, priority=5)
        deltas = iter(low)
        next(deltas)
        next(deltas)  # it runs: the urgent request takes its slot
        urgent = llm.submit(PROMPTS[0], params, priority=0)
        got = [_key(low.result(timeout=300)), _key(urgent.result(timeout=300))]
        stats = llm.stats()
    assert stats.preemptions >= 1 and stats.recomputed_tokens > 0
    ref = Alone(smollm2_path, n_ctx=256)
    try:
        assert got == [_key(ref.llm.generate(p, params, use_tqdm=False)[0]) for p in (PROMPTS[4], PROMPTS[0])]
    finally:
        ref.llm.close()


def test_speculation_on_equals_alone_without_it(smollm2_path, alone):
    prompts = [
        "Repeat after me: red, green, blue, red, green, blue, red, green, blue, red, green,",
        "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
        "def f(x):\n    return x\ndef g(x):\n    return x\ndef h(x):\n",
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with LLM(smollm2_path, n_parallel=3, n_ctx=3 * 256, speculative_config=spec, **ENGINE) as llm:
        got = [_key(o) for o in llm.generate(prompts, _params(False), use_tqdm=False)]
        assert llm.stats().spec_draft_tokens > 0
    assert got == [alone(p) for p in prompts]


# -- a sliding-window model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def swa_path(tmp_path_factory):
    return testing.make_swa_model(tmp_path_factory.mktemp("swa"))


@pytest.fixture(scope="module")
def swa_alone(swa_path):
    ref = Alone(swa_path, n_ctx=256)
    yield ref
    ref.llm.close()


@pytest.fixture(scope="module")
def swa_busy(swa_path):
    with LLM(swa_path, n_parallel=4, n_ctx=4 * 256, **ENGINE) as llm:
        yield llm


SWA_PROMPTS = testing.english_sentences(8)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(picks=st.lists(st.sampled_from(range(len(SWA_PROMPTS))), min_size=2, max_size=6), data=st.data())
def test_sliding_window_model_any_mix_equals_alone(swa_busy, swa_alone, picks, data):
    """Prompts of 19-51 tokens and a 16-token window: the window slides in every request."""
    n = len(picks)
    max_tokens = data.draw(st.lists(st.integers(1, MAX_TOKENS), min_size=n, max_size=n))
    delays = data.draw(st.lists(st.sampled_from([0.0, 0.01]), min_size=n, max_size=n))
    prompts = [SWA_PROMPTS[i] for i in picks]
    got = _submit_all(swa_busy, prompts, [_params(False, m) for m in max_tokens], delays)
    for prompt, m, key in zip(prompts, max_tokens, got, strict=True):
        assert key == swa_alone(prompt, False, m), prompt


# -- the option itself -----------------------------------------------------------------------


def test_the_option_decides_the_layout_and_reports_it(smollm2_path, busy):
    s = busy.stats()
    assert (s.batch_invariant, s.kv_unified, s.flash_attn, s.kv_type_k, s.kv_type_v) == (
        True, False, True, "q8_0", "q8_0",
    )  # fmt: skip
    listener = PrometheusListener()
    listener.attach(busy, model_name="m")
    assert b'llamabatch:batch_invariant{model_name="m"} 1.0' in listener.generate_latest()
    listener.detach(busy)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"kv_unified": True}, "kv_unified=True"),
        ({"flash_attn": False}, "flash_attn=False"),
        ({"type_k": "f32"}, "type_k='f32'"),
        ({"type_v": "f32"}, "type_v='f32'"),
        ({"n_gpu_layers": -1}, "n_gpu_layers=-1"),
    ],
)
def test_conflicting_settings_are_refused(options, named):
    with pytest.raises(ValueError, match="batch_invariant=True") as info:
        EngineConfig(batch_invariant=True, **options)
    assert named in str(info.value)
    EngineConfig(batch_invariant=False, **options)  # fine on their own


def test_a_non_bool_is_refused():
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineConfig(batch_invariant="yes")


def test_the_cli_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--batch-invariant"])).batch_invariant is True
    assert EngineConfig.from_cli_args(parser.parse_args([])).batch_invariant is False
    assert "--batch-invariant" in EngineConfig(batch_invariant=True).to_cli_args()


def test_explicit_per_stream_types_are_kept(smollm2_path):
    with LLM(smollm2_path, n_parallel=2, n_ctx=512, type_k="bf16", type_v="bf16", **ENGINE) as llm:
        s = llm.stats()
        assert (s.kv_type_k, s.kv_type_v, s.kv_unified, s.flash_attn) == ("bf16", "bf16", False, True)


# -- the unified buffer's divergence is llama.cpp's ------------------------------------------


def _reproduction():
    path = Path(__file__).resolve().parents[2] / "docs" / "batch_invariance.py"
    spec = importlib.util.spec_from_file_location("batch_invariance_doc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_cpp_picks_its_flash_attention_kernel_by_the_batch(smollm2_path):
    """Documents llama.cpp's behaviour (commit 0c1e570), through its C API only, with the
    reproduction in docs/batch_invariance.py: with an f16 cache the same prompt's logits
    change when its ubatch reaches 64 rows (tiled kernel) or when its cells move within the
    64-cell tiles, and a long sequence's decode step changes beside another stream (KV split
    among threads); positions, masks and order stay the same. A q8_0 cache takes the
    one-row kernel there (the script shows the other cases too). If this fails after a
    llama.cpp upgrade, the kernels changed: re-run the script and update README,
    "Reproducibility"."""
    doc = _reproduction()
    with doc.Model(str(smollm2_path)) as model:
        f16 = list(doc.tiled_kernel(model, "f16").values())
        assert f16 == [True, False, True, True, False]
        assert doc.split_kv(model, "f16") is False
        assert doc.split_kv(model, "q8_0") is True


def test_equals_llama_cpp_single_sequence_with_the_same_settings(smollm2_path, busy):
    """The same tokens as llama.cpp decoding the prompt as its only sequence with flash
    attention on and a q8_0 cache (llama-server -np 1 -fa on -ctk q8_0 -ctv q8_0), through
    llama-cpp-python, and its log-probs within the log-softmax's own rounding."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    q8_0 = 8  # GGML_TYPE_Q8_0
    ref = llama_cpp.Llama(
        model_path=str(smollm2_path), n_ctx=512, n_threads=2, n_threads_batch=2, flash_attn=True,
        type_k=q8_0, type_v=q8_0, logits_all=True, verbose=False,
    )  # fmt: skip
    try:
        outs = busy.generate(PROMPTS[:3], _params(False), use_tqdm=False)
        for out in outs:
            c = out.outputs[0]
            ref.reset()
            ref.eval(out.prompt_token_ids)
            for token, logprobs in zip(c.token_ids, c.logprobs, strict=True):
                row = np.asarray(ref.scores[ref.n_tokens - 1], dtype=np.float32)
                assert int(np.argmax(row)) == token
                expected = row - np.float32(np.logaddexp.reduce(row.astype(np.float64)))
                assert logprobs[token] == pytest.approx(float(expected[token]), abs=1e-5)
                ref.eval([token])
    finally:
        ref.close()


def test_a_model_with_float_matrices_is_refused(tiny_path):
    """F32/F16 products take ggml's vec_dot for a one-token ubatch and llamafile's sgemm for
    more, which round differently: the tiny test model (F32) cannot be batch-invariant."""
    with pytest.raises(ValueError, match=r"batch_invariant=True: .* holds F32 matrices"):
        LLM(tiny_path, **ENGINE)
