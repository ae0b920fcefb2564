"""``LLM``: the engine core driven by a thread of its own, behind a small thread-safe,
streaming and asyncio API (vLLM's ``LLM`` shape).

``LLM`` owns an ``EngineHost`` (model, context, core: the same ``LLMEngine`` owns) and a
``Worker`` thread that runs an ``EngineLoop``. Callers on any thread put requests and
cancellations into the loop's inbox under the worker's lock; the engine thread moves them
into the core between steps, runs ``EngineCore.step()`` while there is work, and hands
each step's deltas to the callers' channels.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from llamabatch.chat import ChatOptions, prepare
from llamabatch.config import EngineConfig, options_signature
from llamabatch.errors import EngineClosed, QueueFull
from llamabatch.generate.core import EngineCore, check_queue_room
from llamabatch.generate.kv_cache import PinnedPrefix
from llamabatch.generate.llm_engine import EngineHost, HostFacts, Prompt, engine_config
from llamabatch.generate.lora_schedule import unload_adapter
from llamabatch.generate.request import END_OF_STREAM, Channel, Request, RequestHandle, request_output
from llamabatch.generate.slo import check_slo
from llamabatch.outputs import Delta, RequestOutput
from llamabatch.params import SamplingParams
from llamabatch.prompts.chat_template import render_chat
from llamabatch.prompts.inputs import as_prompt_list
from llamabatch.runtime.facade import ThreadedFacade
from llamabatch.runtime.telemetry import GenerationStats, Listener
from llamabatch.runtime.worker import Worker

Params = SamplingParams | Mapping[str, Any] | None
T = TypeVar("T")


class EngineLoop:
    """The engine thread's side of ``LLM`` (a ``WorkerTask``): the inbox of requests and
    cancellations callers hand over under ``worker.cond``, moved into the core between
    steps; each step's deltas go to the callers' channels."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.inbox: list[Request] = []
        self.cancels: list[Request] = []
        self.worker: Worker  # set by the owner, before the thread starts

    @property
    def core(self) -> EngineCore:
        """The host's core (a new one after a layout switch)."""
        return self.host.core

    def has_work(self) -> bool:
        return bool(self.inbox or self.cancels or self.core.has_unfinished())

    def run_once(self) -> None:
        core = self.core
        cond = self.worker.cond
        with cond:
            inbox, self.inbox = self.inbox, []
            cancels, self.cancels = self.cancels, []
        if inbox:
            core.add(inbox, check_room=False)  # room was checked at submit
        for request in cancels:
            core.abort(request)
        ended = False
        for event in core.step():
            event.request.publish(event.text, event.token_ids, event.finish_reason)
            ended = ended or event.finish_reason is not None
        if inbox or core.waiting or ended:
            with cond:
                cond.notify_all()  # room in the queue for blocked submitters
        if not core.has_unfinished() and not self.inbox:
            self.host.when_quiet()

    def fail_pending(self, error: BaseException) -> None:
        with self.worker.cond:
            inbox, self.inbox = self.inbox, []
            self.cancels.clear()
        core = self.core
        core.add(inbox, check_room=False)
        # Closing cancels what is in flight; a crash fails it.
        reason, message = ("cancelled", None) if isinstance(error, EngineClosed) else ("error", str(error))
        for event in core.fail_all(reason, message):  # type: ignore[arg-type]
            event.request.publish(event.text, event.token_ids, event.finish_reason)

    def on_close(self) -> None:
        self.host.free()

    def interrupt(self) -> None:
        self.core.stopping = True
        self.host.context.abort()  # stop a long decode early

    def queue_depth(self) -> int:
        return len(self.inbox) + len(self.core.waiting)

    def queued(self) -> int:
        """What counts against ``max_queue`` (not the preempted requests waiting)."""
        return len(self.inbox) + self.core.n_queued


