"""docs/lora_contexts_bench.py runs end to end, small, on the tiny test model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llamabatch.testing import model_path

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "lora_contexts_bench.py"


def test_lora_contexts_bench_runs_small(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--model", str(model_path("tiny")), "--rounds", "4"]
    argv += ["--slots", "2", "--threads", "1", "--n-ubatch", "64", "--merged"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for line in ("tick after switch", "re-plan after a switch", "a second:", "two contexts", "merged"):
        assert line in out, out
