"""``LLMEngine``: the engine core driven by the caller's own loop (``step()``), and
``EngineHost``, which it and ``LLM`` (driving the same core from a thread) each own.

Both build the model, the context and one ``EngineCore`` from one ``EngineConfig``, turn
prompts into requests the same way, and report the same ``stats()``: nothing schedules
twice, so the same requests give the same ticks and batches through either driver.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Mapping, Sequence
from functools import partial
from typing import Any

from typing_extensions import Unpack

from llamabatch._ffi.model import Model
from llamabatch._ffi.openmp import release_openmp_threads
from llamabatch.chat import ChatOptions, ChatRequestOptions, EngineChat, is_conversation, prepare
from llamabatch.config import EngineConfig, options_signature
from llamabatch.errors import EngineClosed, PromptTooLong, QueueFull
from llamabatch.generate.batch_invariant import check_weight_types
from llamabatch.generate.core import EngineCore
from llamabatch.generate.engine_build import build_engine
from llamabatch.generate.kv_memory import log_plan, plan_config
from llamabatch.generate.layout_switch import LayoutFollower
from llamabatch.generate.lora_merge import merge_on_load, merged_params
from llamabatch.generate.lora_schedule import lora_params, lora_stats
from llamabatch.generate.priority import check_priority
from llamabatch.generate.request import Channel, Request
from llamabatch.generate.request_memory import check_sampler_builds, check_sampling
from llamabatch.generate.slo import check_slo
from llamabatch.generate.slot_count import resolved_slots
from llamabatch.generate.speculative import spec_stats
from llamabatch.generate.vision import media_prompt, vision_for, vision_stats
from llamabatch.outputs import CompletionOutput, StepOutput
from llamabatch.params import SamplingParams
from llamabatch.prompts.inputs import check_token_ids, normalize_prompt
from llamabatch.runtime.telemetry import GenerationStats, Listener, Telemetry

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


class EngineHost:
    """What ``LLM`` and ``LLMEngine`` each own (composition, not a base class): the model,
    the context, the engine core, the telemetry, and the path from a prompt to its
    requests. Built from one :class:`EngineConfig`."""

    def __init__(self, model_path: str | os.PathLike[str], config: EngineConfig) -> None:
        #: the config as given, before the load resolved what it left open
        self.config_asked = self.config = config
        #: the adapter merged into the weights (``merge_lora``, ``generate/lora_merge.py``)
        self.merged_lora = merge_on_load(model_path, config) if config.merge_lora else None
        if self.merged_lora is not None:
            model_path = self.merged_lora.path
        self.model = Model(
            model_path, n_gpu_layers=config.n_gpu_layers, load_mode=config.load_mode, validate=config.validate
        )
        try:
            if not self.model.generates_text:
                raise ValueError(
                    f"{self.model.path.name} is not a decoder-only model (it cannot generate text); "
                    "use llamabatch.Embedder (or `llamabatch embed`) for embedding models"
                )
            if config.batch_invariant:
                check_weight_types(self.model.path)
            self.telemetry = Telemetry()
            #: the KV cache's size, bytes and the reason for them (``generate/kv_memory.py``)
            self.kv_plan, config = plan_config(self.model, self.config)
            self.config = config
            self.context, self.core = build_engine(self.model, config, self.telemetry)
            #: images (``--mmproj``): their prompts and positions (``generate/vision.py``)
            self.vision = self.core.vision = vision_for(self.model, config, self.context)
            if self.vision is not None:  # a saved state's M-RoPE images hold more cells
                self.core.kv.extra_cells = partial(self.vision.state_cells, self.core)
            #: the KV layout following the workload (``generate/layout_switch.py``)
            self.layout = LayoutFollower(self.config_asked, self.kv_plan)
            if self.layout.enabled:
                self.telemetry.add_listener(self.layout.watcher)
        except BaseException:
            self.model.close()
            raise
        if not config.kv_unified and config.n_prefixes:
            logger.info(
                "llamabatch: %d pinned-prefix streams share the KV cache with %d slots: "
                "%d cells per sequence",
                config.n_prefixes,
                config.n_parallel,
                self.context.n_ctx_seq,
            )
        log_plan(self.kv_plan, self.n_ctx, self.n_ctx_seq, self.context.n_seq_max)
        self._max_prompt_bytes: int | bool | None = False

    # The sizes: read from their one owner (the context for what llama.cpp decided, the
    # config for the rest), never copied.

    @property
    def n_ctx(self) -> int:
        """KV cache cells, all sequences together."""
        return self.context.n_ctx

    @property
    def n_ctx_seq(self) -> int:
        """The most tokens one request may hold (prompt + max_tokens), checked at submit."""
        return self.context.n_ctx_seq

    @property
    def n_batch(self) -> int:
        """The most tokens in one forward pass (llama.cpp caps ``n_batch`` at ``n_ctx``)."""
        return self.context.n_batch

    @property
    def n_parallel(self) -> int:
        return resolved_slots(self.config)

    @property
    def max_queue(self) -> int:
        return self.config.max_queue

    # -- prompts to requests ----------------------------------------------------------------

    @property
    def max_prompt_bytes(self) -> int | None:
        """The longest text (UTF-8 bytes) whose tokens could fit one request's context,
        ``n_ctx_seq`` times the longest token's bytes; a longer text prompt is refused with
        ``PromptTooLong`` before it is tokenized (tokenizing a long run without whitespace
        costs time quadratic in its length). ``None`` for vocabularies that may drop input
        bytes (WordPiece, Unigram), where no such bound holds. Computed once, on first use."""
        bound = self._max_prompt_bytes
        if bound is False:
            bound = self._max_prompt_bytes = prompt_bytes_bound(self.model, self.n_ctx_seq)
        return bound  # type: ignore[return-value]

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

    def tokenize_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids, the one rule for every request (BOS added, special
        tokens parsed)."""
        return self.model.tokenize(text, add_special=True, parse_special=True)

    def prompt_tokens(self, prompt: Any, params: SamplingParams) -> tuple[list[int], str | None]:
        """``(token ids, prompt text or None)``; raises for a bad or over-long prompt."""
        normalized = normalize_prompt(prompt)
        if isinstance(normalized, str):
            if not params.truncate:
                self.check_prompt_bytes(normalized, params.max_tokens)
            tokens = self.tokenize_prompt(normalized)
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

    def make_requests(
        self,
        prompt: Any,
        params: SamplingParams | dict[str, Any] | None,
        *,
        streaming: bool = True,
        channel: Channel | None = None,
        request_id: Any = None,
        priority: int = 0,
        client: Hashable | None = None,
    ) -> list[Request]:
        """The requests of one prompt: ``params.n`` completions sharing one request id
        (and ``priority``: lower runs first; ``client``: whose turn, ``generate/priority.py``).
        Their samplers are built at admission
        (``generate/request_memory.py``); a bad grammar, a token id outside the vocabulary or a
        request over ``max_request_memory_mb`` raises here, at the caller."""
        priority = check_priority(priority)
        params = SamplingParams.coerce(params) if params is not None else _DEFAULT_PARAMS
        if params.n > self.max_queue:  # refused before any sampler is built
            raise QueueFull(f"n={params.n} completions cannot wait in a queue of max_queue={self.max_queue}")
        check_sampling(
            params, self.model.n_vocab, n_parallel=self.n_parallel, max_mb=self.config.max_request_memory_mb
        )
        spec = self.config.speculative_config
        params = merged_params(self.merged_lora, params)
        params = lora_params(self.core.lora, params, spec.get("method") if spec else None)
        media = media_prompt(self.vision, prompt, self.n_ctx_seq, params.max_tokens)
        tokens, text = (media.tokens, media.text) if media is not None else self.prompt_tokens(prompt, params)
        if params.prompt_logprobs is not None:
            if media is not None:
                raise ValueError("SamplingParams.prompt_logprobs: not for a prompt with images")
            check_sampling(
                params,
                self.model.n_vocab,
                n_parallel=self.n_parallel,
                max_mb=self.config.max_request_memory_mb,
                n_prompt=len(tokens),
            )
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
                # followers wait for the leader's prompt and copy its KV
                leader=requests[0] if i else None,
                priority=priority,
                client=client,
            )
            request.media = media
            if i == 0:
                check_sampler_builds(self.model, request, self.n_ctx_seq)
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

    def stats(self, queue_depth: int) -> GenerationStats:
        """Slots, queue depth, KV cells, ticks, tokens/s and other running totals."""
        core = self.core
        c = core.counters
        table = core.table
        plan = self.kv_plan
        return GenerationStats(
            n_parallel=self.n_parallel,
            busy_slots=core.busy_slots,
            queue_depth=queue_depth,
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
            slot_moves=c.slot_moves,
            prefix_cache=core.kv.reuse,
            cached_prefix_tokens=core.kv.cached_tokens,
            pinned_prefixes=len(core.kv.pinned),
            kv_cells_used=table.cells_used,
            kv_cells_total=table.cells_total,
            n_ctx=self.n_ctx,
            n_ctx_reason=plan.reason,
            kv_unified=plan.kv_unified,
            kv_layout_reason=plan.layout_reason,
            n_parallel_reason=plan.slots_reason,
            flash_attn=plan.flash_attn,
            kv_type_k=plan.type_k,
            kv_type_v=plan.type_v,
            batch_invariant=self.config.batch_invariant,
            kv_bytes=plan.kv_bytes(self.n_ctx),
            kv_bytes_f16=plan.kv_bytes_f16(self.n_ctx),
            kv_budget_bytes=plan.budget_bytes,
            **core.kv.tier_stats(),
            **self.layout.stats(),
            spec_drafts=c.spec_drafts,
            spec_draft_tokens=c.spec_draft_tokens,
            spec_accepted_per_pos=tuple(c.spec_accepted_per_pos),
            spec_accepted_tokens=c.spec_accepted_tokens,
            slo_requests=c.slo_requests,
            slo_met=c.slo_met,
            **spec_stats(core.spec),
            **vision_stats(self.vision),
            **lora_stats(core.lora),
            **core.samplers.mask_stats(),
        )

    def when_quiet(self) -> bool:
        """Called by the drivers when nothing runs or waits: the KV layout may follow the
        workload now (``generate/layout_switch.py``); True when it switched."""
        return self.layout.at_quiet(self)

    def free(self) -> None:
        """Free the core's buffers, the context and the model (after the last step)."""
        self.core.close()
        self.context.close()
        self.model.close()


