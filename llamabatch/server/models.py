"""``/health``, ``/metrics`` (Prometheus), ``/v1/models`` and ``/props`` (llama-server's).

The handlers take the ``OpenAIServer`` of ``app.py`` (the engines, names, key, metrics) and
the request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch import SamplingParams, __version__
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


#: the sampling defaults ``/props`` reports (a request's values when it gives none)
_PROPS_PARAMS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
)


async def props(server: OpenAIServer, request: Request) -> Response:
    """llama-server's ``GET /props``, its fields that hold here: the context and sampling
    defaults, the slots, the chat template, the modalities. ``model_path`` is the file's name
    alone: the server's directories are not the clients' business."""
    llm = server.need_llm()
    model = llm.model
    defaults = SamplingParams()
    settings = {"n_ctx": llm.n_ctx_seq, "params": {k: getattr(defaults, k) for k in _PROPS_PARAMS}}
    return json_response(
        {
            "default_generation_settings": settings,
            "total_slots": llm.stats().n_parallel,
            "model_alias": server.model_name,
            "model_path": model.path.name,
            "chat_template": server.chat_template or model.chat_template or "",
            "modalities": {"vision": llm.config.mmproj is not None, "audio": False},
            "bos_token": model.token_text(model.bos) if model.bos >= 0 else "",
            "eos_token": model.token_text(model.eos) if model.eos >= 0 else "",
            "build_info": f"llamabatch {__version__}",
        }
    )
