"""A Ray Serve deployment of llamabatch: one ``LLM`` (and/or ``Embedder``) per replica.

:func:`serve_app` returns a Ray Serve application; ``serve.run(app)`` starts it. Replicas,
autoscaling and resources are Ray's own deployment options, passed through
(``num_replicas=2``, ``autoscaling_config={...}``, ``ray_actor_options={"num_cpus": 8}``).
Every replica serves many requests at once and batches them in its engine, so the default
``max_ongoing_requests`` is high (128) rather than Ray's 5.

The HTTP API is llamabatch's OpenAI-compatible server (``llamabatch.server.create_app``:
``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/metrics``, ...) when the
``[server]`` extra is installed (``api="auto"`` or ``"openai"``), otherwise (or with
``api="minimal"``) this module's small JSON API:

``GET /health``
    ``{"status": "ok"}``.
``POST /v1/generate``
    ``{"prompt": "..."}`` or ``{"prompts": ["...", ...]}``, optional ``"sampling_params"``
    (``SamplingParams`` fields, over the deployment's defaults). Returns ``{"outputs": [...]}``,
    one object per prompt: ``text``, ``finish_reason``, ``prompt_tokens``,
    ``completion_tokens``, ``error`` (null unless that prompt failed).
``POST /v1/embed``
    ``{"texts": ["...", ...]}`` (or ``"input"``: a string or a list). Returns
    ``{"embeddings": [[...], ...], "errors": [...]}`` (null vector and an error for a text that
    failed).

A malformed request gets a 400 with ``{"error": "..."}``, a route whose model was not given
a 404.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from ray import serve

from llamabatch.params import SamplingParams
from llamabatch.ray.data import Embed, Generate

__all__ = ["LlamabatchDeployment", "app_builder", "serve_app"]

#: Concurrent requests one replica accepts (Ray's default, 5, would starve the engine's batching).
DEFAULT_MAX_ONGOING_REQUESTS = 128

_APIS = ("auto", "openai", "minimal")


def _openai_app_factory() -> Any:
    """``llamabatch.server.create_app``, or None where the server (or its extra) is missing."""
    try:
        from llamabatch.server import create_app  # type: ignore[attr-defined]
    except ImportError:
        return None
    return create_app


@serve.ingress()  # the ASGI app is built per replica, after its model is loaded
class LlamabatchDeployment:
    """One replica: the models and the HTTP app in front of them (see the module docstring)."""

    def __init__(
        self,
        model: str | None = None,
        embedding_model: str | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        llm_options: Mapping[str, Any] | None = None,
        embedder_options: Mapping[str, Any] | None = None,
        api: str = "auto",
        server_options: Mapping[str, Any] | None = None,
    ) -> None:
        if model is None and embedding_model is None:
            raise ValueError("serve_app needs a model, an embedding_model, or both")
        if api not in _APIS:
            raise ValueError(f"api must be one of {_APIS}, got {api!r}")
        self.api = api
        self.server_options = dict(server_options or {})
        # Generate/Embed do the per-row work (validation, errors per prompt) for both APIs.
        self.generator = (
            Generate(model, sampling_params, params_column="sampling_params", **dict(llm_options or {}))
            if model is not None
            else None
        )
        self.embedder = Embed(embedding_model, **dict(embedder_options or {})) if embedding_model else None

    def __serve_build_asgi_app__(self) -> Any:
        factory = _openai_app_factory() if self.api != "minimal" else None
        if factory is not None:
            return factory(
                self.generator.llm if self.generator else None,
                embedder=self.embedder.embedder if self.embedder else None,
                **self.server_options,
            )
        if self.api == "openai":
            raise RuntimeError("api='openai' needs llamabatch.server (pip install 'llamabatch[server]')")
        return self._minimal_app()

    # -- the minimal JSON API

    def _minimal_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": message}, status_code=status)

        async def body_of(request: Request) -> dict[str, Any]:
            try:
                body = json.loads(await request.body())
            except ValueError as exc:
                raise _BadRequest(f"the body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise _BadRequest("the body must be a JSON object")
            return body

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        async def generate(request: Request) -> JSONResponse:
            if self.generator is None:
                return error(404, "this deployment has no generation model")
            try:
                body = await body_of(request)
                prompts = _list_field(body, "prompts", "prompt")
                overrides = body.get("sampling_params") or {}
                if not isinstance(overrides, dict):
                    raise _BadRequest("sampling_params must be a JSON object")
                SamplingParams.from_dict({**self.generator.params.to_dict(), **overrides})
            except (_BadRequest, ValueError, TypeError) as exc:
                return error(400, str(exc))
            batch = {
                "prompt": _objects(prompts),
                "sampling_params": _objects([overrides] * len(prompts)),
            }
            out = await self.generator.run(batch)
            return JSONResponse({"outputs": _records(out, exclude=("prompt", "sampling_params"))})

        async def embed(request: Request) -> JSONResponse:
            if self.embedder is None:
                return error(404, "this deployment has no embedding model")
            try:
                texts = _list_field(await body_of(request), "texts", "input")
            except _BadRequest as exc:
                return error(400, str(exc))
            out = await self.embedder.run({"text": _objects(texts)})
            vectors = out[self.embedder.output_column]
            errors = list(out[self.embedder.error_column])
            embeddings = [
                None if e is not None else np.asarray(v).tolist()
                for v, e in zip(vectors, errors, strict=True)
            ]
            return JSONResponse({"embeddings": embeddings, "errors": errors})

        return Starlette(
            routes=[
                Route("/health", health, methods=["GET"]),
                Route("/v1/generate", generate, methods=["POST"]),
                Route("/v1/embed", embed, methods=["POST"]),
            ]
        )

    def __del__(self) -> None:
        for worker in (getattr(self, "generator", None), getattr(self, "embedder", None)):
            if worker is not None:
                worker.close()


class _BadRequest(ValueError):
    pass


def _list_field(body: Mapping[str, Any], many: str, one: str) -> list[Any]:
    if many in body:
        values = body[many]
        if not isinstance(values, list) or not values:
            raise _BadRequest(f"{many!r} must be a non-empty list")
        return values
    if one in body:
        value = body[one]
        return value if isinstance(value, list) and one == "input" else [value]
    raise _BadRequest(f"the body needs {many!r} (a list) or {one!r}")


def _objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON-ready Python (numpy arrays and scalars converted)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _records(columns: Mapping[str, Any], exclude: tuple[str, ...]) -> list[dict[str, Any]]:
    names = [n for n in columns if n not in exclude]
    n_rows = len(next(iter(columns.values())))
    return [{name: _plain(columns[name][i]) for name in names} for i in range(n_rows)]


def serve_app(
    model: str | os.PathLike[str] | None = None,
    *,
    embedding_model: str | os.PathLike[str] | None = None,
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    llm_options: Mapping[str, Any] | None = None,
    embedder_options: Mapping[str, Any] | None = None,
    api: str = "auto",
    server_options: Mapping[str, Any] | None = None,
    **deployment_options: Any,
) -> Any:
    """A Ray Serve application serving ``model`` (generation) and/or ``embedding_model``.

    Run it with ``ray.serve.run(app)``. ``deployment_options`` are Ray Serve's own
    (``num_replicas``, ``autoscaling_config``, ``ray_actor_options``, ``max_ongoing_requests``,
    ``name``, ...). Each replica's ``n_threads`` defaults to the CPUs in its
    ``ray_actor_options`` (1 unless given). ``sampling_params`` are the defaults that a
    request's own ``sampling_params`` override (minimal API). ``api``: ``"auto"`` (the
    OpenAI-compatible server if installed, else the minimal API), ``"openai"`` or
    ``"minimal"``; ``server_options`` go to ``llamabatch.server.create_app`` (``api_key``,
    ``model_name``, ``chat_template``, ...).

    The model paths must be readable at the same path on every node that may run a replica.
    """
    options = {"max_ongoing_requests": DEFAULT_MAX_ONGOING_REQUESTS, **deployment_options}
    deployment = serve.deployment(**options)(LlamabatchDeployment)
    return deployment.bind(
        str(model) if model is not None else None,
        str(embedding_model) if embedding_model is not None else None,
        sampling_params,
        dict(llm_options or {}),
        dict(embedder_options or {}),
        api,
        dict(server_options or {}),
    )


def app_builder(args: dict[str, Any]) -> Any:
    """For ``serve run llamabatch.ray.serve:app_builder model=/models/m.gguf ...`` and Serve
    config files: the arguments of :func:`serve_app` as a dict."""
    return serve_app(**args)