def from_host(name: str, doc: str) -> Any:
    """A read-only property of a facade reading its ``EngineHost``'s attribute ``name``."""

    def get(self: Any) -> Any:
        return getattr(self._host, name)

    return property(get, doc=doc)


class HostFacts:
    """The engine facts ``LLM`` and ``LLMEngine`` both show, read from the ``EngineHost`` each
    owns as ``_host`` (read-only properties only: no behaviour is inherited)."""

    _host: EngineHost

    config = from_host("config", "The engine's ``EngineConfig``.")
    model = from_host("model", "The loaded model.")
    context = from_host("context", "The llama.cpp context.")
    telemetry = from_host("telemetry", "Where ``TickEvent``s and ``RequestEvent``s go.")
    n_ctx = from_host("n_ctx", "KV cache cells, all sequences together.")
    n_ctx_seq = from_host("n_ctx_seq", "The most tokens one request may hold (prompt + max_tokens).")
    n_parallel = from_host("n_parallel", "Slots.")
    n_batch = from_host("n_batch", "The most tokens in one forward pass.")
    max_queue = from_host("max_queue", "Requests allowed to wait for a slot.")
    max_prompt_bytes = from_host("max_prompt_bytes", "See ``EngineHost.max_prompt_bytes``.")


def engine_config(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """The ``EngineConfig`` of a facade's ``config=`` and keyword options (keywords win)."""
    return EngineConfig.from_options(config, **options)


class LLMEngine(HostFacts):
    """The engine for a host loop: ``add_request``, then ``step()`` until done.

    Single-threaded: every call runs on the caller's thread (no engine thread, no locks).
    Takes the same options as :class:`llamabatch.LLM`: ``config=EngineConfig(...)`` and/or
    the config's fields as keywords (keywords override the config's fields).

    >>> engine = LLMEngine("model.gguf")                                # doctest: +SKIP
    >>> rid = engine.add_request("Hello", SamplingParams(max_tokens=8))  # doctest: +SKIP
    >>> while engine.has_unfinished_requests():                         # doctest: +SKIP
    ...     for out in engine.step():
    ...         print(out.request_id, out.text, out.finished)
    """

    @options_signature
    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        config: EngineConfig | None = None,
        tool_call_parser: str = "auto",
        reasoning_format: str = "auto",
        **options: Any,
    ) -> None:
        # chat requests: the tool-call format ("auto": from the chat template), <think> splitting
        self.chat_options = ChatOptions(tool_call_parser, reasoning_format)
        self._chats: dict[Any, EngineChat] = {}
        self._host = EngineHost(model_path, engine_config(config, options))
        self._by_id: dict[Any, list[Request]] = {}
        self._order: list[list[Request]] = []
        self._collecting = False
        self._closed = False

    @property
    def core(self) -> EngineCore:
        """The engine core this engine drives."""
        if self._closed:
            raise EngineClosed("the engine is closed")
        return self._host.core

    @property
    def closed(self) -> bool:
        return self._closed

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` under the model's vocabulary."""
        return self._host.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        return self._host.detokenize(tokens)

    def check_prompt_bytes(self, text: str, max_tokens: int = 0) -> None:
        """``PromptTooLong`` when ``text`` cannot fit the context, before tokenizing it."""
        self._host.check_prompt_bytes(text, max_tokens)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` for every ``TickEvent`` and ``RequestEvent``."""
        self._host.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._host.remove_listener(listener)

    def stats(self) -> GenerationStats:
        """Slots, queue depth, KV cells, ticks, tokens/s and other running totals."""
        core = self.core
        return self._host.stats(len(core.waiting))

    def add_request(
        self,
        prompt: Prompt | Sequence[Mapping[str, Any]],
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: Any = None,
        priority: int = 0,
        **chat: Unpack[ChatRequestOptions],
    ) -> Any:
        """Queue a prompt (text or token ids); returns its request id (``request_id`` if
        given: it must be new). Raises ``ValueError``/``PromptTooLong`` for a bad prompt or
        params, ``QueueFull`` beyond ``max_queue``. ``priority``: lower runs first, and a
        waiting request preempts a running one of a higher number (see README).

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
            prompt, setup = prepare(self, prompt, params, **chat)  # type: ignore[arg-type]
            params = setup.params
        elif chat:
            raise ValueError(f"{', '.join(chat)}: only for a conversation (a list of chat messages)")
        requests = self._host.make_requests(prompt, params, request_id=request_id, priority=priority)
        check_slo(core.admission, core.waiting, requests)
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
        for event in self.core.step():
            request, token_ids, finish_reason = event.request, event.token_ids, event.finish_reason
            finished = finish_reason is not None
            step = StepOutput(
                request.request_id,
                token_ids,
                event.text,
                finished,
                finish_reason,
                request.output if finished else None,
                request.index,
                request.token_logprobs(token_ids),
                status=event.status,
            )
            chat = self._chats.get(request.request_id)
            outputs.append(chat.split(step) if chat is not None else step)
            if finished:
                request.publish("", [], finish_reason)
                self._forget_if_done(request.request_id)
        if not self.core.has_unfinished():
            self._host.when_quiet()
            release_openmp_threads()  # the caller's thread: as an idle engine thread (_ffi/openmp.py)
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
        self._host.core.fail_all("cancelled")
        self._host.free()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
