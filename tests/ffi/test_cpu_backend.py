"""Weights and the extra CPU buffer types (``llamabatch/_ffi/cpu_backend.py``): a quantized model
must decode on every CPU, AMX ones included, where the pinned llama.cpp's AMX kernels (built by
GCC) die with SIGILL on their first matrix product."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from llamabatch._ffi import cpu_backend
from llamabatch.gguf.testing import PRESETS, model_path

#: the tiny shape with Q8_0 weights: the type AMX kernels take (and the 135M test model's)
TINY_Q8 = dataclasses.replace(PRESETS["tiny"], dtype="Q8_0", name="llamabatch-tiny-q8_0")

DECODE = """
import sys
from llamabatch import LLM, SamplingParams
with LLM(sys.argv[1], n_ctx=512, n_parallel=2, n_threads=2) as llm:
    params = SamplingParams(max_tokens=4, temperature=0)
    outs = llm.generate(["a b c d e f", "g h i j"], params, use_tqdm=False)
    print(sum(len(o.outputs[0].token_ids) for o in outs))
"""


def _decode(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", DECODE, str(model_path(TINY_Q8))],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_quantized_model_decodes_a_batch_on_this_cpu() -> None:
    proc = _decode()  # a subprocess: SIGILL would end the test run
    assert proc.returncode == 0, f"exit code {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.split()[-1] == "8"


def test_extra_buffer_types_follow_the_build_and_the_environment(monkeypatch) -> None:
    info = cpu_backend.system_info()
    assert "CPU :" in info
    monkeypatch.delenv(cpu_backend.EXTRA_BUFTS_ENV, raising=False)
    assert cpu_backend.use_extra_bufts() is ("AMX_INT8 = 1" not in info)
    monkeypatch.setenv(cpu_backend.EXTRA_BUFTS_ENV, "0")
    assert cpu_backend.use_extra_bufts() is False
    monkeypatch.setenv(cpu_backend.EXTRA_BUFTS_ENV, "1")
    assert cpu_backend.use_extra_bufts() is True


@pytest.mark.skipif(not cpu_backend.has_amx_build(), reason="the CPU backend has no AMX kernels here")
def test_the_amx_kernels_are_what_crashes() -> None:
    """The reason for the default: with extra buffer types forced on, an AMX build dies. When
    this fails, the llama.cpp build has the fix (PR #26954) and the default can change."""
    import os

    proc = _decode({**os.environ, cpu_backend.EXTRA_BUFTS_ENV: "1"})
    assert proc.returncode != 0
