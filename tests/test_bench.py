"""``llamabatch bench`` on the tiny model, the bench helpers, and the memory check."""

from __future__ import annotations

import json
import sys

import pytest

from llamabatch import testing
from llamabatch.bench import generate as bench
from llamabatch.cli import main

REQUIRED = {"npp", "ntg", "npl", "total_tokens_per_s", "gen_tokens_per_s"}


@pytest.fixture(scope="module")
def tiny_path():
    return testing.model_path("tiny")


@pytest.fixture(scope="module")
def vocab(tiny_path):
    from llamabatch._ffi.model import Model

    model = Model(tiny_path)
    yield model
    model.close()


def _json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_bench_cli_json_raw_and_llama_cpp_python(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--npl", "1,2", "--npp", "8", "--ntg", "4", "-t", "2"]
    assert main([*argv, "--json", "--raw", "--compare", "llama-cpp-python", "--no-progress"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert len(rows) == 6
    assert {(r["runner"], r["npl"]) for r in rows} == {
        (runner, npl) for runner in ("llamabatch", "raw", "llama-cpp-python") for npl in (1, 2)
    }
    for row in rows:
        assert REQUIRED <= row.keys()
        assert (row["npp"], row["ntg"], row["workload"]) == (8, 4, "batched")
        assert row["prompt_tokens"] == 8 * row["npl"]
        assert row["gen_tokens"] == 4 * row["npl"]
        assert row["total_tokens_per_s"] > row["gen_tokens_per_s"] > 0
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] >= 0
    for row in rows:
        if row["runner"] == "llamabatch":
            for key in ("vs_raw_total", "vs_raw_gen", "vs_llama_cpp_python_total", "vs_llama_cpp_python_gen"):
                assert row[key] > 0
            assert 0 <= row["outside_decode_share"] <= 1
            assert row["ticks"] >= 4


def test_bench_cli_table(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--npl", "2", "--npp", "8", "--ntg", "4", "-t", "2", "--raw"]
    assert main([*argv, "--no-progress", "--stream", "--kv-unified", "off", "-fa", "on"]) == 0
    out = capsys.readouterr().out
    assert "llamabatch |" in out and "raw |" in out
    assert "S t/s" in out and "TTFT p50" in out and "kv_unified off" in out
    assert "llamabatch vs" in out  # the ratio table


def test_bench_cli_mixed_workload(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--workload", "mixed", "--requests", "6", "--rate", "200"]
    argv += ["--mix", "8:4,16:2:2", "--n-parallel", "3", "-t", "2", "--json", "--no-progress"]
    assert main([*argv, "--compare", "llama-cpp-python"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert [r["runner"] for r in rows] == ["llamabatch", "llama-cpp-python"]
    for row in rows:
        assert REQUIRED <= row.keys()
        assert row["workload"] == "mixed" and row["rate"] == 200 and row["n_requests"] == 6
    assert rows[0]["gen_tokens"] == rows[1]["gen_tokens"]


def test_bench_cli_errors(tiny_path, capsys, monkeypatch):
    assert main(["bench", "-m", str(tiny_path), "--npl", "0"]) == 2
    assert "--npl" in capsys.readouterr().err
    assert main(["bench", "-m", "/nonexistent.gguf"]) == 2
    assert "no model file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["bench", "-m", str(tiny_path), "--plot", "out.png"]) == 2
    assert "pip install 'llamabatch[plot]'" in capsys.readouterr().err


def test_bench_plot(tiny_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    argv = ["bench", "-m", str(tiny_path), "--npl", "1,2", "--npp", "8", "--ntg", "2", "-t", "2"]
    assert main([*argv, "--raw", "--no-progress", "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000


def test_make_prompts_exact_lengths_distinct_starts(vocab):
    prompts = bench.make_prompts(vocab, [8, 16, 1, 64] * 4, seed=3)
    assert [len(p) for p in prompts] == [8, 16, 1, 64] * 4
    assert len({p[0] for p in prompts}) == len(prompts)
    assert prompts == bench.make_prompts(vocab, [8, 16, 1, 64] * 4, seed=3)
    assert all(0 <= t < vocab.n_vocab for p in prompts for t in p)


def test_mixed_requests_and_mix(vocab):
    mix = bench.parse_mix("8:4, 32:2:3")
    assert mix == ((8, 4, 1.0), (32, 2, 3.0))
    requests = bench.mixed_requests(vocab, 50, rate=10.0, mix=mix, seed=1)
    arrivals = [r.arrival for r in requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert {(len(r.prompt), r.max_tokens) for r in requests} == {(8, 4), (32, 2)}
    for bad in ("8", "8:x", "0:4", "8:4:-1", ""):
        with pytest.raises(ValueError):
            bench.parse_mix(bad)


def test_ratio_rows():
    def row(runner, total, gen):
        return {
            "workload": "batched",
            "runner": runner,
            "npp": 8,
            "ntg": 4,
            "npl": 2,
            "total_tokens_per_s": total,
            "gen_tokens_per_s": gen,
            "ttft_p50_ms": 1.0,
        }

    rows = [row("llamabatch", 300.0, 100.0), row("raw", 310.0, 110.0), row("llama-cpp-python", 100.0, 25.0)]
    ratios = bench.ratio_rows(rows)
    assert {r["baseline"]: round(r["gen_ratio"], 3) for r in ratios} == {
        "raw": round(100 / 110, 3),
        "llama-cpp-python": 4.0,
    }
    assert rows[0]["vs_llama_cpp_python_total"] == 3.0
    assert "llamabatch vs" in bench.format_ratios(ratios)


def test_rss_flat_from_100_to_2000_requests():
    from llamabatch.bench.memory import rss_after_requests

    rss = rss_after_requests("tiny", (100, 2000), n_threads=2)
    growth = rss[2000] / rss[100] - 1.0
    assert growth <= 0.05, f"RSS grew {growth:.1%} from 100 to 2,000 requests ({rss})"
