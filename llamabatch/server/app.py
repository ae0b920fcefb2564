"""The OpenAI-compatible ASGI app (Starlette) over an ``LLM`` and/or an ``Embedder``.

This module composes the app: ``create_app`` (routes, middleware) over an ``OpenAIServer``
(``state.py``: the engines, names, key, metrics and the plumbing every endpoint uses). One module per endpoint
family holds the handlers: ``completions.py``, ``chat.py`` (over ``llamabatch.chat``),
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

import contextlib
import functools
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

from llamabatch import LLM, Embedder
from llamabatch.embed.reranker import Reranker
from llamabatch.runtime.metrics import PrometheusListener
from llamabatch.server import (
    anthropic,
    chat,
    completions,
    embeddings,
    llama_completion,
    models,
    rerank,
    responses,
    tokenize,
)
from llamabatch.server.client_policy import ClientPolicy, ClientShare
from llamabatch.server.limits import EdgeGuard, ServerLimits
from llamabatch.server.lora import applied_lora
from llamabatch.server.offload import Offload, WorkLimits, lower_engine_priority
from llamabatch.server.protocol import APIError
from llamabatch.server.state import OpenAIServer
from llamabatch.server.streaming import json_response

logger = logging.getLogger("llamabatch.server")

__all__ = ["create_app"]


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
    lora_applied: Sequence[str] = (),
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
            (``offload.WorkLimits``; default: 2 threads per pool, 30 s), and how many
            niceness levels those threads, and ``embedder``'s and ``reranker``'s engine
            threads, run below ``llm``'s (default 10; raised on those threads here).
        lora_applied: names of ``llm``'s LoRA adapters a request that selects none by
            ``"model"`` or ``"lora"`` runs with, at scale 1 (llama-server's ``--lora FILE``).
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
    lower_engine_priority((embedder, reranker), server.offload.limits.nice)
    server.lora_applied = applied_lora(llm, lora_applied)
    ep = server.endpoint

    def handler(
        endpoint: Callable[[OpenAIServer, Request], Awaitable[Any]],
    ) -> Callable[[Request], Awaitable[Any]]:
        return functools.partial(endpoint, server)

    routes = [
        Route("/health", ep(handler(models.health), auth=False), methods=["GET"]),
        Route("/v1/health", ep(handler(models.health), auth=False), methods=["GET"]),  # (llama-server's too)
        Route("/metrics", ep(handler(models.metrics_endpoint), auth=False), methods=["GET"]),
        Route("/tokenize", ep(handler(tokenize.tokenize)), methods=["POST"]),
        Route("/detokenize", ep(handler(tokenize.detokenize)), methods=["POST"]),
        Route("/apply-template", ep(handler(tokenize.apply_template)), methods=["POST"]),
        Route("/props", ep(handler(models.props)), methods=["GET"]),
    ]
    for path in ("/completion", "/completions"):  # llama-server's own (not OpenAI's) answers
        routes.append(Route(path, ep(handler(llama_completion.completion)), methods=["POST"]))
    routes.append(Route("/infill", ep(handler(llama_completion.infill)), methods=["POST"]))
    for path, endpoint in (
        ("/v1/completions", completions.completions),
        ("/v1/responses", responses.responses),
        ("/v1/messages", anthropic.messages),
        ("/v1/messages/count_tokens", anthropic.count_tokens),
    ):
        routes.append(Route(path, ep(handler(endpoint)), methods=["POST"]))
    for prefix in ("/v1", ""):  # llama.cpp's server answers without /v1 too
        routes += [
            Route(f"{prefix}/models", ep(handler(models.models)), methods=["GET"]),
            Route(f"{prefix}/chat/completions", ep(handler(chat.chat_completions)), methods=["POST"]),
            Route(f"{prefix}/embeddings", ep(handler(embeddings.embeddings)), methods=["POST"]),
            Route(f"{prefix}/rerank", ep(handler(rerank.rerank)), methods=["POST"]),
            Route(f"{prefix}/reranking", ep(handler(rerank.rerank)), methods=["POST"]),  # llama-server
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
                allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
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
