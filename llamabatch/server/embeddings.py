"""``/v1/embeddings`` over an ``Embedder``.

The handlers take the ``OpenAIServer`` of ``app.py`` (the engines, names, key, metrics) and
the request."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from llamabatch import PromptTooLong
from llamabatch.server import prepare
from llamabatch.server.offload import ENCODE, PREPARE, run_step
from llamabatch.server.protocol import (
    APIError,
    bad_request,
)
from llamabatch.server.streaming import (
    until_disconnect,
)

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer


async def embeddings(server: OpenAIServer, request: Request) -> Response:
    body = await server.read_body(request, "/v1/embeddings")
    embedder = server.embedder
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
        await run_step(request, PREPARE, prepare.check_embedding_sizes, embedder, texts)
        work = request.app.state.offload.request(request.state, request.receive)
        tokenize = functools.partial(work.run, PREPARE, watch=False)  # until_disconnect watches
        embedding = embedder.aembed_counted(texts, offload=tokenize)
        vectors, n_tokens = await until_disconnect(request.receive, embedding)
    except PromptTooLong as exc:
        raise bad_request(str(exc), param="input", code="context_length_exceeded") from None
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param="input") from None
    payload = await run_step(  # vector by vector: JSON-encoding floats holds the GIL
        request, ENCODE, prepare.embedding_response, vectors, encoding, server.embedding_model_name, n_tokens
    )
    return Response(payload, media_type="application/json")
