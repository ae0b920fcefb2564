"""docs/slo_sweep.py (SLO attainment against the rate, ours and llama-server's) without real
servers: the attainment plot, the tables and target checks from synthetic rows, one point
measured against a fake server, and the servers stopped however the sweep ends."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_bench import _FakeServer

from llamabatch.bench.plots import plot_attainment

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "slo_sweep.py"


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slo_sweep", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(server: str, rate: float, share: float, tok_s: float, ttft: float, itl: float) -> dict[str, Any]:
    return {
        "server": server,
        "rate": rate,
        "n_requests": 10,
        "goodput": share,
        "attainment_pct": 100.0 * share,
        "goodput_rps": share * rate,
        "total_tokens_per_s": tok_s,
        "ttft_p50_ms": ttft,
        "ttft_p90_ms": 2 * ttft,
        "itl_p99_ms": itl,
        "itl_max_ms": 3 * itl,
    }


def _rows(sweep: ModuleType) -> list[dict[str, Any]]:
    return [
        _row(sweep.OURS_SLO, 0.2, 1.0, 100.0, 300.0, 30.0),
        _row(sweep.LLAMA_SERVER, 0.2, 0.9, 110.0, 300.0, 30.0),
        _row(sweep.OURS_NO_SLO, 0.2, 0.8, 100.0, 360.0, 25.0),
        _row(sweep.OURS_SLO, 0.5, 0.6, 200.0, 2000.0, 240.0),
        _row(sweep.LLAMA_SERVER, 0.5, 0.3, 210.0, 1500.0, 900.0),
    ]


def test_plot_attainment_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row("ours", 0.1, 1.0, 50.0, 1, 1), _row("ours", 0.5, 0.4, 90.0, 1, 1)]
    rows += [_row("theirs", 0.5, 0.2, 95.0, 1, 1), {**_row("theirs", 0.1, 0, 48.0, 1, 1), "goodput": None}]
    out = plot_attainment(rows, tmp_path / "a.png", title="synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_checks(sweep):
    checks = {(c["check"], c["server"], c["metric"]): c for c in sweep.target_checks(_rows(sweep), 0.5, 0.2)}
    heavy = checks[("heavy (0.5/s)", sweep.OURS_SLO, "SLO met")]
    assert heavy["ratio"] == pytest.approx(2.0) and heavy["met"] == "yes"
    tokens = checks[("heavy (0.5/s)", sweep.OURS_SLO, "total tok/s")]
    assert tokens["ratio"] == pytest.approx(200 / 210) and tokens["met"] == "yes"
    assert checks[("light (0.2/s)", sweep.OURS_SLO, "TTFT p50")]["met"] == "yes"
    slow = checks[("light (0.2/s)", sweep.OURS_NO_SLO, "TTFT p50")]
    assert slow["ratio"] == pytest.approx(1.2) and slow["met"] == "no"
    assert len(checks) == 6
    # a rate llama-server did not run: no check, no error
    assert sweep.target_checks(_rows(sweep)[:1], 0.5, 0.2) == []


def test_write_results(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    settings = {
        "model": "/m/model.gguf",
        "mix": sweep.HEAVY_MIX,
        "requests": 10,
        "slo_ttft_ms": 4000.0,
        "slo_itl_ms": 250.0,
        "heavy_rate": 0.5,
        "light_rate": 0.2,
        "server_args": "-np 8 -c 16384 -t 2",
    }
    paths = sweep.write_results({"settings": settings, "rows": _rows(sweep)}, tmp_path)
    assert [p.name for p in paths] == ["slo-sweep.json", "slo-sweep.md", "slo-sweep.png"]
    text = paths[1].read_text()
    assert "SLO met %" in text and " 2.00x | >= 1.5x | yes |" in text and "llama-server" in text
    # redrawn from the JSON alone, into another directory
    again = tmp_path / "again"
    assert sweep.main(["--from-json", str(paths[0]), "--out", str(again)]) == 0
    assert (again / "slo-sweep.md").read_text() == text and (again / "slo-sweep.png").stat().st_size > 0


def test_measure_one_point_against_a_server(sweep, tiny_path):
    server = _FakeServer(delay=0.001)
    try:
        row = sweep.measure(
            server.url, tiny_path, 50.0, 4, mix="8:4,16:4", slo_ttft_ms=10_000, slo_itl_ms=1000
        )
    finally:
        server.close()
    assert row["n_requests"] == 4 and row["rate"] == 50.0
    assert row["attainment_pct"] == 100.0 and row["goodput_rps"] == pytest.approx(row["requests_per_s"])
    assert len([b for b in server.bodies if b["max_tokens"] == 4]) == 4  # + the warm-up


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its reaper."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_server_that_never_gets_ready_is_stopped(sweep, tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    url = f"http://127.0.0.1:{sweep.free_port()}"
    with pytest.raises(RuntimeError, match="not ready"):
        with sweep.running_server([sys.executable, "-c", code], url, tmp_path / "log", ready_timeout=2):
            pass
    assert _gone(int(pid_file.read_text()))


HEALTHY = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_is_stopped_when_the_sweep_fails(sweep, tmp_path):
    port = sweep.free_port()
    with pytest.raises(ValueError, match="mid-sweep"):
        with sweep.running_server(
            [sys.executable, "-c", HEALTHY, str(port)], f"http://127.0.0.1:{port}", tmp_path / "log"
        ) as process:
            raise ValueError("mid-sweep")
    assert process.poll() is not None and _gone(process.pid)


def test_a_crashing_server_is_reported(sweep, tmp_path):
    url = f"http://127.0.0.1:{sweep.free_port()}"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3"):
        with sweep.running_server([sys.executable, "-c", "print('boom'); exit(3)"], url, tmp_path / "log"):
            pass
    assert time.monotonic() - started < 30


SWEEPER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("slo_sweep", sys.argv[1])
sweep = importlib.util.module_from_spec(spec); spec.loader.exec_module(sweep)
port = sweep.free_port()
argv = [sys.executable, "-c", sys.argv[2], str(port)]
with sweep.signals_as_exit():
    with sweep.running_server(argv, f"http://127.0.0.1:{port}", sys.argv[3] + ".log") as server:
        open(sys.argv[3], "w").write(str(server.pid))
        time.sleep(120)
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_no_orphan_server_when_the_sweep_is_killed(tmp_path, how):
    """SIGTERM: the sweep stops its server on the way out; SIGKILL: the server gets SIGTERM
    from the kernel when its parent dies (Linux)."""
    if how == "SIGKILL" and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    pid_file = tmp_path / "server.pid"
    server_pid: int | None = None
    sweeper = subprocess.Popen([sys.executable, "-c", SWEEPER, str(SCRIPT), HEALTHY, str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and sweeper.poll() is None, "the server did not start"
            time.sleep(0.1)
        server_pid = int(pid_file.read_text())
        sweeper.send_signal(getattr(signal, how))
        sweeper.wait(30)
        deadline = time.monotonic() + 20
        while not _gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(server_pid), f"the server outlived the sweep ({how})"
    finally:
        if sweeper.poll() is None:
            sweeper.kill()
            sweeper.wait()
        if server_pid is not None and not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)  # the test failed: leave no orphan behind
