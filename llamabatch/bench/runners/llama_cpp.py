"""llama-cpp-python as a runner: ``Llama.create_completion``, one request after another."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from llamabatch.bench.report import RunResult, result_from_times
from llamabatch.bench.runners.base import LLAMA_CPP_PYTHON, BenchConfig, wait_until
from llamabatch.bench.workloads import BenchRequest, open_tokenizer

__all__ = ["LlamaCppRunner", "load_llama_cpp"]

_load_lock = threading.Lock()


def load_llama_cpp(model: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``llama_cpp.Llama(model, **kwargs)`` with weights in the buffer types llamabatch uses:
    llama-cpp-python exposes no ``use_extra_bufts``, and on a build with AMX kernels the
    extra ones crash (``llamabatch/_ffi/cpu_backend.py``), so its default model parameters
    are amended while it loads. llama.cpp's log stays routed to llamabatch's logger
    (importing llama-cpp-python sets a log callback of its own)."""
    import llama_cpp
    from llama_cpp import llama_cpp as low

    from llamabatch._ffi import log
    from llamabatch._ffi.cpu_backend import use_extra_bufts

    log.install()
    if use_extra_bufts():
        return llama_cpp.Llama(str(model), **kwargs)
    with _load_lock:
        defaults = low.llama_model_default_params

        def without_extra_bufts() -> Any:
            params = defaults()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = without_extra_bufts
        try:
            return llama_cpp.Llama(str(model), **kwargs)
        finally:
            low.llama_model_default_params = defaults


class LlamaCppRunner:
    """llama-cpp-python serving the requests one after another, as its users would.

    Each request is ``Llama.create_completion(prompt_token_ids, max_tokens=ntg,
    temperature=0)`` with the same thread count, batch size and flash-attention setting as
    the engine; a request arriving while another runs waits. Token times come from a
    stopping-criteria callback that llama-cpp-python calls once per sampled token and that
    never stops the generation. A request that ends early on an end-of-generation token is
    run again with those tokens banned (logit bias), and the row says so.
    """

    name = LLAMA_CPP_PYTHON

    def __init__(self, config: BenchConfig, n_ctx: int) -> None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as exc:  # pragma: no cover - a dependency of llamabatch
            raise ImportError("--compare llama-cpp-python needs the llama-cpp-python package") from exc
        self.config = config
        self.n_ctx = n_ctx
        self.llama = load_llama_cpp(
            config.model,
            n_ctx=n_ctx,
            n_batch=config.n_batch,
            n_ubatch=config.micro_batch,
            n_threads=config.threads,
            n_threads_batch=config.threads,
            flash_attn=config.flash_attn,
            verbose=False,
        )
        vocab = open_tokenizer(config.model)
        try:
            self._eog = [t for t in range(vocab.n_vocab) if vocab.is_eog(t)]
        finally:
            vocab.close()

    def warmup(self, tokens: Sequence[int]) -> None:
        """Two tokens from a short prompt."""
        self.llama.create_completion(list(tokens[:8]), max_tokens=2, temperature=0)
        self.llama.reset()

    def _complete(self, request: BenchRequest, ban_eog: bool) -> tuple[list[float], int]:
        from llama_cpp import StoppingCriteriaList

        stamps: list[float] = []
        now = time.perf_counter

        def stamp(_ids: Any, _logits: Any) -> bool:
            stamps.append(now())
            return False

        out = self.llama.create_completion(
            list(request.prompt),
            max_tokens=request.max_tokens,
            temperature=0,
            repeat_penalty=1.0,
            stopping_criteria=StoppingCriteriaList([stamp]),
            logit_bias={t: -math.inf for t in self._eog} if ban_eog else None,
        )
        n = int(out["usage"]["completion_tokens"])  # type: ignore[index]
        return stamps[:n], n

    def run(
        self, requests: Sequence[BenchRequest], workload: str, npl: int, rate: float | None = None
    ) -> RunResult:
        """Serve ``requests`` in arrival order, one at a time."""
        n = len(requests)
        order = sorted(range(n), key=lambda i: requests[i].arrival)
        first, end, counts = [0.0] * n, [0.0] * n, [0] * n
        itl: list[float] = []
        banned = 0
        t_pp = 0.0
        start = time.perf_counter()
        for i in order:
            request = requests[i]
            wait_until(start + request.arrival)
            t_begin = time.perf_counter()
            stamps, count = self._complete(request, ban_eog=False)
            if count < request.max_tokens:
                banned += 1
                stamps, count = self._complete(request, ban_eog=True)
            end[i] = time.perf_counter()
            if count != request.max_tokens or not stamps:
                raise RuntimeError(
                    f"llama-cpp-python generated {count} tokens, expected {request.max_tokens}"
                )
            first[i] = stamps[0]
            t_pp += stamps[0] - t_begin
            counts[i] = count
            itl.extend(np.diff(stamps).tolist())
        self.llama.reset()
        result = result_from_times(
            self.name, workload, requests, first, end, counts, itl, start, npl, rate, t_pp
        )
        if banned:
            result.notes.append(f"{banned} request(s) re-run with end-of-generation tokens banned")
        return result

    def close(self) -> None:
        """Free the model."""
        self.llama.close()
