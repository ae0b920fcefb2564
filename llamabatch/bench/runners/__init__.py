"""The runners: what serves a workload's requests and times them.

- :class:`EngineRunner` (``llamabatch``): the engine, through the public API (``LLM``);
- :class:`RawRunner` (``raw``): the same static batch straight through the binding, with no
  scheduler: the engine's ceiling (batched workload only);
- :class:`LlamaCppRunner` (``llama-cpp-python``): ``Llama.create_completion``, one request
  after another, as a llama-cpp-python user serves them;
- :class:`HTTPRunner` (``server``): concurrent streaming clients of a running
  OpenAI-compatible server (``llamabatch serve``, ``llama-server``, vLLM).

Every runner generates exactly ``ntg`` tokens per request (greedy, end-of-generation
ignored) from the same prompt token ids, so the work is identical.
"""

from llamabatch.bench.runners.base import ENGINE, HTTP, LLAMA_CPP_PYTHON, RAW, BenchConfig, Runner
from llamabatch.bench.runners.engine import EngineRunner
from llamabatch.bench.runners.http import HTTPRunner
from llamabatch.bench.runners.llama_cpp import LlamaCppRunner
from llamabatch.bench.runners.raw import RawRunner

__all__ = [
    "ENGINE",
    "HTTP",
    "LLAMA_CPP_PYTHON",
    "RAW",
    "BenchConfig",
    "EngineRunner",
    "HTTPRunner",
    "LlamaCppRunner",
    "RawRunner",
    "Runner",
]
