"""``OpenAIServer``: the state every endpoint reads (engines, model names, API key, metrics,
worker pools) and the plumbing they share (auth, body reading, stream options, collecting
answers). ``app.py`` builds it and routes the endpoints' handlers, which take it as their
first argument."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import Request

from llamabatch import LLM, Embedder, SamplingParams
from llamabatch.embed.reranker import Reranker
from llamabatch.runtime.metrics import PrometheusListener
from llamabatch.server.limits import read_json
from llamabatch.server.offload import Offload
from llamabatch.server.protocol import APIError, Body, TokenText, bad_request, generation_error, now
from llamabatch.server.streaming import error_response

__all__ = ["OpenAIServer"]


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
        #: /v1/rerank's model
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
        #: adapters a request that selects none runs with (``server/lora.py``)
        self.lora_applied: tuple[str, ...] = ()
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
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(
                401,
                "Incorrect API key provided (send 'Authorization: Bearer <key>' or 'x-api-key: <key>').",
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
