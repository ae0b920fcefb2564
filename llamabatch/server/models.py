"""``/health``, ``/metrics`` (Prometheus) and ``/v1/models``.

The handlers take the ``OpenAIServer`` of ``app.py`` (the engines, names, key, metrics) and
the request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch.server.lora import adapter_cards
from llamabatch.server.streaming import (
    json_response,
)

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer


async def health(server: OpenAIServer, request: Request) -> Response:
    engines = [e for e in (server.llm, server.embedder, server.reranker) if e is not None]
    if any(e.closed for e in engines):
        return json_response({"status": "unavailable"}, 503)
    return json_response({"status": "ok"})


async def metrics_endpoint(server: OpenAIServer, request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(server.metrics.generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def models(server: OpenAIServer, request: Request) -> Response:
    data = []
    if server.llm is not None:
        data.append(model_card(server, server.model_name, server.llm.n_ctx_seq))
        data += adapter_cards(server.model_name, server.llm.lora_adapters(), server.created)
    if server.embedder is not None:
        data.append(model_card(server, server.embedding_model_name, server.embedder.max_tokens))
    if server.reranker is not None:
        data.append(model_card(server, server.rerank_model_name, server.reranker.max_length))
    return json_response({"object": "list", "data": data})


def model_card(server: OpenAIServer, name: str | None, max_len: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": server.created,
        "owned_by": "llamabatch",
        "max_model_len": max_len,
    }
