"""``/v1/embeddings`` over an ``Embedder``.

The handlers take the ``OpenAIServer`` of ``app.py`` (the engines, names, key, metrics) and
the request."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch import PromptTooLong
from llamabatch.errors import ImageError
from llamabatch.prompts.images import ImageLimits, load_image
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
    texts = _input_list(data, embedder.image_limits is not None)
    encoding = body.get("encoding_format", "str", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    dimensions = body.get("dimensions", "int")
    if dimensions is not None and dimensions != embedder.n_out:
        raise bad_request(f"'dimensions' must be {embedder.n_out} for this model", param="dimensions")
    body.warn_unknown()
    try:
        await run_step(request, PREPARE, prepare.check_embedding_sizes, embedder, texts)
        if embedder.image_limits is not None and any(isinstance(text, dict) for text in texts):
            texts = await run_step(request, PREPARE, _with_images, texts, embedder.image_limits)
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


def _input_list(data: Any, images: bool) -> list[Any]:
    """``input`` as a list of strings, and (``images``: the embedding model has an mmproj)
    llama-server's multimodal prompts, ``{"prompt_string": ..., "multimodal_data": [...]}``."""
    texts = [data] if isinstance(data, (str, dict)) else data
    if not isinstance(texts, list) or not texts or len(texts) > prepare.MAX_EMBEDDING_INPUTS:
        raise bad_request(
            f"'input' must be a string or an array of 1 to {prepare.MAX_EMBEDDING_INPUTS} strings",
            param="input",
        )
    for i, text in enumerate(texts):
        if isinstance(text, dict):
            if not images:
                raise bad_request(
                    f"'input[{i}]' has images and this server's embedding model has no projector "
                    "(start it with --embedding-mmproj)",
                    param="input",
                )
            _check_media_input(text, i)
        elif not isinstance(text, str):
            raise bad_request(
                f"'input[{i}]' must be a string (token-id inputs are not supported)", param="input"
            )
        elif not text:
            raise bad_request(f"'input[{i}]' is empty", param="input")
    return texts


def _check_media_input(item: dict[str, Any], i: int) -> None:
    unknown = sorted(set(item) - {"prompt_string", "multimodal_data"})
    if unknown:
        raise bad_request(
            f"'input[{i}]' takes 'prompt_string' and 'multimodal_data', not {unknown}", param="input"
        )
    text, images = item.get("prompt_string"), item.get("multimodal_data", [])
    if not isinstance(text, str) or not text:
        raise bad_request(f"'input[{i}].prompt_string' must be a non-empty string", param="input")
    if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
        raise bad_request(
            f"'input[{i}].multimodal_data' must be an array of base64 strings (or data: URLs)", param="input"
        )


def _with_images(texts: list[Any], limits: ImageLimits) -> list[Any]:
    """The inputs with each multimodal prompt's images decoded (in a pool: CPU work), as
    ``Embedder.embed`` takes them; an image refused is a 400 naming it."""
    out: list[Any] = []
    for i, text in enumerate(texts):
        if not isinstance(text, dict):
            out.append(text)
            continue
        images = text.get("multimodal_data", [])
        try:
            limits.check_count(len(images), f"input[{i}].multimodal_data")
            pixels = [
                load_image(
                    image if image.startswith("data:") else "data:;base64," + image,
                    limits,
                    f"input[{i}].multimodal_data[{k}]",
                )
                for k, image in enumerate(images)
            ]
        except ImageError as exc:
            raise bad_request(str(exc), param="input") from None
        out.append({"prompt": text["prompt_string"], "multi_modal_data": {"image": pixels}})
    return out
