"""``/v1/completions``: text completions, whole or streamed.

The handlers take the ``OpenAIServer`` of ``app.py`` (the engines, names, key, metrics) and
the request."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch import SamplingParams
from llamabatch.server import client_policy, prepare
from llamabatch.server.offload import ENCODE, PREPARE, run_step, small_work
from llamabatch.server.protocol import (
    bad_request,
    completion_prompts,
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
    completion_logprobs_json,
    dumps_json,
    generate_all,
    primed,
    sse_chunk,
    sse_event,
    until_disconnect,
)

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer


async def completions(server: OpenAIServer, request: Request) -> Any:
    body = await server.read_body(request, "/v1/completions")
    llm = server.need_llm()
    prompts = completion_prompts(body)
    prepare.check_queue_room(llm, len(prompts), 1)
    token_prompts = await run_step(
        request, PREPARE, prepare.tokenize_prompts, llm, prompts, small=small_work(prompts)
    )
    logprobs = body.get("logprobs", "int", minimum=0, maximum=20)
    echo = body.get("echo", "bool", False)
    # max_tokens 0 with echo: the prompt scored, nothing generated (OpenAI's legacy scoring,
    # as vLLM takes it); one token is generated and left out of the answer
    prompt_only = echo and body.data.get("max_tokens") == 0 and not isinstance(body.data["max_tokens"], bool)
    if prompt_only:
        body.data["max_tokens"] = 1
    params = await prepare.request_params(
        server,
        request,
        body,
        chat=False,
        prompt_tokens=max(map(len, token_prompts)),
        logprobs=logprobs,
        # no grammar, schema or tools, and a short body: checking the fields is quick
        small=prepare.params_pool(body) == PREPARE and small_work([await request.body()]),
    )
    prepare.check_queue_room(llm, len(prompts), params.n)
    echo_logprobs = echo and logprobs is not None  # the prompt's tokens too (lm-evaluation-harness)
    if echo_logprobs and params.prompt_logprobs is None:
        params = dataclasses.replace(params, prompt_logprobs=logprobs)
    if body.get("suffix", "str"):
        raise bad_request("'suffix' is not supported", param="suffix")
    best_of = body.get("best_of", "int")
    if best_of is not None and best_of != params.n:
        raise bad_request("'best_of' is not supported (other than equal to 'n')", param="best_of")
    stream, include_usage = server.stream_options(body)
    if stream and prompt_only:
        raise bad_request("'max_tokens' 0 (the prompt only) is not streamed", param="max_tokens")
    if stream and params.prompt_logprobs is not None:
        name = "prompt_logprobs" if "prompt_logprobs" in body else "echo"
        raise bad_request(
            "a prompt's log-probabilities are not streamed: ask with 'stream': false", param=name
        )
    priority = client_policy.request_priority(request, body, len(prompts) * params.n)  # --client-priority
    client = client_policy.client_key(request)  # clients take turns in the engine's queue
    body.warn_unknown()
    detokenize = llm.model.detokenize
    texts = (
        await run_step(
            request,
            PREPARE,
            lambda: [p if isinstance(p, str) else detokenize(p, unparse_special=True) for p in prompts],
        )
        if echo
        else None
    )
    if stream:
        gen = await primed(generate_all(llm, token_prompts, params, priority, client), request.receive)
        return EventStream(completion_events(server, gen, params, texts, include_usage, request))
    results = await until_disconnect(
        request.receive, server.collect(llm, token_prompts, params, priority, client)
    )
    for result in results:
        server.raise_for_errors(result.outputs)

    def answer() -> bytes:  # in a worker thread: log-probabilities x n make big answers
        choices, n_prompt, n_completion, cached = [], 0, 0, 0
        for p, result in enumerate(results):
            n_prompt += len(result.prompt_token_ids)
            cached += result.outputs[0].usage.reused_tokens
            prefix = texts[p] if texts is not None else ""
            scores = result.prompt_logprobs
            for out in result.outputs:
                tokens, dists, text = out.token_ids, out.logprobs, out.text
                if prompt_only:
                    tokens, dists, text = [], ([] if dists is not None else None), ""
                n_completion += len(tokens)
                lp = None
                assert server.token_text is not None
                if echo_logprobs and scores is not None and dists is not None:
                    lp = completion_logprobs_json(
                        server.token_text, result.prompt_token_ids + tokens, scores + dists, 0
                    )
                elif logprobs is not None and dists is not None:
                    lp = completion_logprobs_json(server.token_text, tokens, dists, len(prefix))
                choice = {
                    "index": p * params.n + out.index,
                    "text": prefix + text,
                    "logprobs": lp,
                    "finish_reason": finish_reason(out.finish_reason),
                }
                if "prompt_logprobs" in body and scores is not None:  # vLLM's
                    n_top = params.prompt_logprobs or 0
                    choice["prompt_logprobs"] = prompt_logprobs_json(
                        server.token_text, result.prompt_token_ids, scores, n_top
                    )
                choices.append(choice)
        return dumps_json(
            {
                "id": new_id("cmpl"),
                "object": "text_completion",
                "created": now(),
                "model": server.model_name,
                "choices": choices,
                "usage": usage(n_prompt, n_completion, cached),
            }
        )

    small = (
        logprobs is None
        and params.prompt_logprobs is None
        and small_work(out.text for result in results for out in result.outputs)
    )
    return Response(await run_step(request, ENCODE, answer, small=small), media_type="application/json")


async def completion_events(
    server: OpenAIServer,
    gen: AsyncIterator[tuple[int, Any]],
    params: SamplingParams,
    echo: list[str] | None,
    include_usage: bool,
    request: Request,
) -> AsyncIterator[bytes]:
    rid, created, n = new_id("cmpl"), now(), params.n
    offsets: dict[int, int] = {}
    n_prompt = n_completion = cached = 0

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse_chunk("text_completion", rid, created, server.model_name, choice, include_usage)

    async for p, delta in gen:
        index = p * n + delta.index
        text = delta.text
        if index not in offsets:
            offsets[index] = 0
            if echo is not None:
                text = echo[p] + text
        out = delta.output
        lp = None
        if out is not None and params.logprobs is not None and out.logprobs is not None:
            assert server.token_text is not None
            lp = await run_step(  # the stream's pump watches for the disconnect
                request,
                ENCODE,
                completion_logprobs_json,
                server.token_text,
                out.token_ids,
                out.logprobs,
                0,
                watch=False,
            )
        offsets[index] += len(text)
        if text or out is not None:
            if out is not None and out.finish_reason == "error":
                yield sse_event(generation_error(out).body())
                continue
            yield chunk(
                {
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": finish_reason(delta.finish_reason),
                }
            )
        if out is not None:
            n_completion += out.usage.completion_tokens
            if out.index == 0:
                n_prompt += out.usage.prompt_tokens
                cached += out.usage.reused_tokens
    if include_usage:
        yield sse_event(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": server.model_name,
                "choices": [],
                "usage": usage(n_prompt, n_completion, cached),
            }
        )
    yield DONE_EVENT
