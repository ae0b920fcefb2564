"""The OpenAI-compatible ASGI app (Starlette) over an ``LLM`` and/or an ``Embedder``.

Built on llamabatch's public API only: ``LLM.astream``/``agenerate`` and
``apply_chat_template``, ``Embedder.aembed``, ``SamplingParams`` and
``llamabatch.metrics``. Every request runs on the event loop; the engines' own threads do
the work, so one process serves many clients with one batched forward pass per tick.
Nothing heavier than parsing a bounded body runs on the loop: tokenizing, rendering chat
templates and building samplers (grammars) happen in worker threads (``asyncio.to_thread``;
``astream``/``agenerate``/``aembed`` do it themselves), and the HTTP edge (Host, Content-Type,
body size and time) is checked first, by ``limits.EdgeGuard``.

A client that goes away cancels its generation: each request races its work against the
ASGI ``http.disconnect`` message, and cancelling the task that awaits ``astream`` cancels the
request in the engine before its next tick.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llamabatch import LLM, Embedder, PromptTooLong, SamplingParams
from llamabatch.metrics import PrometheusListener
from llamabatch.server import prepare
from llamabatch.server.chat_tools import ChatStream, chat_message, read_tool_request, setup_chat
from llamabatch.server.limits import EdgeGuard, ServerLimits, read_json
from llamabatch.server.protocol import (
    APIError,
    Body,
    TokenText,
    bad_request,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    finish_reason,
    new_id,
    now,
    sampling_params,
    usage,
)
from llamabatch.server.rerank import Reranker, rerank_endpoint  # /v1/rerank (issue 25)
from llamabatch.server.streaming import (
    _DONE_EVENT,
    EventStream,
    _chunk,
    _generate,
    _json_response,
    _primed,
    _sse,
    error_response,
    until_disconnect,
)
from llamabatch.toolcalls.chat import ChatSetup

logger = logging.getLogger("llamabatch.server")

__all__ = ["create_app"]


class OpenAIServer:
    """The endpoints' state: engines, names, key and metrics (see :func:`create_app`)."""

    def __init__(
        self,
        llm: LLM | None,
        embedder: Embedder | None,
        *,
        model_name: str | None,
        embedding_model_name: str | None,
        api_key: str | None,
        metrics: PrometheusListener | None,
        chat_template: str | None,
        reranker: Reranker | None = None,
        rerank_model_name: str | None = None,
    ) -> None:
        if llm is None and embedder is None and reranker is None:
            raise ValueError("give an LLM, an Embedder, or both (and/or a Reranker)")
        self.llm = llm
        self.embedder = embedder
        # -- rerank (issue 25): /v1/rerank's model
        self.reranker = reranker
        self.rerank_model_name = rerank_model_name or (
            reranker.model.path.stem if reranker is not None else None
        )
        self.model_name = model_name or (llm.model.path.stem if llm is not None else None)
        self.embedding_model_name = embedding_model_name or (
            embedder.model.path.stem if embedder is not None else None
        )
        self.api_key = api_key
        self.chat_template = chat_template
        self.created = now()
        if metrics is None:
            metrics = PrometheusListener()
            if llm is not None:
                metrics.attach(llm, self.model_name)
            if embedder is not None:
                metrics.attach(embedder, self.embedding_model_name)
            if reranker is not None:
                metrics.attach(reranker, self.rerank_model_name)
        self.metrics = metrics
        self.token_text = TokenText(llm.model) if llm is not None else None

    # -- plumbing ------------------------------------------------------------------------

    def endpoint(
        self, handler: Callable[[Request], Awaitable[Any]], *, auth: bool = True
    ) -> Callable[[Request], Awaitable[Any]]:
        async def run(request: Request) -> Any:
            try:
                if auth:
                    self._check_key(request)
                return await handler(request)
            except Exception as exc:  # each error's status and JSON: streaming.error_response
                return error_response(request, exc)

        return run

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "Incorrect API key provided (send 'Authorization: Bearer <key>').",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @staticmethod
    async def _body(request: Request, endpoint: str) -> Body:
        """The request's JSON body (size and time bounded by ``EdgeGuard``), parsed strictly
        (``limits.parse_json``: 400 for bad JSON, NaN/Infinity, deep nesting)."""
        body = request.state.body = Body(await read_json(request), endpoint)
        return body

    # the CPU work and its bounds (server/prepare.py); worker threads run the heavy ones
    _check_queue_room = staticmethod(prepare.check_queue_room)
    _prompt_fits = staticmethod(prepare.prompt_fits)
    _tokenize_prompts = staticmethod(prepare.tokenize_prompts)
    _chat_tokens = staticmethod(prepare.chat_tokens)
    _count_embedding_tokens = staticmethod(prepare.count_embedding_tokens)

    def _need_llm(self) -> LLM:
        if self.llm is None:
            raise APIError(
                404,
                "this server has no generation model (start it with -m MODEL.gguf)",
                code="model_not_found",
            )
        return self.llm

    def _stream_options(self, body: Body) -> tuple[bool, bool]:
        stream = body.get("stream", "bool", False)
        options = body.get("stream_options", "dict")
        if options is None:
            return stream, False
        if not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean", param="stream_options")
        return stream, include

    @staticmethod
    async def _collect(llm: LLM, prompts: Sequence[Any], params: SamplingParams) -> list[Any]:
        tasks = [asyncio.ensure_future(llm.agenerate(p, params)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    @staticmethod
    def _raise_for_errors(outputs: Sequence[Any]) -> None:
        for out in outputs:
            if out.finish_reason == "error":
                raise APIError(500, f"generation failed: {out.error}", type="server_error")

    # -- endpoints -----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        engines = [e for e in (self.llm, self.embedder, self.reranker) if e is not None]
        if any(e.closed for e in engines):
            return _json_response({"status": "unavailable"}, 503)
        return _json_response({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        data = []
        if self.llm is not None:
            data.append(self._model_card(self.model_name, self.llm.n_ctx_seq))
        if self.embedder is not None:
            data.append(self._model_card(self.embedding_model_name, self.embedder.max_tokens))
        if self.reranker is not None:
            data.append(self._model_card(self.rerank_model_name, self.reranker.max_length))
        return _json_response({"object": "list", "data": data})

    def _model_card(self, name: str | None, max_len: int) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "llamabatch",
            "max_model_len": max_len,
        }

    async def completions(self, request: Request) -> Any:
        body = await self._body(request, "/v1/completions")
        llm = self._need_llm()
        prompts = completion_prompts(body)
        self._check_queue_room(llm, len(prompts), 1)
        token_prompts = await asyncio.to_thread(self._tokenize_prompts, llm, prompts)
        logprobs = body.get("logprobs", "int", minimum=0, maximum=20)
        params = await asyncio.to_thread(
            sampling_params,
            body,
            chat=False,
            prompt_tokens=max(map(len, token_prompts)),
            n_ctx_seq=llm.n_ctx_seq,
            logprobs=logprobs,
        )
        self._check_queue_room(llm, len(prompts), params.n)
        echo = body.get("echo", "bool", False)
        if body.get("suffix", "str"):
            raise bad_request("'suffix' is not supported", param="suffix")
        best_of = body.get("best_of", "int")
        if best_of is not None and best_of != params.n:
            raise bad_request("'best_of' is not supported (other than equal to 'n')", param="best_of")
        stream, include_usage = self._stream_options(body)
        body.warn_unknown()
        detokenize = llm.model.detokenize
        texts = (
            await asyncio.to_thread(
                lambda: [p if isinstance(p, str) else detokenize(p, unparse_special=True) for p in prompts]
            )
            if echo
            else None
        )
        if stream:
            gen = await _primed(_generate(llm, token_prompts, params), request.receive)
            return EventStream(self._completion_events(gen, params, texts, include_usage))
        results = await until_disconnect(request.receive, self._collect(llm, token_prompts, params))
        choices, n_prompt, n_completion, cached = [], 0, 0, 0
        for p, result in enumerate(results):
            self._raise_for_errors(result.outputs)
            n_prompt += len(result.prompt_token_ids)
            cached += result.outputs[0].usage.reused_tokens
            prefix = texts[p] if texts is not None else ""
            for out in result.outputs:
                n_completion += out.usage.completion_tokens
                lp = None
                if logprobs is not None and out.logprobs is not None:
                    assert self.token_text is not None
                    lp = completion_logprobs(self.token_text, out.token_ids, out.logprobs, len(prefix))
                choices.append(
                    {
                        "index": p * params.n + out.index,
                        "text": prefix + out.text,
                        "logprobs": lp,
                        "finish_reason": finish_reason(out.finish_reason),
                    }
                )
        return _json_response(
            {
                "id": new_id("cmpl"),
                "object": "text_completion",
                "created": now(),
                "model": self.model_name,
                "choices": choices,
                "usage": usage(n_prompt, n_completion, cached),
            }
        )

    async def _completion_events(
        self,
        gen: AsyncIterator[tuple[int, Any]],
        params: SamplingParams,
        echo: list[str] | None,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        rid, created, n = new_id("cmpl"), now(), params.n
        offsets: dict[int, int] = {}
        n_prompt = n_completion = cached = 0

        def chunk(choice: dict[str, Any]) -> bytes:
            return _chunk("text_completion", rid, created, self.model_name, choice, include_usage)

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
                assert self.token_text is not None
                lp = completion_logprobs(self.token_text, out.token_ids, out.logprobs, 0)
            offsets[index] += len(text)
            if text or out is not None:
                if out is not None and out.finish_reason == "error":
                    yield _sse(APIError(500, f"generation failed: {out.error}", type="server_error").body())
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
            yield _sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": usage(n_prompt, n_completion, cached),
                }
            )
        yield _DONE_EVENT

    async def chat_completions(self, request: Request) -> Any:
        body = await self._body(request, "/v1/chat/completions")
        llm = self._need_llm()
        messages = chat_messages(body)
        tool_request = read_tool_request(body)  # tools, tool_choice: server/chat_tools.py
        add_generation_prompt = body.get("add_generation_prompt", "bool", True)
        template_kwargs = body.get("chat_template_kwargs", "dict")

        def render() -> tuple[list[int], str]:  # in a worker thread: Jinja and the tokenizer are CPU work
            try:
                text = llm.apply_chat_template(
                    messages,
                    tools=tool_request.template_tools,
                    chat_template=self.chat_template,
                    add_generation_prompt=add_generation_prompt,
                    chat_template_kwargs=template_kwargs,
                )
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
            return self._chat_tokens(llm, text), text

        tokens, prompt_text = await asyncio.to_thread(render)
        want_logprobs = body.get("logprobs", "bool", False)
        top = body.get("top_logprobs", "int", minimum=0, maximum=20)
        if top is not None and not want_logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        params = await asyncio.to_thread(
            sampling_params,
            body,
            chat=True,
            prompt_tokens=len(tokens),
            n_ctx_seq=llm.n_ctx_seq,
            logprobs=(top or 0) if want_logprobs else None,
        )
        template = self.chat_template if self.chat_template is not None else llm.model.chat_template
        setup = await asyncio.to_thread(  # tool-call grammars and the answer's parser
            setup_chat, params, tool_request, llm.chat_options, template, prompt_text
        )
        params = setup.params
        self._check_queue_room(llm, 1, params.n)
        stream, include_usage = self._stream_options(body)
        body.warn_unknown()
        if stream:
            gen = await _primed(_generate(llm, [tokens], params), request.receive)
            return EventStream(self._chat_events(gen, params, top or 0, include_usage, setup))
        (result,) = await until_disconnect(request.receive, self._collect(llm, [tokens], params))
        self._raise_for_errors(result.outputs)
        choices = []
        for out in result.outputs:
            out = setup.finish_output(out)  # content, reasoning_content, tool_calls
            lp = None
            if want_logprobs and out.logprobs is not None:
                assert self.token_text is not None
                lp = {"content": chat_logprobs(self.token_text, out.token_ids, out.logprobs, top or 0)}
            choices.append(
                {
                    "index": out.index,
                    "message": chat_message(out),
                    "logprobs": lp,
                    "finish_reason": finish_reason(out.finish_reason),
                }
            )
        n_completion = sum(o.usage.completion_tokens for o in result.outputs)
        return _json_response(
            {
                "id": new_id("chatcmpl"),
                "object": "chat.completion",
                "created": now(),
                "model": self.model_name,
                "choices": choices,
                "usage": usage(len(tokens), n_completion, result.outputs[0].usage.reused_tokens),
            }
        )

    async def _chat_events(
        self,
        gen: AsyncIterator[tuple[int, Any]],
        params: SamplingParams,
        top: int,
        include_usage: bool,
        setup: ChatSetup,
    ) -> AsyncIterator[bytes]:
        rid, created = new_id("chatcmpl"), now()
        started: set[int] = set()
        streams: dict[int, ChatStream] = {}  # per choice: reasoning / content / tool calls
        n_prompt = n_completion = cached = 0

        def chunk(choice: dict[str, Any]) -> bytes:
            return _chunk("chat.completion.chunk", rid, created, self.model_name, choice, include_usage)

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
            if index not in streams:
                streams[index] = ChatStream(setup)
            split = streams[index]
            pieces = split.feed(delta.text) if delta.text else []
            if delta.output is not None and delta.output.finish_reason != "error":
                pieces += split.finish()
            for piece in pieces:
                yield chunk({"index": index, "delta": piece, "logprobs": None, "finish_reason": None})
            out = delta.output
            if out is None:
                continue
            if out.finish_reason == "error":
                yield _sse(APIError(500, f"generation failed: {out.error}", type="server_error").body())
                continue
            lp = None
            if params.logprobs is not None and out.logprobs is not None:
                assert self.token_text is not None
                lp = {"content": chat_logprobs(self.token_text, out.token_ids, out.logprobs, top)}
            yield chunk(
                {
                    "index": index,
                    "delta": {},
                    "logprobs": lp,
                    "finish_reason": finish_reason(split.finish_reason(out.finish_reason)),
                }
            )
            n_completion += out.usage.completion_tokens
            if out.index == 0:
                n_prompt, cached = out.usage.prompt_tokens, out.usage.reused_tokens
        if include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": usage(n_prompt, n_completion, cached),
                }
            )
        yield _DONE_EVENT

    async def embeddings(self, request: Request) -> Response:
        body = await self._body(request, "/v1/embeddings")
        embedder = self.embedder
        if embedder is None:
            raise APIError(
                404,
                "this server has no embedding model (start it with --embedding-model EMB.gguf)",
                code="model_not_found",
            )
        data = body.data.get("input")
        body.read.add("input")
        texts = [data] if isinstance(data, str) else data
        if not isinstance(texts, list) or not texts or len(texts) > prepare.MAX_EMBEDDING_INPUTS:
            raise bad_request(
                f"'input' must be a string or an array of 1 to {prepare.MAX_EMBEDDING_INPUTS} strings",
                param="input",
            )
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise bad_request(
                    f"'input[{i}]' must be a string (token-id inputs are not supported)", param="input"
                )
            if not text:
                raise bad_request(f"'input[{i}]' is empty", param="input")
        encoding = body.get("encoding_format", "str", "float")
        if encoding not in ("float", "base64"):
            raise bad_request("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        dimensions = body.get("dimensions", "int")
        if dimensions is not None and dimensions != embedder.n_out:
            raise bad_request(f"'dimensions' must be {embedder.n_out} for this model", param="dimensions")
        body.warn_unknown()
        try:
            n_tokens = await asyncio.to_thread(self._count_embedding_tokens, embedder, texts)
            vectors = await until_disconnect(request.receive, embedder.aembed(texts))
        except PromptTooLong as exc:
            raise bad_request(str(exc), param="input", code="context_length_exceeded") from None
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), param="input") from None
        payload = await asyncio.to_thread(  # vector by vector: JSON-encoding floats holds the GIL
            prepare.embedding_response, vectors, encoding, self.embedding_model_name, n_tokens
        )
        return Response(payload, media_type="application/json")

    async def rerank(self, request: Request) -> Response:
        """``/v1/rerank`` and ``/rerank`` (issue 25; the logic is in llamabatch.server.rerank)."""
        body = await self._body(request, "/v1/rerank")
        answer = await rerank_endpoint(self.reranker, self.rerank_model_name, body, request.receive)
        return _json_response(answer)

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request, "/tokenize")
        text = body.get("prompt", "str")
        if text is None:
            text = body.get("content", "str")  # llama.cpp server's name
        add_special = body.get("add_special_tokens", "bool")
        if add_special is None:
            add_special = body.get("add_special", "bool", True)
        with_pieces = body.get("with_pieces", "bool", False)
        messages = body.get("messages", "list")
        if (text is None) == (messages is None):
            raise bad_request("give either 'prompt' (or 'content') or 'messages'", param="prompt")
        if self.llm is not None:
            model, max_len = self.llm.model, self.llm.n_ctx_seq
        elif self.embedder is not None:
            model, max_len = self.embedder.model, self.embedder.max_tokens
        else:
            assert self.reranker is not None
            model, max_len = self.reranker.model, self.reranker.max_length
        add_generation_prompt = body.get("add_generation_prompt", "bool", True)
        llm = self._need_llm() if messages is not None else self.llm
        body.warn_unknown()

        def run() -> list[Any]:  # in a worker thread: rendering and tokenizing are CPU work
            if messages is not None:
                assert llm is not None
                try:
                    rendered = llm.apply_chat_template(
                        messages,
                        chat_template=self.chat_template,
                        add_generation_prompt=add_generation_prompt,
                    )
                except ValueError as exc:
                    raise bad_request(str(exc), param="messages") from None
                tokens = self._chat_tokens(llm, rendered)
            elif llm is not None:
                self._prompt_fits(llm, text, "prompt")
                tokens = llm.tokenize(text, add_special=add_special, parse_special=True)
            else:
                tokens = model.tokenize(text, add_special=add_special, parse_special=True)
            if not with_pieces:
                return tokens
            return [
                {"id": t, "piece": model.token_to_piece(t, special=True).decode("utf-8", "replace")}
                for t in tokens
            ]

        out = await asyncio.to_thread(run)
        return _json_response({"tokens": out, "count": len(out), "max_model_len": max_len})

    async def detokenize(self, request: Request) -> Response:
        body = await self._body(request, "/detokenize")
        tokens = body.get("tokens", "list")
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("'tokens' must be an array of token ids", param="tokens")
        body.warn_unknown()
        engine = self.llm or self.embedder or self.reranker
        model = engine.model  # type: ignore[union-attr]
        try:  # special tokens as text, in a worker thread
            text = await asyncio.to_thread(model.detokenize, tokens, unparse_special=True)
        except ValueError as exc:
            raise bad_request(str(exc), param="tokens") from None
        return _json_response({"prompt": text, "content": text})


