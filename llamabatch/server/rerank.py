"""``/v1/rerank`` (and ``/rerank``): llama-server's and Jina's rerank format over a ``Reranker``.

Request: ``{"model", "query", "documents": [str | {"text": str}], "top_n", "return_documents"}``.
Response: ``{"object": "list", "model", "results": [{"index", "relevance_score", "document"?:
{"text"}}], "usage": {"prompt_tokens", "total_tokens"}}``, best first, at most ``top_n``.
``relevance_score`` is the reranker's score with its default activation (sentence-transformers'
rule: sigmoid for a one-label cross-encoder unless the model recorded another).

Built on the public API (``Reranker.arank``, ``Reranker.tokenize``); the route is registered by
:func:`llamabatch.server.app.create_app` (``reranker=``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch.embed.reranker import Reranker
from llamabatch.errors import PromptTooLong
from llamabatch.server.protocol import Body, bad_request
from llamabatch.server.streaming import json_response

if TYPE_CHECKING:
    from llamabatch.server.app import OpenAIServer

__all__ = ["rerank", "rerank_endpoint"]

#: the most documents one request may rank (a bound on the request's work)
MAX_DOCUMENTS = 4096


def _documents(body: Body) -> list[str]:
    docs = body.data.get("documents")
    body.read.add("documents")
    if not isinstance(docs, list) or not docs:
        raise bad_request("'documents' must be a non-empty array of strings", param="documents")
    if len(docs) > MAX_DOCUMENTS:
        raise bad_request(
            f"'documents' holds {len(docs)} items, more than {MAX_DOCUMENTS}", param="documents"
        )
    out: list[str] = []
    for i, doc in enumerate(docs):
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            doc = doc["text"]  # Jina / Cohere also take {"text": ...}
        if not isinstance(doc, str):
            raise bad_request(
                f"'documents[{i}]' must be a string (or an object with 'text')", param="documents"
            )
        out.append(doc)
    return out


async def rerank_endpoint(
    reranker: Reranker | None,
    model_name: str | None,
    body: Body,
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
) -> dict[str, Any]:
    """The response body of one rerank request (raises ``APIError`` for a 4xx)."""
    from llamabatch.server.protocol import APIError
    from llamabatch.server.streaming import until_disconnect

    if reranker is None:
        raise APIError(
            404,
            "this server has no reranking model (start it with --rerank-model RERANKER.gguf)",
            code="model_not_found",
        )
    query = body.get("query", "str")
    if query is None:
        raise bad_request("'query' is required (a string)", param="query")
    documents = _documents(body)
    top_n = body.get("top_n", "int", minimum=1)
    return_documents = body.get("return_documents", "bool", False)
    body.warn_unknown()
    try:  # tokenizing is CPU work: off the event loop (Reranker.arank tokenizes off it too)
        n_tokens = await asyncio.to_thread(
            lambda: sum(len(reranker.tokenize(query, doc)[0]) for doc in documents)
        )
        ranked = await until_disconnect(
            receive, reranker.arank(query, documents, top_k=top_n, return_documents=return_documents)
        )
    except PromptTooLong as exc:
        raise bad_request(str(exc), param="documents", code="context_length_exceeded") from None
    results = []
    for item in ranked:
        result: dict[str, Any] = {"index": item["corpus_id"], "relevance_score": item["score"]}
        if return_documents:
            result["document"] = {"text": item["text"]}
        results.append(result)
    return {
        "object": "list",
        "model": model_name,
        "results": results,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


async def rerank(server: OpenAIServer, request: Request) -> Response:
    """``/v1/rerank`` and ``/rerank`` (issue 25): the handler ``create_app`` routes."""
    body = await server.read_body(request, "/v1/rerank")
    answer = await rerank_endpoint(server.reranker, server.rerank_model_name, body, request.receive)
    return json_response(answer)
