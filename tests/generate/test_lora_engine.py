"""LoRA adapters in the engine: ``LLM(lora_adapters=...)``, ``SamplingParams(lora=...)``, one
adapter set per tick, and the tokens of llama.cpp itself with the same files."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from llamabatch import LLM, SamplingParams
from llamabatch.errors import LoraLoadError
from llamabatch.params import LoRARequest
from llamabatch.testing import make_lora, model_path

PROMPTS = ["Hello there friend", "The cat sat on", "One two three"]
SETS: list[object] = [(), "a", "b", {"a": 0.5, "b": 1.0}]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_path("tiny")


@pytest.fixture(scope="module")
def adapters(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("loras")
    return {
        "a": make_lora(tiny, d / "a.gguf", rank=4, seed=1),
        "b": make_lora(tiny, d / "b.gguf", rank=4, seed=2),
    }


def _greedy(lora: object = (), max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=lora)


def test_mixed_adapter_sets_equal_each_alone(tiny: Path, adapters: dict[str, Path]) -> None:
    with LLM(tiny, lora_adapters=adapters, n_parallel=4, n_ctx=1024) as llm:
        alone = {
            (p, str(s)): llm.generate([p], _greedy(s), use_tqdm=False)[0].outputs[0].token_ids
            for p in PROMPTS
            for s in SETS
        }
        jobs = [(p, s) for p in PROMPTS for s in SETS]
        outs = llm.generate([p for p, _ in jobs], [_greedy(s) for _, s in jobs], use_tqdm=False)
        for out, (p, s) in zip(outs, jobs, strict=True):
            assert out.outputs[0].token_ids == alone[(p, str(s))], (p, s)
        assert all(alone[(p, "a")] != alone[(p, "()")] for p in PROMPTS)
        assert alone[(PROMPTS[0], "a")] != alone[(PROMPTS[0], "b")]
        stats = llm.core.lora.stats()
        assert stats["lora_switches"] > 0 and stats["lora_loads"] == 2


def test_requests_naming_unknown_adapters_are_refused(tiny: Path, adapters: dict[str, Path]) -> None:
    with LLM(tiny, lora_adapters={"a": adapters["a"]}, n_ctx=256) as llm:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'zzz'"):
            llm.generate(["x"], _greedy("zzz"), use_tqdm=False)
    with LLM(tiny, n_ctx=256) as llm, pytest.raises(ValueError, match="no LoRA adapters"):
        llm.generate(["x"], _greedy("a"), use_tqdm=False)


def test_bad_adapter_file_at_load_names_it(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 40)
    with pytest.raises(LoraLoadError, match=r"bad\.gguf"):
        LLM(tiny, lora_adapters={"x": bad}, n_ctx=256)
    with pytest.raises(LoraLoadError, match=r"general\.type: missing"):
        LLM(tiny, lora_adapters={"x": tiny}, n_ctx=256)


def test_lru_limit_and_lora_request_files(tiny: Path, adapters: dict[str, Path]) -> None:
    with LLM(tiny, lora_adapters={"a": adapters["a"]}, max_loras=1, n_parallel=2, n_ctx=512) as llm:
        first_a = llm.generate([PROMPTS[0]], _greedy("a"), use_tqdm=False)[0].outputs[0].token_ids
        request = LoRARequest("b", 2, str(adapters["b"]))
        b = llm.generate([PROMPTS[0]], _greedy(request), use_tqdm=False)[0].outputs[0].token_ids
        # both sets at once with room for one adapter: they run one after the other
        outs = llm.generate([PROMPTS[0]] * 2, [_greedy("a"), _greedy("b")], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [first_a, b]
        stats = llm.core.lora.stats()
        assert len(stats["lora_loaded"]) == 1 and stats["lora_unloads"] >= 2


# -- the same files in llama.cpp itself (the real SmolLM2) --------------------------------------

SMOLLM2 = Path("/tmp/smollm2.gguf")
ANCHORS = Path.home() / ".cache" / "llamabatch-anchors"


@pytest.fixture(scope="module")
def smol_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from llamabatch.testing import real_model_path

    base = SMOLLM2 if SMOLLM2.exists() else real_model_path()
    return base, make_lora(base, tmp_path_factory.mktemp("smol") / "smol-lora.gguf", rank=8, seed=0)


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_smollm2_greedy_with_adapter_equals_llama_cpp(smol_lora: tuple[Path, Path]) -> None:
    """Prompts with and without the adapter equal llama.cpp alone on one sequence with the same
    files (llama-cpp-python's build of the pinned commit), token for token, in the setting
    ``test_real_model`` checks the base model in. Each request runs alone: ggml's CPU kernels
    round an F32 matrix (the adapter's) differently for one row than for several, so with
    batch-mates of its set a near tie may go the other way (README: LoRA adapters)."""
    pytest.importorskip("llama_cpp")
    from test_real_model import single_sequence_greedy

    from llamabatch.bench.runners.llama_cpp import load_llama_cpp

    base, adapter = smol_lora
    n = 16
    params = [_greedy("sql", n), _greedy("sql", n), _greedy((), n), _greedy((), n)]
    options = {"n_ctx": 1024, "n_parallel": 4, "n_threads": 1, "kv_unified": False, "flash_attn": False}
    with LLM(base, lora_adapters={"sql": adapter}, **options) as llm:
        outs = [
            llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
            for prompt, p in zip(SMOL_PROMPTS * 2, params, strict=True)
        ]
    ref_options = {"n_ctx": 256, "n_batch": 256, "logits_all": True, "verbose": False, "n_threads": 1}
    for with_lora, group in ((True, outs[:2]), (False, outs[2:])):
        lora_path = str(adapter) if with_lora else None
        reference = load_llama_cpp(str(base), flash_attn=False, lora_path=lora_path, **ref_options)
        for prompt, out in zip(SMOL_PROMPTS, group, strict=True):
            tokens, _ = single_sequence_greedy(reference, out.prompt_token_ids, n)
            assert out.token_ids == tokens, (prompt, with_lora, out.text, reference.detokenize(tokens))
        del reference
    assert outs[0].token_ids != outs[2].token_ids


@pytest.mark.skipif(not (ANCHORS / "llama-server").exists(), reason="llama-server anchor not built")
def test_smollm2_greedy_with_adapter_equals_llama_server(smol_lora: tuple[Path, Path]) -> None:
    """The same files in llama-server (``--lora FILE``, a request's ``lora`` scales), run
    alone, token for token."""
    import json
    import urllib.request

    base, adapter = smol_lora
    n = 16
    port = 18000 + os.getpid() % 1000
    server = subprocess.Popen(
        [str(ANCHORS / "llama-server"), "-m", str(base), "--lora", str(adapter), "--port", str(port),
         "-t", "1", "-c", "1024", "-np", "1", "--no-warmup"],
        env={**os.environ, "LD_LIBRARY_PATH": str(ANCHORS)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def post(path: str, body: dict[str, object]) -> dict[str, object]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return dict(json.load(resp))

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("llama-server did not start")
                time.sleep(0.3)
        ref = {}
        for prompt in SMOL_PROMPTS:
            for scale in (1.0, 0.5, 0.0):
                body = {
                    "prompt": prompt,
                    "n_predict": n,
                    "temperature": 0,
                    "cache_prompt": False,
                    "return_tokens": True,
                    "lora": [{"id": 0, "scale": scale}],
                }
                ref[(prompt, scale)] = post("/completion", body)["tokens"]
    finally:
        server.terminate()
        server.wait(10)
    with LLM(base, lora_adapters={"x": adapter}, n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        for (prompt, scale), tokens in ref.items():
            out = llm.generate([prompt], _greedy({"x": scale}, n), use_tqdm=False)[0].outputs[0]
            assert out.token_ids == tokens, (prompt, scale, out.text)
    assert ref[(SMOL_PROMPTS[0], 1.0)] != ref[(SMOL_PROMPTS[0], 0.0)]


def test_load_and_unload_at_run_time(tiny: Path, adapters: dict[str, Path]) -> None:
    with LLM(tiny, max_loras=1, n_ctx=512) as llm:
        assert llm.lora_adapters() == {}
        llm.load_lora("a", adapters["a"])
        assert llm.lora_adapters() == {"a": str(adapters["a"])}
        first = llm.generate([PROMPTS[1]], _greedy("a"), use_tqdm=False)[0].outputs[0].token_ids
        llm.unload_lora("a")
        assert llm.stats().lora_loaded == ()
        with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
            llm.generate([PROMPTS[1]], _greedy("a"), use_tqdm=False)
        with pytest.raises(KeyError):
            llm.unload_lora("a")
        with pytest.raises(LoraLoadError):
            llm.load_lora("bad", tiny)
        llm.load_lora("a", adapters["a"])
        assert llm.generate([PROMPTS[1]], _greedy("a"), use_tqdm=False)[0].outputs[0].token_ids == first
    with LLM(tiny, n_ctx=256) as llm, pytest.raises(ValueError, match="no LoRA adapters"):
        llm.load_lora("a", adapters["a"])


def test_batch_invariant_with_adapters_is_refused(tiny: Path, adapters: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(tiny, lora_adapters={"a": adapters["a"]}, batch_invariant=True, n_ctx=256)


def test_adapter_failing_to_load_at_admission_ends_its_request_as_error(
    tiny: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(adapters["a"].read_bytes())
    with LLM(tiny, lora_adapters={"gone": broken}, n_ctx=256) as llm:
        broken.write_bytes(b"GGUF" + b"\0" * 40)  # replaced after it was checked: the load fails
        base, failed = llm.generate(["x", "y"], [_greedy(), _greedy("gone")], use_tqdm=False)
        assert base.outputs[0].finish_reason == "length"
        assert failed.outputs[0].finish_reason == "error"
        assert "'gone'" in str(failed.outputs[0].error) and "broken.gguf" in str(failed.outputs[0].error)
        assert llm.generate(["x"], _greedy(), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_lora_stats_in_llm_stats_and_metrics(tiny: Path, adapters: dict[str, Path]) -> None:
    pytest.importorskip("prometheus_client")
    from llamabatch.runtime.metrics import PrometheusListener

    with LLM(tiny, lora_adapters=adapters, n_parallel=2, n_ctx=512) as llm:
        params = [_greedy("a"), _greedy(), _greedy({"a": 0.5, "b": 1.0})]
        llm.generate(["x", "y", "z"], params, use_tqdm=False)
        stats = llm.stats()
        assert stats.lora_switches >= 2 and stats.lora_loads == 2
        assert set(stats.lora_loaded) == {"a", "b"}
        assert stats.lora_requests == {"a": 1, "(base)": 1, "a*0.5+b": 1}
        assert stats.lora_switch_seconds >= 0.0
        metrics = PrometheusListener(model_name="tiny")
        metrics.attach(llm, "tiny")
        text = metrics.generate_latest().decode()
    assert 'llamabatch:lora_switches_total{model_name="tiny"}' in text
    assert 'llamabatch:lora_loaded_adapters{model_name="tiny"} 2.0' in text
    assert 'llamabatch:lora_requests_total{adapter_set="a*0.5+b",model_name="tiny"} 1.0' in text
    assert "llamabatch:lora_switch_seconds{" in text


def test_an_adapters_conversation_comes_back_from_the_ram_tier(tiny: Path, adapters: dict[str, Path]) -> None:
    """A conversation under adapter "a" pushed out of the KV cache is restored from the RAM
    tier for its next turn under "a", with the log-probabilities of computing it again; the
    same tokens under "b" are computed."""
    options = dict(n_ctx=2048, n_parallel=2, n_batch=256, flash_attn=False, kv_unified=True)
    params = {lora: SamplingParams(max_tokens=6, temperature=0, logprobs=2, lora=lora) for lora in ("a", "b")}
    with LLM(tiny, lora_adapters=adapters, cache_ram=64, **options) as llm:
        words = "the quick brown fox jumps over a lazy dog while seven cats watch it ".split()
        convs = [llm.tokenize(" ".join(words[i:] + words * 12))[:120] for i in range(3)]
        first = llm.generate(convs[0], params["a"])[0].outputs[0]
        llm.generate(convs[1:], params["a"], use_tqdm=False)  # 3 conversations, 2 slots
        follow = convs[0] + first.token_ids + llm.tokenize(" And then?", add_special=False)
        out = llm.generate(follow, params["a"])[0].outputs[0]
        restores = llm.stats().ram_cache_restores
        other = llm.generate(follow, params["b"])[0].outputs[0]
        assert llm.stats().ram_cache_restores == restores == 1
    assert out.usage.reused_tokens >= 120 and other.usage.reused_tokens == 0
    with LLM(tiny, lora_adapters=adapters, cache_ram=0, **options) as llm:
        computed = llm.generate(follow, params["a"])[0].outputs[0]
    assert out.token_ids == computed.token_ids
    for a, b in zip(out.logprobs, computed.logprobs, strict=True):
        for token, value in b.items():
            assert a[token] == pytest.approx(value, abs=1e-3)


def test_a_client_spreading_requests_over_scales_does_not_crowd_out_another(
    tiny: Path, adapters: dict[str, Path]
) -> None:
    """Six requests of one client, each under a scale of its own (six adapter sets), and one
    base request of another client, all queued together: the base request gets at least half
    the ticks (it got one in seven when every set's request counted alike), so it ends while
    the six are far from their end. Ticks are counted through the requests' tokens, not time."""
    with LLM(tiny, lora_adapters=adapters, n_parallel=8, n_ctx=2048) as llm:
        params = [
            SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, lora={"a": 0.3 + i / 10})
            for i in range(6)
        ]
        many = [llm.submit("The cat sat on", p, client="many") for p in params]
        one = llm.submit(
            "One two three", SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), client="one"
        )
        one.result(timeout=120)
        ticks_by_then = llm.stats().ticks
        for handle in many:
            handle.result(timeout=120)
        ticks_all = llm.stats().ticks
    # alone, its 64 tokens take 64 ticks; the six's 384 take 384 more, one set a tick
    assert ticks_by_then <= 0.5 * ticks_all, (ticks_by_then, ticks_all)
