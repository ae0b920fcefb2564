"""``LLM``: the engine core driven by a thread of its own, behind a small thread-safe,
streaming and asyncio API (vLLM's ``LLM`` shape).

Callers on any thread put requests and cancellations into an inbox; the engine thread
(``llamabatch.worker.Worker``) moves them into the core between steps, runs
``EngineCore.step()`` while there is work, and hands each step's deltas to the callers'
channels. The core itself is the one ``LLMEngine`` drives on the caller's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from typing_extensions import Unpack

from llamabatch.chat_template import render_chat
from llamabatch.errors import EngineClosed, QueueFull
from llamabatch.inputs import as_prompt_list
from llamabatch.kv_cache import PinnedPrefix
from llamabatch.llm_engine import EngineHost, EngineOptions, Prompt
from llamabatch.outputs import Delta, RequestOutput
from llamabatch.params import SamplingParams
from llamabatch.request import END_OF_STREAM, Channel, Request, RequestHandle, request_output
from llamabatch.toolcalls.host import ChatOptions, chat_request
from llamabatch.worker import Worker

Params = SamplingParams | Mapping[str, Any] | None


class LLM(EngineHost, Worker):
    """Many concurrent generations from one GGUF model, batched into one forward pass per tick.

    Takes the options documented on :class:`llamabatch.llm_engine.EngineHost` (``n_ctx``,
    ``n_parallel``, ``n_batch``, ``kv_unified``, ...). Every method is thread-safe.
    """

    _kind = "LLM"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        tool_call_parser: str = "auto",
        reasoning_format: str = "auto",
        **options: Unpack[EngineOptions],
    ) -> None:
        # chat(): the tool-call format ("auto": from the chat template) and <think> splitting
        self._chat_options = ChatOptions(tool_call_parser, reasoning_format)
        Worker.__init__(self, "llamabatch-engine")
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        EngineHost.__init__(self, model_path, **options)
        self._start()

    @property
    def chat_options(self) -> ChatOptions:
        """``chat()``'s defaults: ``tool_call_parser`` and ``reasoning_format``."""
        return self._chat_options

    # -- the engine thread (Worker hooks) -------------------------------------------------

    def _has_work(self) -> bool:
        core = self._core
        return bool(self._inbox or self._cancels or (core is not None and core.has_unfinished()))

    def _run_once(self) -> None:
        core = self._core
        assert core is not None
        with self._cond:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        if inbox:
            core.add(inbox, check_room=False)  # room was checked at submit
        for request in cancels:
            core.abort(request)
        events = core.step()
        for request, text, token_ids, finish_reason in events:
            request.publish(text, token_ids, finish_reason)
        if inbox or core.waiting or any(e[3] is not None for e in events):
            with self._cond:
                self._cond.notify_all()  # room in the queue for blocked submitters

    def _fail_pending(self, error: BaseException) -> None:
        core = self._core
        if core is None:
            return
        with self._cond:
            inbox, self._inbox = self._inbox, []
            self._cancels.clear()
        core.add(inbox, check_room=False)
        # Closing cancels what is in flight; a crash fails it.
        reason, message = ("cancelled", None) if isinstance(error, EngineClosed) else ("error", str(error))
        for request, text, token_ids, finish_reason in core.fail_all(reason, message):
            request.publish(text, token_ids, finish_reason)

    def _on_close(self) -> None:
        self._free()

    def _interrupt(self) -> None:
        if self._core is not None:
            self._core.stopping = True
        if hasattr(self, "context"):
            self.context.abort()  # stop a long decode early

    def _queue_depth(self) -> int:
        core = self._core
        return len(self._inbox) + (len(core.waiting) if core is not None else 0)

    def _queued(self) -> int:
        """What counts against ``max_queue`` (not the preempted requests waiting)."""
        core = self._core
        return len(self._inbox) + (core.n_queued if core is not None else 0)

    # -- the model on callers' threads ----------------------------------------------------

    def _make_requests(self, *args: Any, **kwargs: Any) -> list[Request]:
        with self._using_resources():
            return EngineHost._make_requests(self, *args, **kwargs)

    def _prompt_tokens(self, *args: Any, **kwargs: Any) -> tuple[list[int], str | None]:
        with self._using_resources():
            return EngineHost._prompt_tokens(self, *args, **kwargs)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` under the model's vocabulary."""
        with self._using_resources():
            return EngineHost.tokenize(self, text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        with self._using_resources():
            return EngineHost.detokenize(self, tokens)

    def check_prompt_bytes(self, text: str, max_tokens: int = 0) -> None:
        """``PromptTooLong`` when ``text`` cannot fit the context, before tokenizing it."""
        with self._using_resources():
            EngineHost.check_prompt_bytes(self, text, max_tokens)

    # -- requests (any thread) ------------------------------------------------------------

    def _enqueue(self, requests: list[Request], block: bool = False, timeout: float | None = None) -> None:
        """Queue requests (all or none). ``QueueFull`` beyond ``max_queue``, unless
        ``block``, which waits for room (not on the engine thread: it would wait forever)."""
        if block and self.on_worker_thread:
            block = False
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_closed()
                if self._queued() + len(requests) <= self.max_queue:
                    break
                if not block:
                    raise QueueFull(
                        f"the request queue is full ({self._queued()} waiting, max_queue={self.max_queue})"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueFull(f"no room in the queue within {timeout} s (max_queue={self.max_queue})")
                self._cond.wait(left)
            self._inbox.extend(requests)
            self._cond.notify_all()

    def _cancel(self, request: Request) -> None:
        with self._cond:
            if not self._closing:
                self._cancels.append(request)
                self._cond.notify_all()

    def _check_can_wait(self, what: str) -> None:
        if self.on_worker_thread:
            raise RuntimeError(
                f"LLM.{what}() waits for the engine, so it cannot run on the engine's own thread "
                "(in a listener or a strategy); use submit() there"
            )

    def submit(self, prompt: Prompt, params: Params = None) -> RequestHandle:
        """Queue one prompt (text or token ids); returns at once. Thread-safe.

        Raises ``ValueError`` for an empty prompt or bad params, ``PromptTooLong`` when
        prompt + max_tokens do not fit, ``QueueFull`` beyond ``max_queue``."""
        with self._cond:
            self._raise_if_closed()
        requests = self._make_requests(prompt, params, channel=Channel())
        self._enqueue(requests)
        return RequestHandle(requests, self._cancel)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: Params | Sequence[Params] = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt concurrently; one ``RequestOutput`` per prompt, in input
        order, each holding its ``n`` completions.

        ``use_tqdm`` shows a progress bar (on stderr, advancing per finished prompt) when
        there is more than one prompt. Waits for queue room rather than failing."""
        self._check_can_wait("generate")
        prompt_list, _ = as_prompt_list(prompts)
        params_list: list[Params]
        if params is None or isinstance(params, (SamplingParams, Mapping)):
            params_list = [params] * len(prompt_list)  # type: ignore[list-item]
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        groups = [
            self._make_requests(p, sp, streaming=False)
            for p, sp in zip(prompt_list, params_list, strict=True)
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

    def stream(self, prompt: Prompt, params: Params = None) -> Iterator[Delta]:
        """Yield deltas as tokens arrive (for ``n > 1``, of every completion, told apart by
        ``.index``); closing the iterator early cancels the request."""
        self._check_can_wait("stream")
        handle = self.submit(prompt, params)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()

    async def astream(self, prompt: Prompt, params: Params = None) -> AsyncIterator[Delta]:
        """Async iterator of deltas (``.index`` tells ``n > 1`` completions apart);
        cancelling the consuming task cancels the request."""
        requests, aqueue = await self._submit_async(prompt, params, streaming=True)
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

    async def agenerate(self, prompt: Prompt, params: Params = None) -> RequestOutput:
        """Await one prompt's ``RequestOutput`` (all ``n`` completions); cancelling the
        awaiting task cancels the request."""
        requests, aqueue = await self._submit_async(prompt, params, streaming=False)
        try:
            ends = 0
            while ends < len(requests):  # only the completions' ends arrive
                ends += (await aqueue.get()) is END_OF_STREAM
        finally:
            self._cancel_unfinished(requests)
        return request_output(requests)

    async def _submit_async(
        self, prompt: Prompt, params: Params, streaming: bool
    ) -> tuple[list[Request], Any]:
        """Submit a prompt whose deltas go to an asyncio queue of the running loop. The
        prompt is tokenized and its samplers (grammars) built in a worker thread, so a heavy
        prompt or grammar does not stall the event loop."""
        with self._cond:
            self._raise_if_closed()
        channel = Channel()
        aqueue: asyncio.Queue[Any] = asyncio.Queue()
        channel.listen_from(asyncio.get_running_loop(), aqueue)
        built = asyncio.ensure_future(
            asyncio.to_thread(self._make_requests, prompt, params, channel=channel, streaming=streaming)
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
        params: Params = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Chat completions of one conversation (a list of messages) or of many (a list of
        such lists), formatted with the GGUF's chat template (or ``chat_template``: a Jinja
        template, or a llama.cpp built-in name such as ``"chatml"``). Returns one
        ``RequestOutput`` per conversation, as ``generate`` does.

        Answers are split as the OpenAI API does: ``CompletionOutput.reasoning`` holds a
        ``<think>`` block, ``.tool_calls`` the calls of ``tools`` (``ToolCall``: id, name,
        JSON arguments), ``.text`` the content. ``tool_choice``: "auto" (default with tools),
        "none", "required" or ``{"type": "function", "function": {"name": ...}}`` (the last
        two force a call with a grammar from the tools' schemas). Conversations may hold
        assistant ``tool_calls`` and ``tool`` messages."""
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)  # type: ignore[list-item]
        )
        with self._using_resources():
            prepared = [
                chat_request(
                    self,
                    self._chat_options,
                    conversation,  # type: ignore[arg-type]
                    params,
                    tools=tools,
                    tool_choice=tool_choice,
                    parallel_tool_calls=parallel_tool_calls,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    chat_template_kwargs=chat_template_kwargs,
                )
                for conversation in conversations
            ]
        shared = prepared[0][1].params if prepared else params  # the same for every conversation
        results = self.generate([tokens for tokens, _ in prepared], shared, use_tqdm=use_tqdm)
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
        with self._using_resources():
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
        seq_id = self.call(kv.new_pin_seq, timeout)
        pinned = PinnedPrefix(seq_id, tokens, text)
        # Computed like a prompt in a slot, then copied into its own sequence.
        request = Request(tokens, params, streaming=False)
        request.pin = pinned
        self._enqueue([request], block=True, timeout=timeout)
        if not request.wait(timeout) or request.finish_reason != "stop":

            def give_back() -> None:  # on the engine thread, so the request cannot pin after it
                pinned.released = True
                if kv.pinned.get(seq_id) is pinned:
                    kv.unpin(pinned)
                else:
                    kv.drop_pin_seq(seq_id)

            self._cancel(request)
            self.call(give_back)
            reason = request.error or request.finish_reason or f"not computed within {timeout} s"
            raise RuntimeError(f"could not compute the prefix: {reason}")
        return PrefixHandle(self, pinned)

    def clear_prefix_cache(self) -> None:
        """Drop the prompt tokens idle slots keep for reuse (pinned prefixes stay)."""
        self.call(self._kv.clear)

    @property
    def _kv(self) -> Any:
        core = self._core
        if core is None or self.closed:
            raise EngineClosed("the LLM is closed")
        return core.kv

    # -- lifetime ------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine (requests in flight end as ``"cancelled"``) and free the model.

        From a listener or strategy (the engine's thread) it takes effect when the current
        tick ends."""
        Worker.close(self, timeout)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closing:
                self.close(timeout=5)
        except Exception:
            pass


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
            self._llm.call(lambda: kv.unpin(self._pinned))
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
