"""``merge_lora=True``: one adapter merged into the weights at load (``generate/lora_merge.py``),
against the same adapter applied unmerged by llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from llamabatch import LLM, SamplingParams
from llamabatch.config import EngineConfig
from llamabatch.errors import LoraLoadError
from llamabatch.params import LoRARequest
from llamabatch.testing import make_lora, model_path

PROMPTS = ["Hello there friend", "The cat sat on", "One two three"]
OPTIONS = {"n_ctx": 512, "n_parallel": 1, "n_threads": 1}


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Merged models go to this test's folder, not the user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "llamabatch" / "merged"


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_path("tiny")


@pytest.fixture(scope="module")
def adapters(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("loras")
    return {
        "a": make_lora(tiny, d / "a.gguf", rank=4, seed=1, alpha=6.0),
        "b": make_lora(tiny, d / "b.gguf", rank=4, seed=2),
    }


def _run(llm: LLM, lora: object, prompts: list[str], n: int = 10) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and each chosen token's log-probability, one request at a time."""
    out = []
    for prompt in prompts:
        params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, lora=lora)
        o = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        out.append((list(o.token_ids), [d[t] for d, t in zip(o.logprobs, o.token_ids, strict=True)]))
    return out


def test_merged_equals_unmerged_by_logprobs(tiny: Path, adapters: dict[str, Path], cache_home: Path) -> None:
    """The random model's distributions are flat, so the check is on log-probabilities: the
    merged weights give each greedy token the probability the unmerged adapter gives it."""
    with LLM(tiny, lora_adapters={"a": adapters["a"]}, **OPTIONS) as llm:
        unmerged, base = _run(llm, "a", PROMPTS), _run(llm, (), PROMPTS)
    with LLM(tiny, lora_adapters={"a": adapters["a"]}, merge_lora=True, **OPTIONS) as llm:
        assert llm.core.lora is None  # no adapter scheduling: the adapter is in the weights
        assert llm.lora_adapters() == {"a": str(adapters["a"])}
        merged, named = _run(llm, (), PROMPTS), _run(llm, "a", PROMPTS)
    assert merged == named
    assert [t for t, _ in merged] != [t for t, _ in base]
    for (tokens, logprobs), (want_tokens, want) in zip(merged, unmerged, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want, abs=2e-3)
    (merged_file,) = cache_home.glob("*.gguf")
    stamp = merged_file.stat().st_mtime_ns
    with LLM(tiny, lora_adapters={"a": adapters["a"]}, merge_lora=True, **OPTIONS) as llm:
        assert _run(llm, (), PROMPTS[:1]) == merged[:1]
    assert merged_file.stat().st_mtime_ns == stamp  # the cached merge is reused


def test_merged_engine_refuses_other_adapters_and_scales(tiny: Path, adapters: dict[str, Path]) -> None:
    with LLM(tiny, lora_adapters={"a": adapters["a"]}, merge_lora=True, **OPTIONS) as llm:
        for lora, match in [
            ("b", "'b': this engine serves only the model merged with LoRA adapter 'a'"),
            ({"a": 0.5}, "at scale 0.5: it is merged into the weights at scale 1"),
            ({"a": 1.0, "b": 1.0}, "neither other adapters nor the base model"),
            (LoRARequest("b", 2, str(adapters["b"])), "'b'"),
        ]:
            with pytest.raises(ValueError, match=match):
                llm.generate(["x"], SamplingParams(max_tokens=2, lora=lora), use_tqdm=False)
        with pytest.raises(ValueError, match="merge_lora"):
            llm.load_lora("b", adapters["b"])


def test_merge_lora_option_errors(tiny: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"exactly one LoRA adapter.*names 0"):
        EngineConfig(merge_lora=True)
    with pytest.raises(ValueError, match=r"exactly one LoRA adapter.*names 2"):
        LLM(tiny, lora_adapters=adapters, merge_lora=True, **OPTIONS)
    with pytest.raises(ValueError, match="max_loras=2 does not apply"):
        EngineConfig(lora_adapters={"a": "a.gguf"}, max_loras=2, merge_lora=True)
    with pytest.raises(ValueError, match="batch_invariant=True refuses"):
        EngineConfig(lora_adapters={"a": "a.gguf"}, merge_lora=True, batch_invariant=True)
    with pytest.raises(ValueError, match="merge_lora must be True or False"):
        EngineConfig(lora_adapters={"a": "a.gguf"}, merge_lora="yes")
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        LLM(tiny, lora_adapters={"a": tmp_path / "nope.gguf"}, merge_lora=True, **OPTIONS)
    with pytest.raises(LoraLoadError, match=r"general\.type: missing"):
        LLM(tiny, lora_adapters={"a": tiny}, merge_lora=True, **OPTIONS)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--lora", f"a={adapters['a']}", "--merge-lora"]))
    assert config.merge_lora and config.n_loras == 0


def test_smollm2_merged_greedy_tokens_equal_unmerged(tmp_path: Path) -> None:
    """On the real Q4_1 model the merged tensors are F16: ggml multiplies them with F16
    activations where the Q4_1 path rounds activations to 8 bits, so the two runs differ by
    that rounding (the base model written as F16 differs from itself in Q4_1 as much). Over a
    short greedy run the tokens agree and the log-probabilities stay close."""
    from llamabatch.testing import real_model_path

    smol = Path("/tmp/smollm2.gguf")
    if not smol.exists():
        try:
            smol = real_model_path()
        except Exception as exc:  # no network, no cache
            pytest.skip(f"SmolLM2 not available: {exc}")
    adapter = make_lora(smol, tmp_path / "smol-lora.gguf", rank=8, seed=0)
    prompts = ["The capital of France is"]
    with LLM(smol, lora_adapters={"sql": adapter}, **OPTIONS) as llm:
        (unmerged,) = _run(llm, "sql", prompts, 6)
    with LLM(smol, lora_adapters={"sql": adapter}, merge_lora=True, **OPTIONS) as llm:
        (merged,) = _run(llm, "sql", prompts, 6)
    assert merged[0] == unmerged[0]
    assert merged[1] == pytest.approx(unmerged[1], abs=0.3)
