"""``LLM``: the generation facade — model, context and engine behind a small API."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from llamabatch._ffi.chat import apply_template
from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch._ffi.sampler import SamplerChain
from llamabatch.engine import Engine
from llamabatch.errors import EngineClosed, PromptTooLong
from llamabatch.outputs import CompletionOutput, Delta
from llamabatch.params import SamplingParams, check_positive_int
from llamabatch.request import _END, Request, RequestHandle
from llamabatch.telemetry import Listener, Telemetry

Prompt = str | Sequence[int]

_DEFAULT_PARAMS = SamplingParams()


class LLM:
    """Many concurrent generations from one GGUF model, batched into one forward pass per tick.

    Args:
        model_path: the ``.gguf`` file.
        n_ctx: KV cache size in tokens, shared by all sequences (unified KV cache).
        n_parallel: sequences decoded together (slots).
        n_batch: the most tokens in one forward pass (the per-tick token budget).
        n_ubatch: the physical micro-batch llama.cpp computes at once (<= n_batch).
        chunk_size: the most prompt tokens one sequence prefills per tick.
        strategy: ``"decode_maximal"`` (default), ``"prefill_priority"``, ``"balanced"``,
            or a strategy object (see ``llamabatch._core.strategies``).
        max_queue: requests allowed to wait for a slot; beyond it ``submit`` raises
            ``QueueFull``.
        n_threads: CPU threads for llama.cpp (default: all cores).
        n_gpu_layers: layers to offload to a GPU (-1: all; needs a GPU build).
        flash_attn: ``True``, ``False`` or ``None``/``"auto"``.
        load_mode: how the weights are loaded (``"mmap"``, ``"none"``, ...).
        prefix_cache: reuse the KV of a matching prompt prefix from any slot (busy or
            idle) or pinned prefix, copied with ``llama_memory_seq_cp`` (default on).
        max_prefixes: how many prefixes ``register_prefix`` may pin at once.
        kv_unified: one KV buffer shared by all sequences (default: any sequence may use
            up to ``n_ctx`` cells, and prefix copies share cells). ``False`` gives each
            sequence (``n_parallel + max_prefixes`` of them) ``n_ctx / n_seq_max`` cells of its
            own: attention then spans only a sequence's own cells, much faster with many
            slots; prefixes are then reused by copying whole streams.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_ctx: int = 4096,
        n_parallel: int = 8,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        chunk_size: int = 512,
        strategy: Any = "decode_maximal",
        max_queue: int = 1024,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int = 0,
        flash_attn: bool | str | None = None,
        load_mode: str = "mmap",
        prefix_cache: bool = True,
        max_prefixes: int = 4,
        kv_unified: bool = True,
    ) -> None:
        self._engine: Engine | None = None
        check_positive_int("n_ctx", n_ctx)
        check_positive_int("n_parallel", n_parallel)
        check_positive_int("n_batch", n_batch)
        check_positive_int("chunk_size", chunk_size)
        check_positive_int("max_queue", max_queue)
        if not isinstance(max_prefixes, int) or max_prefixes < 0:
            raise ValueError(f"max_prefixes must be an int >= 0, got {max_prefixes!r}")
        if n_parallel > n_ctx:
            raise ValueError(f"n_parallel ({n_parallel}) must be <= n_ctx ({n_ctx})")
        self.model = Model(model_path, n_gpu_layers=n_gpu_layers, load_mode=load_mode)
        try:
            if not self.model.has_decoder or self.model.has_encoder:
                raise ValueError(f"{self.model.path.name} is not a decoder-only model; use Embedder for it")
            self.context = Context(
                self.model,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=n_ubatch,
                n_seq_max=n_parallel + max_prefixes,  # pinned prefixes live in sequences of their own
                n_threads=n_threads,
                n_threads_batch=n_threads_batch,
                flash_attn=flash_attn,
                kv_unified=kv_unified,
            )
            self.telemetry = Telemetry()
            self._engine = Engine(
                self.model,
                self.context,
                n_parallel=n_parallel,
                n_batch=n_batch,
                chunk_size=chunk_size,
                strategy=strategy,
                max_queue=max_queue,
                telemetry=self.telemetry,
                prefix_cache=prefix_cache,
                n_pinned_max=max_prefixes,
            )
        except BaseException:
            self.model.close()
            raise
        self.n_ctx = self.context.n_ctx
        self.n_ctx_seq = self.context.n_ctx_seq
        self.n_parallel = n_parallel
        self.n_batch = n_batch

    # -- requests -----------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._engine._closing:
            raise EngineClosed("the LLM is closed")
        return self._engine

    def _prompt_tokens(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            tokens = self.model.tokenize(prompt, add_special=True, parse_special=True)
        else:
            tokens = list(prompt)
            if not tokens:
                raise ValueError("the prompt is empty")
            for t in tokens:
                if not isinstance(t, int) or not 0 <= t < self.model.n_vocab:
                    raise ValueError(f"prompt token {t!r} is not a token id in [0, {self.model.n_vocab})")
        if not tokens:
            raise ValueError("the prompt tokenizes to nothing")
        limit = self.n_ctx_seq - params.max_tokens
        if len(tokens) > limit:
            if params.truncate and limit > 0:
                tokens = tokens[len(tokens) - limit :]
            else:
                raise PromptTooLong(
                    f"prompt of {len(tokens)} tokens + max_tokens {params.max_tokens} exceeds the "
                    f"per-sequence context of {self.n_ctx_seq} tokens"
                    + ("" if params.truncate else " (set SamplingParams(truncate=True) to keep its end)")
                )
        return tokens

    def _make_requests(self, prompt: Prompt, params: SamplingParams | None) -> list[Request]:
        params = _DEFAULT_PARAMS if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        tokens = self._prompt_tokens(prompt, params)
        requests: list[Request] = []
        for i in range(params.n):
            request = Request(tokens, params, index=i)
            if i:  # followers wait for the leader's prompt and copy its KV
                request.group = requests[0]
            # Built here, on the caller's thread, so a bad grammar raises at submit.
            sampler_params = params if params.seed is None or i == 0 else _with_seed(params, params.seed + i)
            request.sampler = SamplerChain(self.model, sampler_params)
            requests.append(request)
        return requests

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Queue one prompt (text or token ids); returns at once. Thread-safe.

        Raises ``ValueError`` for an empty prompt or bad params, ``PromptTooLong`` when
        prompt + max_tokens do not fit, ``QueueFull`` beyond ``max_queue``."""
        engine = self.engine
        requests = self._make_requests(prompt, params)
        engine.submit(requests)
        return RequestHandle(requests, engine)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt concurrently; outputs in input order (for ``n > 1``, a
        prompt's completions follow each other)."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]  # one prompt: text or token ids
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        params_list: list[SamplingParams | None]
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        engine = self.engine
        batches = [self._make_requests(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
        for requests in batches:
            for request in requests:
                request.streaming = False  # only the results are wanted: no per-token deltas
        handles = []
        try:
            for requests in batches:
                engine.submit(requests, block=True)  # wait for queue room rather than fail
                handles.append(RequestHandle(requests, engine))
            return [out for handle in handles for out in handle.results()]
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[Delta]:
        """Yield deltas as tokens arrive; closing the iterator early cancels the request."""
        handle = self.submit(prompt, params)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """Async iterator of deltas; cancelling the consuming task cancels the request."""
        engine = self.engine
        requests = self._make_requests(prompt, params)
        if len(requests) != 1:
            raise ValueError("astream serves one completion; use agenerate for n > 1")
        request = requests[0]
        loop = asyncio.get_running_loop()
        aqueue: asyncio.Queue[Any] = asyncio.Queue()
        engine.attach_async(request, loop, aqueue)
        engine.submit(requests)
        try:
            while True:
                item = await aqueue.get()
                if item is _END:
                    return
                yield item
        finally:
            if not request.done:
                engine.cancel(request)

    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None) -> CompletionOutput:
        """Await one completion (the first when ``n > 1``)."""
        final = None
        async for delta in self.astream(prompt, params):
            final = delta.output or final
        assert final is not None
        return final

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams | None = None,
        template: str | None = None,
    ) -> CompletionOutput:
        """One chat completion, formatted with the GGUF's chat template (or ``template``)."""
        return self.generate(self.apply_chat_template(messages, template), params)[0]

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], template: str | None = None) -> str:
        """The prompt text for ``messages`` under the model's chat template."""
        template = template or self.model.chat_template
        if template is None:
            raise ValueError(
                f"{self.model.path.name} has no chat template; pass template=... (e.g. 'chatml')"
            )
        return apply_template(template, messages, add_assistant=True)

    # -- prefixes ------------------------------------------------------------------------

    def register_prefix(self, prefix: Prompt, timeout: float | None = None) -> PrefixHandle:
        """Compute ``prefix`` (text or token ids) once and keep its KV for every request that
        starts with it (a shared system prompt), until ``release()``. Blocks until computed.

        A text prefix is tokenized as prompts are (with BOS), so it matches requests whose
        prompt text starts with it at a token boundary."""
        from llamabatch.prefix_cache import PinnedPrefix

        engine = self.engine
        params = SamplingParams(max_tokens=1, temperature=0)
        tokens = self._prompt_tokens(prefix, params)
        if len(tokens) < 2:
            raise ValueError("a prefix must be at least 2 tokens long to be worth pinning")
        seq_id = engine.call(engine.prefix_cache.new_pin_seq, timeout)
        pinned = PinnedPrefix(seq_id, tokens, prefix if isinstance(prefix, str) else None)
        # Computed like a prompt in a slot, then copied into its own sequence.
        request = Request(tokens, params)
        request.pin = pinned
        engine.submit([request], block=True, timeout=timeout)
        if not request.wait(timeout) or request.finish_reason != "stop":
            engine.call(lambda: engine.prefix_cache.drop_pin_seq(seq_id))
            raise RuntimeError(f"could not compute the prefix: {request.error or request.finish_reason}")
        return PrefixHandle(self, pinned)

    def clear_prefix_cache(self) -> None:
        """Drop the prompt tokens idle slots keep for reuse (pinned prefixes stay)."""
        engine = self.engine
        engine.call(engine.prefix_cache.clear)

    # -- tokens, telemetry, lifetime -----------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` under the model's vocabulary."""
        return self.model.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        return self.model.detokenize(list(tokens))

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` for every ``TickEvent`` and ``RequestEvent``."""
        self.telemetry.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        self.telemetry.remove_listener(listener)

    def stats(self) -> dict[str, Any]:
        """Slots, queue depth, ticks, tokens/s and other running totals."""
        engine = self._engine
        c = self.telemetry.snapshot()
        ticks = c.get("ticks", 0)
        decode_time = c.get("decode_time", 0.0)
        tick_time = c.get("tick_time", 0.0)
        return {
            "n_parallel": self.n_parallel,
            "busy_slots": engine.n_active if engine else 0,
            "queue_depth": engine.queue_depth if engine else 0,
            "ticks": int(ticks),
            "requests": int(c.get("requests", 0)),
            "finish_reasons": {k[7:]: int(v) for k, v in c.items() if k.startswith("finish_")},
            "prompt_tokens": int(c.get("prompt_tokens", 0)),
            "completion_tokens": int(c.get("completion_tokens", 0)),
            "reused_prompt_tokens": int(c.get("reused_tokens", 0)),
            "computed_prompt_tokens": int(c.get("prefill_tokens", 0)),
            "batch_tokens": int(c.get("batch_tokens", 0)),
            "decode_tokens": int(c.get("decode_tokens", 0)),
            "prefill_tokens": int(c.get("prefill_tokens", 0)),
            "busy_slots_per_decode": c.get("busy_slots", 0) / ticks if ticks else 0.0,
            "decode_time_s": decode_time,
            "tick_time_s": tick_time,
            "tokens_per_s": c.get("batch_tokens", 0) / tick_time if tick_time else 0.0,
            "generated_tokens_per_s": c.get("decode_tokens", 0) / tick_time if tick_time else 0.0,
            "decode_retries": int(c.get("retries", 0)),
            "prefix_cache": bool(engine and engine.prefix_cache.enabled),
            "cached_prefix_tokens": engine.prefix_cache.cached_tokens if engine else 0,
            "pinned_prefixes": len(engine.prefix_cache.pinned) if engine else 0,
        }

    def close(self) -> None:
        """Stop the engine (requests in flight end as ``"cancelled"``) and free the model."""
        if self._engine is not None:
            self._engine.close()
        if hasattr(self, "context"):
            self.context.close()
        self.model.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._engine is not None and not self._engine._closing:
                self._engine.close(timeout=5)
        except Exception:
            pass


class PrefixHandle:
    """A pinned prefix (``LLM.register_prefix``); ``release()`` frees its KV."""

    def __init__(self, llm: LLM, pinned: Any) -> None:
        self._llm = llm
        self._pinned = pinned

    @property
    def tokens(self) -> list[int]:
        return list(self._pinned.tokens)

    @property
    def released(self) -> bool:
        return bool(self._pinned.released)

    def release(self) -> None:
        """Free the prefix's KV cells; requests already running are unaffected. Idempotent."""
        if self._pinned.released:
            return
        engine = self._llm._engine
        if engine is None or engine._closing:
            self._pinned.released = True
            return
        engine.call(lambda: engine.prefix_cache.unpin(self._pinned))

    def __enter__(self) -> PrefixHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed % 2**32, n=1)
