"""``/v1/rerank`` (and ``/rerank``): llama-server's and Jina's rerank format over a ``Reranker``.

Request: ``{"model", "query", "documents": [str | {"text": str}], "top_n", "return_documents"}``.
Response: ``{"object": "list", "model", "results": [{"index", "relevance_score", "document"?:
{"text"}}], "usage": {"prompt_tokens", "total_tokens"}}``, best first, at most ``top_n``.
``relevance_score`` is the reranker's score with its default activation (sentence-transformers'
rule: sigmoid for a one-label cross-encoder unless the model recorded another).

Built on the public API (``Reranker.tokenize_pairs``, ``Reranker.apredict``); the route is registered by
:func:`llamabatch.server.app.create_app` (``reranker=``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from llamabatch.embed.reranker import Reranker
from llamabatch.errors import PromptTooLong
from llamabatch.server.offload import RERANK, run_step
from llamabatch.server.protocol import Body, bad_request
from llamabatch.server.streaming import json_response

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer

__all__ = ["rerank", "rerank_endpoint"]

#: the most documents one request may rank (a bound on the request's work)
MAX_DOCUMENTS = 4096
#: a query's most bytes per token of a pair's ``max_length``: a longer query is refused before
#: it is tokenized (WordPiece has no byte bound of its own: one unknown word is one token)
MAX_QUERY_BYTES_PER_TOKEN = 16


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "replace"))


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
    request: Request,
) -> dict[str, Any]:
    """The response body of one rerank request (raises ``APIError`` for a 4xx); the pairs are
    tokenized as one of ``request``'s steps (``offload.RERANK``), the query once."""
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
    max_bytes = reranker.max_length * MAX_QUERY_BYTES_PER_TOKEN
    # a character is 1 to 4 bytes: only a query between the two bounds is encoded (on the
    # event loop), and once
    exact = max_bytes // 4 < len(query) <= max_bytes
    size = _utf8_size(query) if exact else len(query)
    if size > max_bytes:
        raise bad_request(
            f"'query' is {'' if exact else 'at least '}{size} bytes, more than the {max_bytes} a query may "
            f"have ({MAX_QUERY_BYTES_PER_TOKEN} per token of the {reranker.max_length} one pair holds)",
            param="query",
        )
    documents = _documents(body)
    top_n = body.get("top_n", "int", minimum=1)
    return_documents = body.get("return_documents", "bool", False)
    body.warn_unknown()
    if reranker.num_labels != 1:
        raise bad_request(f"this reranker's head has {reranker.num_labels} labels; ranking needs one")
    try:
        pairs = await run_step(
            request, RERANK, reranker.tokenize_pairs, query, documents, max_query_tokens=reranker.max_length
        )
    except PromptTooLong as exc:
        param = getattr(exc, "param", "documents")
        raise bad_request(str(exc), param=param, code="context_length_exceeded") from None
    n_tokens = sum(len(pair) for pair in pairs)
    scores = await until_disconnect(receive, reranker.apredict(pairs))
    scores = [float(s) for s in np.atleast_1d(scores)]
    order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)  # stable: ties keep order
    results = []
    for i in order[:top_n]:  # a top_n past the documents' count gives them all
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {
        "object": "list",
        "model": model_name,
        "results": results,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


async def rerank(server: OpenAIServer, request: Request) -> Response:
    """``/v1/rerank`` and ``/rerank``: the handler ``create_app`` routes."""
    body = await server.read_body(request, "/v1/rerank")
    answer = await rerank_endpoint(server.reranker, server.rerank_model_name, body, request.receive, request)
    return json_response(answer)