class LLM(HostFacts, ThreadedFacade):
    """Many concurrent generations from one GGUF model, batched into one forward pass per tick.

    Options: ``config=EngineConfig(...)`` and/or the config's fields as keywords (``n_ctx``,
    ``n_parallel``, ``n_batch``, ``kv_unified``, ...; see :class:`llamabatch.EngineConfig`);
    keywords override the config's fields. Every method is thread-safe.
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
        # chat(): the tool-call format ("auto": from the chat template) and <think> splitting
        self._chat_options = ChatOptions(tool_call_parser, reasoning_format)
        self._host = EngineHost(model_path, engine_config(config, options))
        self._loop = EngineLoop(self._host)
        self._loop.worker = self.attach("llamabatch-engine", self._loop, kind="LLM")
        self.start()

    @property
    def chat_options(self) -> ChatOptions:
        """``chat()``'s defaults: ``tool_call_parser`` and ``reasoning_format``."""
        return self._chat_options

    @property
    def core(self) -> EngineCore:
        """The engine core (touch it only on the engine thread: ``worker.call``)."""
        return self._host.core

    def call_on_engine_thread(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn()`` on the engine thread between steps and return its result (see
        ``Worker.call``)."""
        return self.worker.call(fn, timeout)

    # -- telemetry --------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` for every ``TickEvent`` and ``RequestEvent`` (on the
        engine's thread: keep it quick)."""
        self._host.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._host.remove_listener(listener)

    def stats(self) -> GenerationStats:
        """Slots, queue depth, KV cells, ticks, tokens/s and other running totals."""
        if self.closed:
            raise EngineClosed("the engine is closed")
        return self._host.stats(self._loop.queue_depth())

    # -- the model on callers' threads ----------------------------------------------------

    def _make_requests(self, *args: Any, **kwargs: Any) -> list[Request]:
        with self.worker.using_resources():
            return self._host.make_requests(*args, **kwargs)

    def _prompt_tokens(self, prompt: Any, params: SamplingParams) -> tuple[list[int], str | None]:
        with self.worker.using_resources():
            return self._host.prompt_tokens(prompt, params)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` under the model's vocabulary."""
        with self.worker.using_resources():
            return self._host.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        with self.worker.using_resources():
            return self._host.detokenize(tokens)

    def tokenize_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids exactly as ``submit`` makes them (BOS added, special
        tokens parsed)."""
        with self.worker.using_resources():
            return self._host.tokenize_prompt(text)

    def check_prompt_bytes(self, text: str, max_tokens: int = 0) -> None:
        """``PromptTooLong`` when ``text`` cannot fit the context, before tokenizing it."""
        with self.worker.using_resources():
            self._host.check_prompt_bytes(text, max_tokens)

    # -- requests (any thread) ------------------------------------------------------------

    def _enqueue(self, requests: list[Request], block: bool = False, timeout: float | None = None) -> None:
        """Queue requests (all or none). ``QueueFull`` beyond ``max_queue``, unless
        ``block``, which waits for room (not on the engine thread: it would wait forever)."""
        worker, loop = self.worker, self._loop
        if block and worker.on_worker_thread:
            block = False
        deadline = None if timeout is None else time.monotonic() + timeout
        max_queue = self._host.max_queue
        with worker.cond:
            while True:
                worker.raise_if_closed()
                if not block:
                    check_queue_room(loop.queued(), len(requests), max_queue)
                    check_slo(loop.core.admission, [*loop.inbox, *loop.core.waiting], requests)
                    break
                if loop.queued() + len(requests) <= max_queue:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueFull(f"no room in the queue within {timeout} s (max_queue={max_queue})")
                worker.cond.wait(left)
            loop.inbox.extend(requests)
            worker.cond.notify_all()

    def _cancel(self, request: Request) -> None:
        worker = self.worker
        with worker.cond:
            if not worker.closed:
                self._loop.cancels.append(request)
                worker.cond.notify_all()

    def _check_can_wait(self, what: str) -> None:
        if self.on_worker_thread:
            raise RuntimeError(
                f"LLM.{what}() waits for the engine, so it cannot run on the engine's own thread "
                "(in a listener or a strategy); use submit() there"
            )

    def submit(
        self, prompt: Prompt, params: Params = None, *, priority: int = 0, client: Hashable | None = None
    ) -> RequestHandle:
        """Queue one prompt (text or token ids); returns at once. Thread-safe. ``priority``:
        lower runs first and may preempt running requests of a higher number (see README).
        ``client``: who the request is for (any hashable; ``None``: no one in particular):
        at one priority, the requests of different clients take turns, and each client has
        its share of the host-RAM prompt cache (``cache_ram``).

        Raises ``ValueError`` for an empty prompt or bad params, ``PromptTooLong`` when
        prompt + max_tokens do not fit, ``QueueFull`` beyond ``max_queue``."""
        with self.worker.cond:
            self.worker.raise_if_closed()
        requests = self._make_requests(prompt, params, channel=Channel(), priority=priority, client=client)
        self._enqueue(requests)
        return RequestHandle(requests, self._cancel)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: Params | Sequence[Params] = None,
        *,
        use_tqdm: bool = True,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Generate for every prompt concurrently; one ``RequestOutput`` per prompt, in input
        order, each holding its ``n`` completions.

        ``use_tqdm`` shows a progress bar (on stderr, advancing per finished prompt) when
        there is more than one prompt. Waits for queue room rather than failing. ``priority``:
        one for all prompts or one per prompt (lower runs first)."""
        self._check_can_wait("generate")
        prompt_list, _ = as_prompt_list(prompts)
        params_list, priorities = _per_prompt(params, priority, len(prompt_list), "prompts")
        groups = [
            self._make_requests(p, sp, streaming=False, priority=pr)
            for p, sp, pr in zip(prompt_list, params_list, priorities, strict=True)
        ]
        flat = [r for g in groups for r in g]
        bar = _progress_bar(len(groups), use_tqdm and len(groups) > 1)
        try:
            if len(flat) <= self.max_queue:
                self._enqueue(flat, block=True)  # all at once: the engine sees them together
            else:
                for group in groups:
                    self._enqueue(group, block=True)
            for group in groups:
                for request in group:
                    request.wait(None)
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for request in flat:
                if not request.done:
                    self._cancel(request)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [request_output(group) for group in groups]

    def stream(
        self, prompt: Prompt, params: Params = None, *, priority: int = 0, client: Hashable | None = None
    ) -> Iterator[Delta]:
        """Yield deltas as tokens arrive (for ``n > 1``, of every completion, told apart by
        ``.index``); closing the iterator early cancels the request."""
        self._check_can_wait("stream")
        handle = self.submit(prompt, params, priority=priority, client=client)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()

    async def astream(
        self, prompt: Prompt, params: Params = None, *, priority: int = 0, client: Hashable | None = None
    ) -> AsyncIterator[Delta]:
        """Async iterator of deltas (``.index`` tells ``n > 1`` completions apart);
        cancelling the consuming task cancels the request."""
        requests, aqueue = await self._submit_async(
            prompt, params, streaming=True, priority=priority, client=client
        )
        try:
            ends = 0
            while ends < len(requests):
                item = await aqueue.get()
                if item is END_OF_STREAM:
                    ends += 1
                    continue
                yield item
        finally:
            self._cancel_unfinished(requests)

    async def agenerate(
        self, prompt: Prompt, params: Params = None, *, priority: int = 0, client: Hashable | None = None
    ) -> RequestOutput:
        """Await one prompt's ``RequestOutput`` (all ``n`` completions); cancelling the
        awaiting task cancels the request."""
        requests, aqueue = await self._submit_async(
            prompt, params, streaming=False, priority=priority, client=client
        )
        try:
            ends = 0
            while ends < len(requests):  # only the completions' ends arrive
                ends += (await aqueue.get()) is END_OF_STREAM
        finally:
            self._cancel_unfinished(requests)
        return request_output(requests)

    async def _submit_async(
        self,
        prompt: Prompt,
        params: Params,
        streaming: bool,
        priority: int = 0,
        client: Hashable | None = None,
    ) -> tuple[list[Request], Any]:
        """Submit a prompt whose deltas go to an asyncio queue of the running loop. The
        prompt is tokenized and its samplers (grammars) built in a worker thread, so a heavy
        prompt or grammar does not stall the event loop."""
        with self.worker.cond:
            self.worker.raise_if_closed()
        channel = Channel()
        aqueue: asyncio.Queue[Any] = asyncio.Queue()
        channel.listen_from(asyncio.get_running_loop(), aqueue)
        built = asyncio.ensure_future(
            asyncio.to_thread(
                self._make_requests,
                prompt,
                params,
                channel=channel,
                streaming=streaming,
                priority=priority,
                client=client,
            )
        )
        try:
            requests = await asyncio.shield(built)
        except asyncio.CancelledError:
            # The build goes on in its thread: its requests are still submitted, then cancelled,
            # so each one ends exactly once (as if the caller had cancelled just after submitting).
            built.add_done_callback(self._submit_cancelled)
            raise
        self._enqueue(requests)
        return requests, aqueue

    def _submit_cancelled(self, built: asyncio.Future[list[Request]]) -> None:
        if built.cancelled() or built.exception() is not None:
            return
        requests = built.result()
        try:
            self._enqueue(requests)
        except (QueueFull, EngineClosed):
            return  # never queued: nothing to end
        self._cancel_unfinished(requests)

    def _cancel_unfinished(self, requests: list[Request]) -> None:
        for request in requests:
            if not request.done:
                self._cancel(request)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        params: Params | Sequence[Params] = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Chat completions of one conversation (a list of messages) or of many (a list of
        such lists), formatted with the GGUF's chat template (or ``chat_template``: a Jinja
        template, or a llama.cpp built-in name such as ``"chatml"``). Returns one
        ``RequestOutput`` per conversation, as ``generate`` does; ``params`` and ``priority``
        are one for all conversations or one per conversation, as there.

        Answers are split as the OpenAI API does: ``CompletionOutput.reasoning`` holds a
        ``<think>`` block, ``.tool_calls`` the calls of ``tools`` (``ToolCall``: id, name,
        JSON arguments), ``.text`` the content. ``tool_choice``: "auto" (default with tools),
        "none", "required" or ``{"type": "function", "function": {"name": ...}}`` (the last
        two force a call with a grammar from the tools' schemas). Conversations may hold
        assistant ``tool_calls`` and ``tool`` messages."""
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)  # type: ignore[list-item]
        )
        params_list, priorities = _per_prompt(params, priority, len(conversations), "conversations")
        with self.worker.using_resources():
            prepared = [
                prepare(
                    self,
                    conversation,  # type: ignore[arg-type]
                    conversation_params,
                    tools,
                    tool_choice=tool_choice,
                    parallel_tool_calls=parallel_tool_calls,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    chat_template_kwargs=chat_template_kwargs,
                )
                for conversation, conversation_params in zip(conversations, params_list, strict=True)
            ]
        results = self.generate(
            [tokens for tokens, _ in prepared],
            [setup.params for _, setup in prepared],
            use_tqdm=use_tqdm,
            priority=priorities,
        )
        return [
            dataclasses.replace(result, outputs=[setup.finish_output(out) for out in result.outputs])
            for result, (_, setup) in zip(results, prepared, strict=True)
        ]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages`` under the model's chat template (the GGUF's
        Jinja ``tokenizer.chat_template``, rendered as HF transformers does)."""
        with self.worker.using_resources():
            return render_chat(
                self.model,
                messages,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )

    # -- prefixes ------------------------------------------------------------------------

    def register_prefix(self, prefix: Prompt, timeout: float | None = None) -> PrefixHandle:
        """Compute ``prefix`` (text or token ids) once and keep its KV for every request that
        starts with it (a shared system prompt), until ``release()``. Blocks until computed.

        A text prefix is tokenized as prompts are (with BOS), so it matches requests whose
        prompt text starts with it at a token boundary."""
        self._check_can_wait("register_prefix")
        params = SamplingParams(max_tokens=1, temperature=0)
        tokens, text = self._prompt_tokens(prefix, params)
        if len(tokens) < 2:
            raise ValueError("a prefix must be at least 2 tokens long to be worth pinning")
        kv = self._kv
        seq_id = self.worker.call(kv.new_pin_seq, timeout)
        pinned = PinnedPrefix(seq_id, tokens, text)
        if self.worker.call(lambda: kv.load_pin(pinned), timeout):  # from prefix_cache_dir
            return PrefixHandle(self, pinned)
        # Computed like a prompt in a slot, then copied into its own sequence.
        request = Request(tokens, params, streaming=False, pin=pinned)
        self._enqueue([request], block=True, timeout=timeout)
        if not request.wait(timeout) or request.finish_reason != "stop":

            def give_back() -> None:  # on the engine thread, so the request cannot pin after it
                pinned.released = True
                if kv.pinned.get(seq_id) is pinned:
                    kv.unpin(pinned)
                else:
                    kv.drop_pin_seq(seq_id)

            self._cancel(request)
            self.worker.call(give_back)
            reason = request.error or request.finish_reason or f"not computed within {timeout} s"
            raise RuntimeError(f"could not compute the prefix: {reason}")
        return PrefixHandle(self, pinned)

    def clear_prefix_cache(self) -> None:
        """Drop the prompt tokens idle slots keep for reuse (pinned prefixes stay)."""
        self.worker.call(self._kv.clear)

    # -- LoRA adapters (``generate/lora_schedule.py``) ---------------------------------

    def load_lora(self, name: str, path: str | os.PathLike[str]) -> None:
        """Make the LoRA adapter file ``path`` usable as ``SamplingParams(lora=name)`` (checked
        against the model first: ``LoraLoadError`` names a wrong file). It is loaded into
        llama.cpp when a request uses it, at most ``max_loras`` at once. Needs an engine made
        with ``lora_adapters`` or ``max_loras``."""
        lora = self._host.core.lora
        if self._host.merged_lora is not None:
            raise ValueError("this LLM serves one adapter merged into its weights (merge_lora=True)")
        if lora is None:
            raise ValueError("this LLM has no LoRA adapters: make it with lora_adapters= or max_loras=")
        lora.registry.register(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget the adapter ``name`` and free it; ``ValueError`` while a request uses it."""
        self.worker.call(lambda: unload_adapter(self._host.core, name))

    def lora_adapters(self) -> dict[str, str]:
        """The adapters requests may name: ``{name: file}`` (with ``merge_lora``, the merged one)."""
        merged = self._host.merged_lora
        if merged is not None:
            return {merged.name: str(merged.adapter)}
        lora = self._host.core.lora
        return {name: str(path) for name, path in lora.registry.names().items()} if lora is not None else {}

    @property
    def _kv(self) -> Any:
        if self.closed:
            raise EngineClosed("the LLM is closed")
        return self._host.core.kv

    # -- lifetime ------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine (requests in flight end as ``"cancelled"``) and free the model.

        From a listener or strategy (the engine's thread) it takes effect when the current
        tick ends."""
        super().close(timeout)


class PrefixHandle:
    """A pinned prefix (``LLM.register_prefix``); ``release()`` frees its KV."""

    def __init__(self, llm: LLM, pinned: PinnedPrefix) -> None:
        self._llm = llm
        self._pinned = pinned

    @property
    def tokens(self) -> list[int]:
        return list(self._pinned.tokens)

    @property
    def released(self) -> bool:
        return self._pinned.released

    def release(self) -> None:
        """Free the prefix's KV cells; requests already running are unaffected. Idempotent."""
        if self._pinned.released:
            return
        try:
            kv = self._llm._kv
            self._llm.worker.call(lambda: kv.unpin(self._pinned))
        except EngineClosed:
            self._pinned.released = True

    def __enter__(self) -> PrefixHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="prompt", file=sys.stderr, dynamic_ncols=True)


def _per_prompt(
    params: Params | Sequence[Params], priority: int | Sequence[int], count: int, what: str
) -> tuple[list[Params], list[int]]:
    """One ``params`` and one priority per prompt (or conversation) of ``count``: a single value
    repeated, or a sequence of exactly ``count``."""
    params_list: list[Params]
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        params_list = [params] * count
    else:
        params_list = list(params)
        if len(params_list) != count:
            raise ValueError(f"got {len(params_list)} SamplingParams for {count} {what}")
    priorities = [priority] * count if isinstance(priority, int) else list(priority)
    if len(priorities) != count:
        raise ValueError(f"got {len(priorities)} priorities for {count} {what}")
    return params_list, priorities
