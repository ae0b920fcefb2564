"""The OpenAI-compatible ASGI app (Starlette) over an ``LLM`` and/or an ``Embedder``.

This module composes the app: ``OpenAIServer`` (the engines, names, key, metrics and the
plumbing every endpoint uses) and ``create_app`` (routes, middleware). One module per endpoint
family holds the handlers: ``completions.py``, ``chat.py`` (tool calls: ``chat_tools.py``),
``embeddings.py``, ``rerank.py``, ``tokenize.py`` and ``models.py`` (``/health``, ``/metrics``,
``/v1/models``); ``protocol.py`` reads requests, ``prepare.py`` does their CPU work,
``streaming.py`` writes responses and ``limits.py`` guards the HTTP edge.

Built on llamabatch's public API only: ``LLM.astream``/``agenerate`` and
``apply_chat_template``, ``Embedder.aembed``, ``SamplingParams`` and
``llamabatch.runtime.metrics``. Every request runs on the event loop; the engines' own threads do
the work, so one process serves many clients with one batched forward pass per tick.
Nothing heavier than parsing a bounded body runs on the loop: tokenizing, rendering chat
templates, building samplers (grammars) and encoding big answers happen in the bounded worker
pools of ``offload.py``, within each request's time budget, and the HTTP edge (Host,
Content-Type, body size and time) is checked first, by ``limits.EdgeGuard``.

A client that goes away cancels its generation: each request races its work against the
ASGI ``http.disconnect`` message, and cancelling the task that awaits ``astream`` cancels the
request in the engine before its next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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

from llamabatch import LLM, Embedder, SamplingParams
from llamabatch.embed.reranker import Reranker
from llamabatch.runtime.metrics import PrometheusListener
from llamabatch.server import chat, completions, embeddings, models, rerank, tokenize
from llamabatch.server.client_policy import ClientPolicy, ClientShare
from llamabatch.server.limits import EdgeGuard, ServerLimits, read_json
from llamabatch.server.offload import Offload, WorkLimits
from llamabatch.server.protocol import (
    APIError,
    Body,
    TokenText,
    bad_request,
    generation_error,
    now,
)
from llamabatch.server.streaming import (
    error_response,
    json_response,
)

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
        offload: Offload | None = None,
    ) -> None:
        if llm is None and embedder is None and reranker is None:
            raise ValueError("give an LLM, an Embedder, or both (and/or a Reranker)")
        self.llm = llm
        self.embedder = embedder
        #: the worker pools of the requests' CPU-heavy steps
        self.offload = offload if offload is not None else Offload()
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
    async def read_body(request: Request, endpoint: str) -> Body:
        """The request's JSON body (size and time bounded by ``EdgeGuard``), parsed strictly
        (``limits.parse_json``: 400 for bad JSON, NaN/Infinity, deep nesting)."""
        body = request.state.body = Body(await read_json(request), endpoint)
        return body

    def need_llm(self) -> LLM:
        if self.llm is None:
            raise APIError(
                404,
                "this server has no generation model (start it with -m MODEL.gguf)",
                code="model_not_found",
            )
        return self.llm

    def stream_options(self, body: Body) -> tuple[bool, bool]:
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
    async def collect(
        llm: LLM, prompts: Sequence[Any], params: SamplingParams, priority: int = 0, client: str | None = None
    ) -> list[Any]:
        tasks = [
            asyncio.ensure_future(llm.agenerate(p, params, priority=priority, client=client)) for p in prompts
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    @staticmethod
    def raise_for_errors(outputs: Sequence[Any]) -> None:
        for out in outputs:
            if out.finish_reason == "error":
                raise generation_error(out)


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
    client_policy: ClientPolicy | None = None,
    work_limits: WorkLimits | None = None,
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
        client_policy: what becomes of a body's ``priority`` and how many completions one
            client may have in flight (``server/client_policy.py``); default: priorities
            ignored, half the queue per client.
        work_limits: the worker threads and per-request time budget of the CPU-heavy steps
            (``offload.WorkLimits``; default: 2 threads per pool, 30 s).
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
        offload=Offload(work_limits),
    )
    ep = server.endpoint

    def handler(
        endpoint: Callable[[OpenAIServer, Request], Awaitable[Any]],
    ) -> Callable[[Request], Awaitable[Any]]:
        return functools.partial(endpoint, server)

    routes = [
        Route("/health", ep(handler(models.health), auth=False), methods=["GET"]),
        Route("/metrics", ep(handler(models.metrics_endpoint), auth=False), methods=["GET"]),
        Route("/tokenize", ep(handler(tokenize.tokenize)), methods=["POST"]),
        Route("/detokenize", ep(handler(tokenize.detokenize)), methods=["POST"]),
    ]
    for prefix in ("/v1", ""):  # llama.cpp's server answers without /v1 too
        routes += [
            Route(f"{prefix}/models", ep(handler(models.models)), methods=["GET"]),
            Route(f"{prefix}/completions", ep(handler(completions.completions)), methods=["POST"]),
            Route(f"{prefix}/chat/completions", ep(handler(chat.chat_completions)), methods=["POST"]),
            Route(f"{prefix}/embeddings", ep(handler(embeddings.embeddings)), methods=["POST"]),
            Route(f"{prefix}/rerank", ep(handler(rerank.rerank)), methods=["POST"]),  # issue 25
        ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = APIError(
            exc.status_code,
            f"{exc.detail}: {request.method} {request.url.path}",
            code="not_found" if exc.status_code == 404 else None,
        )
        return json_response(error.body(), exc.status_code, dict(exc.headers or {}))

    middleware = [Middleware(EdgeGuard, limits=limits if limits is not None else ServerLimits())]
    if llm is not None:
        policy = (client_policy or ClientPolicy()).resolved(llm.max_queue, llm.n_parallel)
        middleware.append(Middleware(ClientShare, policy=policy))
    if cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            )
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.offload.reopen()
        yield
        server.offload.close()  # abandon what is left: the threads are not joined

    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error},
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.server = server
    app.state.offload = server.offload
    return app
