"""Latency measurements: goodput under an SLO, the capacity search, ITL over time, the
engine with and without ``--target-itl-ms``, and ``priority`` in the server's body."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
from test_bench import _FakeServer, _json_rows

from llamabatch import LLM
from llamabatch.bench import latency
from llamabatch.bench.report import RunResult, goodput, result_from_times
from llamabatch.bench.workloads import BenchRequest
from llamabatch.cli import main


@pytest.fixture
def fake_server() -> Iterator[_FakeServer]:
    server = _FakeServer(delay=0.001)
    yield server
    server.close()


def _result(rate: float, itl_ms: float, ttft_ms: float = 1.0) -> RunResult:
    return RunResult(
        runner="server",
        workload="mixed",
        npp=8,
        ntg=4,
        npl=1,
        n_requests=2,
        prompt_tokens=16,
        gen_tokens=8,
        t_pp=1.0,
        t_total=1.0,
        ttft=[ttft_ms / 1000.0] * 2,
        itl=[itl_ms / 1000.0] * 6,
        rate=rate,
        request_itl=[itl_ms / 1000.0] * 2,
        slo_itl_ms=100.0,
    )


def test_goodput():
    assert goodput([0.1, 0.5, 0.2], [0.01, 0.01, 0.3], 300.0, 100.0) == pytest.approx(1 / 3)
    assert goodput([0.1, 0.5], [0.01, math.nan], None, 100.0) == 1.0  # a one-token request
    assert math.isnan(goodput([], [], 1.0, 1.0))
    row = _result(1.0, 50.0).row()
    assert row["goodput"] == 1.0 and row["slo_met"] is True
    assert row["itl_p99_9_ms"] == pytest.approx(50.0) and row["itl_max_ms"] == pytest.approx(50.0)
    assert _result(1.0, 150.0).row()["slo_met"] is False


def test_one_definition_of_met_no_gap_over_the_itl_slo():
    """A request whose gaps are 200 of 10 ms and one of 300 ms: its ITL p99 (10 ms) is under a
    250 ms SLO, its largest gap is not. The engine (``Timings.slo_met``), the bench's goodput
    and ``LatencyTracker`` all count it as missed: no gap over the SLO."""
    from llamabatch.generate.request import slo_attainment
    from llamabatch.runtime.latency import LatencyTracker
    from llamabatch.runtime.telemetry import RequestEvent

    start = 100.0
    stamps = [start + 0.1 + 0.01 * i for i in range(201)]
    stamps.append(stamps[-1] + 0.3)
    request = BenchRequest((1,) * 8, 202)
    result = result_from_times(
        "engine", "mixed", [request], [stamps[0]], [stamps[-1]], [202], [], start, 1, None, stamps=[stamps]
    )
    result.slo_ttft_ms, result.slo_itl_ms = 4000.0, 250.0
    assert result.row()["goodput"] == 0.0
    assert goodput([0.1], [0.3], 4000.0, 250.0) == 0.0 and goodput([0.1], [0.249], 4000.0, 250.0) == 1.0
    assert slo_attainment((4.0, 0.25), 0.1, 0.3, "length") == (True, False, False)
    tracker = LatencyTracker()
    tracker(RequestEvent(0, "length", 8, 202, 0, 0.0, 0.1, 2.1, None, None, itl_p99=0.01, itl_max=0.3))
    assert tracker.summary(slo_ttft_ms=4000.0, slo_itl_ms=250.0)["goodput"] == 0.0
    assert tracker.summary(slo_ttft_ms=4000.0, slo_itl_ms=300.0)["goodput"] == 1.0


def test_find_capacity_doubles_then_bisects():
    def probe(rate: float) -> RunResult:  # the SLO holds up to 3 requests/s (ITL grows with the rate)
        return _result(rate, 100.0 * rate / 3.0)

    found, runs = latency.find_capacity(probe, 1.0, steps=6)
    assert [r.rate for r in runs] == [1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    assert found == 3.0
    found, runs = latency.find_capacity(lambda r: _result(r, 1e6), 1.0, steps=3)
    assert found is None and [r.rate for r in runs] == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError):
        latency.find_capacity(probe, 0.0)


def test_find_capacity_by_goodput():
    import dataclasses

    def probe(rate: float) -> RunResult:  # one request of two misses the SLO above 3 requests/s
        run = _result(rate, 10.0)
        if rate > 3:
            run = dataclasses.replace(run, request_itl=[0.01, 1.0])
        return run

    assert probe(4.0).row()["goodput"] == 0.5
    found, _ = latency.find_capacity(probe, 1.0, steps=6, meets=latency.goodput_at_least(0.9))
    assert found == 3.0
    found, _ = latency.find_capacity(probe, 1.0, steps=4, meets=latency.goodput_at_least(0.5))
    assert found == 8.0


def test_bench_serve_find_capacity_by_goodput(tiny_path, fake_server, capsys):
    argv = ["bench-serve", "--url", fake_server.url, "-m", str(tiny_path), "--workload", "mixed"]
    argv += ["--requests", "4", "--rate", "200", "--mix", "8:3", "--no-progress", "--no-warmup"]
    argv += ["--find-capacity", "--capacity-steps", "2", "--slo-itl-ms", "5000"]
    assert main([*argv, "--min-goodput", "0.9", "--json"]) == 0
    (capacity,) = [r for r in _json_rows(capsys.readouterr().out) if "capacity_rate" in r]
    assert capacity["capacity_rate"] == 400
    with pytest.raises(SystemExit, match="--min-goodput"):
        main([*argv, "--min-goodput", "1.5"])


def test_bench_serve_find_capacity(tiny_path, fake_server, capsys):
    argv = ["bench-serve", "--url", fake_server.url, "-m", str(tiny_path), "--workload", "mixed"]
    argv += ["--requests", "4", "--rate", "200", "--mix", "8:3", "--no-progress", "--no-warmup"]
    assert main([*argv, "--find-capacity", "--capacity-steps", "3", "--slo-itl-ms", "5000", "--json"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    runs = [r for r in rows if r.get("runner") == "server"]
    assert [r["rate"] for r in runs] == [200, 400, 800]
    assert all(r["slo_met"] and r["goodput"] == 1.0 for r in runs)
    (capacity,) = [r for r in rows if "capacity_rate" in r]
    assert capacity["capacity_rate"] == 800 and capacity["slo_itl_ms"] == 5000
    # an SLO nothing meets
    assert main([*argv, "--find-capacity", "--capacity-steps", "2", "--slo-itl-ms", "0.0001"]) == 0
    out = capsys.readouterr().out
    assert "capacity under the SLO" in out
    with pytest.raises(SystemExit, match="needs --slo-itl-ms"):
        main([*argv, "--find-capacity"])


def test_bench_target_side_by_side_and_itl_plot(tiny_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "itl.png"
    argv = ["bench", "-m", str(tiny_path), "--workload", "mixed", "--requests", "6", "--rate", "100"]
    argv += ["--mix", "64:4,8:6", "-t", "2", "--no-progress", "--target-itl-ms", "20"]
    argv += ["--baseline-no-target", "--slo-itl-ms", "1000", "--slo-ttft-ms", "10000", "--plot-itl", str(png)]
    assert main([*argv, "--json"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert {r["runner"] for r in rows} == {"llamabatch", "engine-no-target"}
    for row in rows:
        assert row["target_itl_ms"] == 20
        assert 0.0 <= row["goodput"] <= 1.0
        for key in ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_p99_9_ms", "itl_max_ms", "ttft_p90_ms"):
            assert key in row
    assert png.stat().st_size > 1000


def test_server_priority_field(tiny_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import serve

    from llamabatch.server import create_app

    with LLM(tiny_path, n_ctx=1024, n_parallel=1, n_threads=1) as llm, serve(create_app(llm)) as url:
        for path, extra in (
            ("/v1/completions", {"prompt": "hello"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            for stream in (False, True):
                body = {"model": "x", "max_tokens": 3, "priority": -2, "stream": stream, **extra}
                response = httpx.post(url + path, json=body, timeout=30)
                assert response.status_code == 200, response.text
            bad = httpx.post(url + path, json={**extra, "model": "x", "priority": "high"}, timeout=30)
            assert bad.status_code == 400 and "priority" in json.dumps(bad.json())
