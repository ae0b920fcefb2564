"""``/v1/chat/completions``: chat completions (with tool calls and reasoning), whole or
streamed.

The request goes through the chat pipeline of ``LLM.chat`` (``llamabatch.chat``): rendered and
tokenized, then its ``ChatSetup`` (tool grammars, the answer's reader); answers are split by
``ChatSetup.finish_output`` and ``ChatSetup.stream``. This module keeps the HTTP: reading the
body's fields, the worker pools, errors as 400s, the JSON and SSE framing.

The handlers take the ``OpenAIServer`` (the engines, names, key, metrics) and the request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch import SamplingParams
from llamabatch.chat import ChatRequest, ChatSetup, ChatStream, assistant_message
from llamabatch.server import client_policy, prepare
from llamabatch.server.offload import ENCODE, PREPARE, run_step, small_work
from llamabatch.server.protocol import (
    Body,
    bad_request,
    chat_messages,
    finish_reason,
    generation_error,
    new_id,
    now,
    prompt_logprobs_json,
    usage,
)
from llamabatch.server.streaming import (
    DONE_EVENT,
    EventStream,
    chat_logprobs_json,
    dumps_json,
    generate_all,
    primed,
    sse_chunk,
    sse_event,
    until_disconnect,
)

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer


async def prepare_chat(
    server: OpenAIServer, request: Request, body: Body, logprobs: int | None = None
) -> tuple[Any, ChatSetup]:
    """A chat body's prompt (tokens, or with its images) and ``ChatSetup`` (its sampling
    parameters, tool grammars and the answer's reader), built in worker threads: Jinja and
    the tokenizer, then grammar building, are CPU work. Shared with ``/v1/messages`` and
    ``/v1/responses``."""
    llm = server.need_llm()
    chat = read_chat_request(body, server.chat_template)
    rendered = await run_step(request, PREPARE, prepare.render_chat_request, llm, chat)
    params = await prepare.request_params(
        server, request, body, chat=True, prompt_tokens=len(rendered.tokens), logprobs=logprobs
    )
    setup = await run_step(request, prepare.params_pool(body), prepare.chat_setup, rendered, params)
    prepare.check_queue_room(llm, 1, setup.params.n)
    return rendered.prompt, setup


@dataclass(frozen=True)
class TranslatedChat:
    """A request of another chat API (``/v1/messages``, ``/v1/responses``) on this pipeline:
    its own body (``data``), the chat body, prompt and setup, and how it runs."""

    data: dict[str, Any]
    body: Body
    prompt: Any
    setup: ChatSetup
    stream: bool
    priority: int
    client: str | None


async def translated_chat(
    server: OpenAIServer, request: Request, endpoint: str, translate: Callable[[Any], dict[str, Any]]
) -> TranslatedChat:
    """Read a body of another chat API, translate it to a chat body (in a worker pool unless
    small: the translation walks every item) and prepare it as ``/v1/chat/completions`` does."""
    raw = await server.read_body(request, endpoint)
    small = small_work([await request.body()])
    body = Body(await run_step(request, PREPARE, translate, raw.data, small=small), endpoint)
    prompt, setup = await prepare_chat(server, request, body)
    stream = body.get("stream", "bool", False)
    priority = client_policy.request_priority(request, body, setup.params.n)
    client = client_policy.client_key(request)
    body.get("metadata", "dict")  # (the client's own)
    body.warn_unknown()
    return TranslatedChat(raw.data, body, prompt, setup, stream, priority, client)


async def chat_completions(server: OpenAIServer, request: Request) -> Any:
    body = await server.read_body(request, "/v1/chat/completions")
    llm = server.need_llm()
    want_logprobs = body.get("logprobs", "bool", False)
    top = body.get("top_logprobs", "int", minimum=0, maximum=20)
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    prompt, setup = await prepare_chat(server, request, body, (top or 0) if want_logprobs else None)
    params = setup.params
    stream, include_usage = server.stream_options(body)
    priority = client_policy.request_priority(request, body, params.n)  # --client-priority, per-client share
    client = client_policy.client_key(request)  # clients take turns in the engine's queue
    body.warn_unknown()
    if stream and params.prompt_logprobs is not None:
        raise bad_request(
            "a prompt's log-probabilities are not streamed: ask with 'stream': false", param="prompt_logprobs"
        )
    if stream:
        gen = await primed(generate_all(llm, [prompt], params, priority, client), request.receive)
        return EventStream(chat_events(server, gen, params, top or 0, include_usage, setup, request))
    (result,) = await until_disconnect(
        request.receive, server.collect(llm, [prompt], params, priority, client)
    )
    server.raise_for_errors(result.outputs)

    def answer() -> bytes:  # in a worker thread: log-probabilities x n make big answers
        choices = []
        for out in result.outputs:
            out = setup.finish_output(out)  # content, reasoning_content, tool_calls
            lp = None
            if want_logprobs and out.logprobs is not None:
                assert server.token_text is not None
                lp = chat_logprobs_json(server.token_text, out.token_ids, out.logprobs, top or 0)
            choices.append(
                {
                    "index": out.index,
                    "message": assistant_message(out),
                    "logprobs": lp,
                    "finish_reason": finish_reason(out.finish_reason),
                }
            )
        n_completion = sum(o.usage.completion_tokens for o in result.outputs)
        first = result.outputs[0].usage
        response = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": server.model_name,
            "choices": choices,
            # the engine's count: an M-RoPE image counts its embeddings, not its positions
            "usage": usage(first.prompt_tokens, n_completion, first.reused_tokens),
        }
        if result.prompt_logprobs is not None:  # vLLM's
            assert server.token_text is not None
            response["prompt_logprobs"] = prompt_logprobs_json(
                server.token_text,
                result.prompt_token_ids,
                result.prompt_logprobs,
                params.prompt_logprobs or 0,
            )
        return dumps_json(response)

    return Response(await run_step(request, ENCODE, answer), media_type="application/json")


async def chat_events(
    server: OpenAIServer,
    gen: AsyncIterator[tuple[int, Any]],
    params: SamplingParams,
    top: int,
    include_usage: bool,
    setup: ChatSetup,
    request: Request,
) -> AsyncIterator[bytes]:
    rid, created = new_id("chatcmpl"), now()
    started: set[int] = set()
    streams: dict[int, ChatStream] = {}  # per choice: its answer's reader
    n_prompt = n_completion = cached = 0

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse_chunk("chat.completion.chunk", rid, created, server.model_name, choice, include_usage)

    async for _, delta in gen:
        index = delta.index
        if index not in started:
            started.add(index)
            yield chunk(
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        answer = streams.get(index)
        if answer is None:
            answer = streams[index] = setup.stream()
        pieces = answer.feed(delta.text)
        out = delta.output
        if out is not None:
            pieces += answer.finish(out.finish_reason)
        for piece in pieces:
            yield chunk({"index": index, "delta": piece.to_dict(), "logprobs": None, "finish_reason": None})
        if out is None:
            continue
        if out.finish_reason == "error":
            yield sse_event(generation_error(out).body())
            continue
        lp = None
        if params.logprobs is not None and out.logprobs is not None:
            assert server.token_text is not None
            lp = await run_step(  # the stream's pump watches for the disconnect
                request,
                ENCODE,
                chat_logprobs_json,
                server.token_text,
                out.token_ids,
                out.logprobs,
                top,
                watch=False,
            )
        yield chunk(
            {
                "index": index,
                "delta": {},
                "logprobs": lp,
                "finish_reason": finish_reason(answer.finish_reason),
            }
        )
        n_completion += out.usage.completion_tokens
        if out.index == 0:
            n_prompt, cached = out.usage.prompt_tokens, out.usage.reused_tokens
    if include_usage:
        yield sse_event(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": server.model_name,
                "choices": [],
                "usage": usage(n_prompt, n_completion, cached),
            }
        )
    yield DONE_EVENT


def read_chat_request(body: Body, chat_template: str | None) -> ChatRequest:
    """The body's chat fields (types only: the pipeline checks the rest); ``chat_template``
    is the server's (``--chat-template``)."""
    messages = chat_messages(body)
    tools = body.get("tools", "list")
    tool_choice = body.data.get("tool_choice")
    body.read.add("tool_choice")
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise bad_request("'tool_choice' must be a string or an object", param="tool_choice")
    return ChatRequest(
        messages,
        tools,
        tool_choice,
        parallel_tool_calls=body.get("parallel_tool_calls", "bool", True),
        chat_template=chat_template,
        add_generation_prompt=body.get("add_generation_prompt", "bool", True),
        chat_template_kwargs=body.get("chat_template_kwargs", "dict"),
    )