def create_app(
    llm: LLM | None = None,
    *,
    embedder: Embedder | None = None,
    model_name: str | None = None,
    embedding_model_name: str | None = None,
    api_key: str | None = None,
    metrics: PrometheusListener | None = None,
    chat_template: str | None = None,
    limits: ServerLimits | None = None,
    cors_origins: Sequence[str] | None = None,
    reranker: Reranker | None = None,
    rerank_model_name: str | None = None,
) -> Starlette:
    """The OpenAI-compatible Starlette app over ``llm`` and/or ``embedder`` (not closed by it).

    Args:
        llm: serves ``/v1/completions`` and ``/v1/chat/completions``.
        embedder: serves ``/v1/embeddings``.
        model_name, embedding_model_name: the ``id``s ``/v1/models`` lists and responses
            carry (default: the GGUF file stems). Requests may name any model: each
            endpoint has one.
        api_key: when set, every endpoint but ``/health`` and ``/metrics`` needs
            ``Authorization: Bearer <api_key>``.
        metrics: the ``PrometheusListener`` ``/metrics`` exposes (default: a new one,
            attached to both engines).
        chat_template: a Jinja chat template (or llama.cpp built-in name) replacing the
            GGUF's.
        limits: the HTTP edge's limits (``ServerLimits``: body size, body time, allowed
            ``Host`` names); default: ``ServerLimits()`` (16 MiB, 60 s, IP literals and
            localhost names; Starlette's ``TestClient`` sends ``Host: testserver``).
        cors_origins: origins browsers may call the server from (``["*"]``: any); default
            none, and no CORS headers are sent.
        reranker, rerank_model_name: a ``Reranker`` serving ``/v1/rerank`` and ``/rerank``
            (llama-server's / Jina's format), and its ``id`` (default: the GGUF file stem).
    """
    server = OpenAIServer(
        llm,
        embedder,
        model_name=model_name,
        embedding_model_name=embedding_model_name,
        api_key=api_key,
        metrics=metrics,
        chat_template=chat_template,
        reranker=reranker,
        rerank_model_name=rerank_model_name,
    )
    ep = server.endpoint
    routes = [
        Route("/health", ep(server.health, auth=False), methods=["GET"]),
        Route("/metrics", ep(server.metrics_endpoint, auth=False), methods=["GET"]),
        Route("/tokenize", ep(server.tokenize), methods=["POST"]),
        Route("/detokenize", ep(server.detokenize), methods=["POST"]),
    ]
    for prefix in ("/v1", ""):  # llama.cpp's server answers without /v1 too
        routes += [
            Route(f"{prefix}/models", ep(server.models), methods=["GET"]),
            Route(f"{prefix}/completions", ep(server.completions), methods=["POST"]),
            Route(f"{prefix}/chat/completions", ep(server.chat_completions), methods=["POST"]),
            Route(f"{prefix}/embeddings", ep(server.embeddings), methods=["POST"]),
            Route(f"{prefix}/rerank", ep(server.rerank), methods=["POST"]),  # issue 25
        ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = APIError(
            exc.status_code,
            f"{exc.detail}: {request.method} {request.url.path}",
            code="not_found" if exc.status_code == 404 else None,
        )
        return _json_response(error.body(), exc.status_code, dict(exc.headers or {}))

    middleware = [Middleware(EdgeGuard, limits=limits if limits is not None else ServerLimits())]
    if cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            )
        )
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=middleware)
    app.state.server = server
    return app
