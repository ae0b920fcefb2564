"""``llamabatch serve``: an OpenAI-compatible HTTP server with Prometheus metrics.

``create_app(llm, embedder=...)`` returns the ASGI app (Starlette) for an app that runs its
own server; ``llamabatch serve -m MODEL.gguf`` runs it with uvicorn. Needs the ``[server]``
extra (``pip install "llamabatch[server]"``).
"""

from __future__ import annotations

from typing import Any

from llamabatch.server.cli import add_arguments, main

__all__ = ["add_arguments", "create_app", "main"]


def __getattr__(name: str) -> Any:
    if name == "create_app":  # imported on use: it needs the [server] extra
        from llamabatch.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
