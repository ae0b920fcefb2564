"""``LLMEngine``: the engine core driven by the caller's own loop (``step()``), and the
setup it shares with ``LLM`` (which drives the same core from a thread).

Both build the model, the context and one ``EngineCore`` from the same options, turn
prompts into requests the same way, and report the same ``stats()``: nothing schedules
twice, so the same requests give the same ticks and batches through either driver.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypedDict

from typing_extensions import Unpack

from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch._ffi.sampler import SamplerChain
from llamabatch.engine import EngineCore
from llamabatch.errors import EngineClosed, PromptTooLong, QueueFull
from llamabatch.grammar_check import get_grammar_limits
from llamabatch.inputs import check_token_ids, normalize_prompt
from llamabatch.outputs import CompletionOutput, StepOutput
from llamabatch.params import SamplingParams, check_positive_int
from llamabatch.request import Channel, Request
from llamabatch.strategies import Strategy, get_strategy
from llamabatch.telemetry import GenerationStats, Listener, Telemetry
from llamabatch.toolcalls.host import (
    ChatOptions,
    ChatRequestOptions,
    EngineChat,
    chat_request,
    is_conversation,
)

logger = logging.getLogger("llamabatch")

Prompt = str | Sequence[int]

_DEFAULT_PARAMS = SamplingParams()


#: ``tokenizer.ggml.model`` of vocabularies whose tokens together cover every input byte
#: (SentencePiece, byte-level BPE): n tokens cover at most n times the longest token's bytes
_BYTE_COVERING_TOKENIZERS = frozenset({"llama", "gpt2"})


def prompt_bytes_bound(model: Model, n_tokens: int) -> int | None:
    """The most UTF-8 bytes ``n_tokens`` tokens of ``model`` can stand for (see
    ``EngineHost.max_prompt_bytes``), or ``None`` when the tokenizer may drop input bytes."""
    if model.meta("tokenizer.ggml.model") not in _BYTE_COVERING_TOKENIZERS:
        return None
    longest = 4  # an unknown character (up to 4 bytes) may become one unknown-token id
    for token in range(model.n_vocab):
        longest = max(longest, len(model.token_to_piece(token, special=True)))
    return n_tokens * longest


class EngineOptions(TypedDict, total=False):
    """The keyword options of ``LLM`` and ``LLMEngine`` (documented on ``EngineHost``)."""

    n_ctx: int
    n_parallel: int
    n_batch: int
    n_ubatch: int | None
    chunk_size: int
    strategy: str | Strategy
    max_queue: int
    n_threads: int | None
    n_threads_batch: int | None
    n_gpu_layers: int
    flash_attn: bool | str | None
    load_mode: str
    prefix_cache: bool
    max_prefixes: int | None
    kv_unified: bool
    validate: bool


class EngineHost:
    """What ``LLM`` and ``LLMEngine`` share: the model, the context, the engine core, and
    the path from a prompt to its requests.

    Args:
        model_path: the ``.gguf`` file.
        n_ctx: KV cache size in tokens, for all sequences together.
        n_parallel: sequences decoded together (slots).
        n_batch: the most tokens in one forward pass (the per-tick token budget).
        n_ubatch: the physical micro-batch llama.cpp computes at once (<= n_batch).
        chunk_size: the most prompt tokens one sequence prefills per tick.
        strategy: ``"decode_maximal"`` (default), ``"prefill_priority"``, ``"balanced"``,
            or a strategy object (see ``llamabatch._core.strategies``).
        max_queue: requests allowed to wait for a slot; beyond it ``submit`` raises
            ``QueueFull``.
        n_threads, n_threads_batch: CPU threads for llama.cpp (default: all cores).
        n_gpu_layers: layers to offload to a GPU (-1: all; needs a GPU build).
        flash_attn: ``True``, ``False`` or ``None``/``"auto"``.
        load_mode: how the weights are loaded (``"mmap"``, ``"none"``, ...).
        prefix_cache: reuse the KV of a matching prompt prefix from any slot (busy or
            idle) or pinned prefix, copied with ``llama_memory_seq_cp`` (default on).
        max_prefixes: how many prefixes ``register_prefix`` may pin at once (default 4 with
            a unified KV cache, 0 with one stream per sequence, where each pinned prefix
            takes a stream of its own: ``n_ctx / (n_parallel + max_prefixes)`` cells).
        kv_unified: ``False`` (default, as llama.cpp's server and llama-batched-bench):
            one KV stream per sequence, ``n_ctx / n_parallel`` cells each; attention spans
            only a sequence's own cells, the fastest layout. ``True``: one buffer shared by
            all sequences, any request may use up to ``n_ctx`` cells; requests are admitted
            while their prompts fit and preempted (recomputed later) when the cache fills.
        validate: check the GGUF file before llama.cpp reads it (see ``gguf_check``).
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
        strategy: str | Strategy = "decode_maximal",
        max_queue: int = 1024,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int = 0,
        flash_attn: bool | str | None = None,
        load_mode: str = "mmap",
        prefix_cache: bool = True,
        max_prefixes: int | None = None,
        kv_unified: bool = False,
        validate: bool = True,
    ) -> None:
        self._core: EngineCore | None = None
        for name, value in (
            ("n_ctx", n_ctx),
            ("n_parallel", n_parallel),
            ("n_batch", n_batch),
            ("chunk_size", chunk_size),
            ("max_queue", max_queue),
        ):
            check_positive_int(name, value)
        for name, flag in (
            ("prefix_cache", prefix_cache),
            ("kv_unified", kv_unified),
            ("validate", validate),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if max_prefixes is None:
            max_prefixes = 4 if kv_unified and prefix_cache else 0
        if not isinstance(max_prefixes, int) or isinstance(max_prefixes, bool) or not 0 <= max_prefixes <= 64:
            raise ValueError(f"max_prefixes must be an int in [0, 64], got {max_prefixes!r}")
        try:
            get_strategy(strategy)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"strategy: {exc}") from None
        n_seq_max = n_parallel + max_prefixes  # pinned prefixes live in sequences of their own
        if n_seq_max > n_ctx:
            raise ValueError(f"n_parallel + max_prefixes ({n_seq_max}) must be <= n_ctx ({n_ctx})")
        if n_batch < n_seq_max:
            # llama.cpp sizes its output buffer by n_batch and aborts when a batch has more
            # outputs (one per decoding sequence) than that
            raise ValueError(f"n_batch ({n_batch}) must be >= n_parallel + max_prefixes ({n_seq_max})")
        self.model = Model(model_path, n_gpu_layers=n_gpu_layers, load_mode=load_mode, validate=validate)
        try:
            if not self.model.generates_text:
                raise ValueError(
                    f"{self.model.path.name} is not a decoder-only model (it cannot generate text); "
                    "use llamabatch.Embedder (or `llamabatch embed`) for embedding models"
                )
            self.context = Context(
                self.model,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=n_ubatch,
                n_seq_max=n_seq_max,
                n_threads=n_threads,
                n_threads_batch=n_threads_batch,
                flash_attn=flash_attn,
                kv_unified=kv_unified,
            )
            if not kv_unified and max_prefixes:
                logger.info(
                    "llamabatch: %d pinned-prefix streams share the KV cache with %d slots: "
                    "%d cells per sequence",
                    max_prefixes,
                    n_parallel,
                    self.context.n_ctx_seq,
                )
            self.telemetry = Telemetry()
            self._core = EngineCore(
                self.model,
                self.context,
                n_parallel=n_parallel,
                n_batch=self.context.n_batch,  # llama.cpp caps it at n_ctx; a bigger batch aborts
                chunk_size=chunk_size,
                strategy=strategy,
                max_queue=max_queue,
                telemetry=self.telemetry,
                prefix_cache=prefix_cache,
                max_prefixes=max_prefixes,
            )
        except BaseException:
            if hasattr(self, "context"):
                self.context.close()
            self.model.close()
            raise
        self.n_ctx: int = self.context.n_ctx
        #: the most tokens one request may hold (prompt + max_tokens), checked at submit
        self.n_ctx_seq: int = self.context.n_ctx_seq
        self.n_parallel = n_parallel
        self.n_batch = self.context.n_batch
        self.max_queue = max_queue

    # -- prompts to requests ----------------------------------------------------------------

    @property
    def max_prompt_bytes(self) -> int | None:
        """The longest text (UTF-8 bytes) whose tokens could fit one request's context,
        ``n_ctx_seq`` times the longest token's bytes; a longer text prompt is refused with
        ``PromptTooLong`` before it is tokenized (tokenizing a long run without whitespace
        costs time quadratic in its length). ``None`` for vocabularies that may drop input
        bytes (WordPiece, Unigram), where no such bound holds. Computed once, on first use."""
        bound = self.__dict__.get("_max_prompt_bytes", False)
        if bound is False:
            bound = prompt_bytes_bound(self.model, self.n_ctx_seq)
            self.__dict__["_max_prompt_bytes"] = bound
        return bound

    def check_prompt_bytes(self, text: str, max_tokens: int = 0) -> None:
        """Raise ``PromptTooLong`` when ``text`` cannot fit the context whatever the
        tokenizer makes of it (see :attr:`max_prompt_bytes`), leaving ``max_tokens``."""
        bound = self.max_prompt_bytes
        room = self.n_ctx_seq - max_tokens
        if bound is None or room < 1:
            return  # no bound, or the token count check refuses it anyway
        per_token = bound // self.n_ctx_seq
        limit = per_token * room
        if len(text) * 4 <= limit:  # 4: the most UTF-8 bytes one character takes
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PromptTooLong(
                f"the prompt is {size} bytes of UTF-8: more than {room} tokens of at most {per_token} "
                f"bytes each, so it cannot fit the per-request context of {self.n_ctx_seq} tokens "
                f"(max_tokens {max_tokens}); refused before tokenizing"
            )

    def _prompt_tokens(self, prompt: Any, params: SamplingParams) -> tuple[list[int], str | None]:
        """``(token ids, prompt text or None)``; raises for a bad or over-long prompt."""
        normalized = normalize_prompt(prompt)
        if isinstance(normalized, str):
            if not params.truncate:
                self.check_prompt_bytes(normalized, params.max_tokens)
            tokens = self.model.tokenize(normalized, add_special=True, parse_special=True)
            if not tokens:
                raise ValueError("the prompt tokenizes to nothing")
            text: str | None = normalized
        else:
            check_token_ids(normalized, self.model.n_vocab)
            tokens, text = normalized, None
        limit = self.n_ctx_seq - params.max_tokens
        if len(tokens) > limit:
            if params.truncate and limit > 0:
                tokens = tokens[len(tokens) - limit :]
            else:
                raise PromptTooLong(
                    f"prompt of {len(tokens)} tokens + max_tokens {params.max_tokens} exceeds the "
                    f"per-request context of {self.n_ctx_seq} tokens (n_ctx {self.n_ctx}"
                    + ("" if self.context.kv_unified else f" / {self.context.n_seq_max} KV streams")
                    + ")"
                    + ("" if params.truncate else "; SamplingParams(truncate=True) keeps the prompt's end")
                )
        return tokens, text

    def _make_requests(
        self,
        prompt: Any,
        params: SamplingParams | dict[str, Any] | None,
        *,
        streaming: bool = True,
        channel: Channel | None = None,
        request_id: Any = None,
    ) -> list[Request]:
        """The requests of one prompt: ``params.n`` completions sharing one request id."""
        params = SamplingParams.coerce(params) if params is not None else _DEFAULT_PARAMS
        if params.n > self.max_queue:  # refused before any sampler is built
            raise QueueFull(f"n={params.n} completions cannot wait in a queue of max_queue={self.max_queue}")
        tokens, text = self._prompt_tokens(prompt, params)
        requests: list[Request] = []
        for i in range(params.n):
            request = Request(
                tokens,
                params,
                index=i,
                request_id=request_id if i == 0 else requests[0].request_id,
                prompt=text,
                streaming=streaming,
                channel=channel,
            )
            if i:  # followers wait for the leader's prompt and copy its KV
                request.leader = requests[0]
            # Built on the caller's thread, so a bad grammar raises here.
            live_stacks = get_grammar_limits().max_live_stacks
            if not request.fast_greedy:
                seeded = (
                    params
                    if params.seed is None or i == 0
                    else replace(params, seed=(params.seed + i) % 2**32)
                )
                request.sampler = SamplerChain(
                    self.model, seeded, n_ctx=self.n_ctx_seq, max_live_stacks=live_stacks
                )
            requests.append(request)
        return requests

    # -- tokens, telemetry ----------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` under the model's vocabulary."""
        return self.model.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        return self.model.detokenize(list(tokens))

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` for every ``TickEvent`` and ``RequestEvent`` (on the
        engine's thread: keep it quick)."""
        self.telemetry.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        self.telemetry.remove_listener(listener)

    def stats(self) -> GenerationStats:
        """Slots, queue depth, KV cells, ticks, tokens/s and other running totals."""
        core = self._core
        if core is None or self.closed:
            raise EngineClosed("the engine is closed")
        c = core.counters
        table = core.table
        return GenerationStats(
            n_parallel=self.n_parallel,
            busy_slots=core.busy_slots,
            queue_depth=self._queue_depth(),
            ticks=c.ticks,
            requests=c.requests,
            finish_reasons=dict(c.finish_reasons),
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            reused_tokens=c.reused_tokens,
            batch_tokens=c.batch_tokens,
            decode_tokens=c.decode_tokens,
            prefill_tokens=c.prefill_tokens,
            mean_busy_slots=c.busy_slot_ticks / c.ticks if c.ticks else 0.0,
            decode_time_s=c.decode_time,
            tick_time_s=c.tick_time,
            tokens_per_s=c.batch_tokens / c.tick_time if c.tick_time else 0.0,
            generated_tokens_per_s=c.decode_tokens / c.tick_time if c.tick_time else 0.0,
            decode_retries=c.decode_retries,
            preemptions=c.preemptions,
            recomputed_tokens=c.recomputed_tokens,
            evictions=c.evictions,
            prefix_cache=core.kv.reuse,
            cached_prefix_tokens=core.kv.cached_tokens,
            pinned_prefixes=len(core.kv.pinned),
            kv_cells_used=table.cells_used,
            kv_cells_total=table.cells_total,
        )

    def _queue_depth(self) -> int:
        core = self._core
        return len(core.waiting) if core is not None else 0

    def _free(self) -> None:
        """Free the core's buffers, the context and the model (after the last step)."""
        if self._core is not None:
            self._core.close()
        if hasattr(self, "context"):
            self.context.close()
        if hasattr(self, "model"):
            self.model.close()


class LLMEngine(EngineHost):
    """The engine for a host loop: ``add_request``, then ``step()`` until done.

    Single-threaded: every call runs on the caller's thread (no engine thread, no locks).
    Takes the same options as :class:`llamabatch.LLM`.

    >>> engine = LLMEngine("model.gguf")                                # doctest: +SKIP
    >>> rid = engine.add_request("Hello", SamplingParams(max_tokens=8))  # doctest: +SKIP
    >>> while engine.has_unfinished_requests():                         # doctest: +SKIP
    ...     for out in engine.step():
    ...         print(out.request_id, out.text, out.finished)
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        tool_call_parser: str = "auto",
        reasoning_format: str = "auto",
        **options: Unpack[EngineOptions],
    ) -> None:
        # chat requests: the tool-call format ("auto": from the chat template), <think> splitting
        self.chat_options = ChatOptions(tool_call_parser, reasoning_format)
        self._chats: dict[Any, EngineChat] = {}
        super().__init__(model_path, **options)
        self._by_id: dict[Any, list[Request]] = {}
        self._order: list[list[Request]] = []
        self._collecting = False
        self._closed = False

    @property
    def core(self) -> EngineCore:
        if self._closed or self._core is None:
            raise EngineClosed("the engine is closed")
        return self._core

    @property
    def closed(self) -> bool:
        return self._closed

    def add_request(
        self,
        prompt: Prompt | Sequence[Mapping[str, Any]],
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: Any = None,
        **chat: Unpack[ChatRequestOptions],
    ) -> Any:
        """Queue a prompt (text or token ids); returns its request id (``request_id`` if
        given: it must be new). Raises ``ValueError``/``PromptTooLong`` for a bad prompt or
        params, ``QueueFull`` beyond ``max_queue``.

        A conversation (a list of chat messages) is rendered with the chat template, as
        ``LLM.chat`` does, with ``tools``, ``tool_choice``, ``parallel_tool_calls``,
        ``chat_template``, ``chat_template_kwargs``; its ``StepOutput``s carry the content as
        ``text``, the ``reasoning`` and the completed ``tool_calls``, and its output is split
        the same way."""
        core = self.core
        if request_id is not None and request_id in self._by_id:
            raise ValueError(f"request id {request_id!r} is already in use")
        setup = None
        if is_conversation(prompt):
            prompt, setup = chat_request(self, self.chat_options, prompt, params, **chat)  # type: ignore[arg-type]
            params = setup.params
        elif chat:
            raise ValueError(f"{', '.join(chat)}: only for a conversation (a list of chat messages)")
        requests = self._make_requests(prompt, params, request_id=request_id)
        core.add(requests)
        rid = requests[0].request_id
        self._by_id[rid] = requests
        self._order.append(requests)
        if setup is not None and setup.parses:
            self._chats[rid] = EngineChat(setup)
        return rid

    def abort_request(self, request_id: Any) -> None:
        """Cancel a request: its completions end as ``"cancelled"`` at the next ``step()``.
        Unknown or finished ids are ignored."""
        for request in self._by_id.get(request_id, ()):
            self.core.abort(request)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Run one scheduling step (at most one ``llama_decode``); return each completion's
        new tokens and text, and the full output of those that finished."""
        outputs: list[StepOutput] = []
        for request, text, token_ids, finish_reason in self.core.step():
            finished = finish_reason is not None
            step = StepOutput(
                request.request_id,
                token_ids,
                text,
                finished,
                finish_reason,
                request.output if finished else None,
                request.index,
                request.token_logprobs(token_ids),
            )
            chat = self._chats.get(request.request_id)
            outputs.append(chat.split(step) if chat is not None else step)
            if finished:
                request.publish("", [], finish_reason)
                self._forget_if_done(request.request_id)
        return outputs

    def _forget_if_done(self, request_id: Any) -> None:
        # A host loop that only calls step() has had every output: keep nothing.
        requests = self._by_id.get(request_id)
        if not self._collecting and requests and all(r.done for r in requests):
            del self._by_id[request_id]
            self._order.remove(requests)
            self._chats.pop(request_id, None)

    def run_until_complete(self) -> list[CompletionOutput]:
        """Step until every request has ended. Returns the outputs of the requests not yet
        reported finished by an earlier ``step()``, in the order they were added (a prompt's
        ``n`` completions follow each other)."""
        self._collecting = True
        try:
            while self.has_unfinished_requests():
                self.step()
        finally:
            self._collecting = False
        outputs = [self._final(request) for requests in self._order for request in requests]
        self._order.clear()
        self._by_id.clear()
        self._chats.clear()
        return outputs  # type: ignore[return-value]

    def _final(self, request: Request) -> CompletionOutput | None:
        chat = self._chats.get(request.request_id)
        if chat is None or request.output is None:
            return request.output
        return chat.outputs.get(request.index) or chat.setup.finish_output(request.output)

    def close(self) -> None:
        """End requests still queued or running as ``"cancelled"`` and free the model."""
        if self._closed:
            return
        self._closed = True
        if self._core is not None:
            self._core.fail_all("cancelled")
        self._free()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
