"""Scale-out on Ray: bulk generation and embedding with Ray Data, online serving with Ray Serve.

Installed by ``pip install "llamabatch[ray]"``.

- :class:`Generate` and :class:`Embed` are callable classes for
  ``ray.data.Dataset.map_batches``: every actor owns one ``LLM`` or ``Embedder`` and pushes its
  whole batch through it at once (see :mod:`llamabatch.ray.data`). :func:`generate` and
  :func:`embed` are the one-line forms.
- :func:`serve_app` is a Ray Serve application of a llamabatch HTTP endpoint (see
  :mod:`llamabatch.ray.serve`).
- :mod:`llamabatch.ray.bench` measures Ray's overhead against the same job in one process,
  and the scaling over (simulated) nodes.

Models are referenced by a path that every node must be able to read: a shared file system
mounted at the same path on all nodes, or a copy of the file at the same path on each node.
"""

from __future__ import annotations

from typing import Any

try:
    import ray  # noqa: F401  (the top-level Ray package: imports are absolute)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('llamabatch.ray needs Ray: pip install "llamabatch[ray]"') from exc

from llamabatch.ray.data import Embed, Generate, OnError, RowError, embed, generate

__all__ = ["Embed", "Generate", "OnError", "RowError", "embed", "generate", "serve_app"]


def __getattr__(name: str) -> Any:
    # Ray Serve (and its web stack) is imported only by those who serve.
    if name == "serve_app":
        from llamabatch.ray.serve import serve_app

        return serve_app
    raise AttributeError(f"module 'llamabatch.ray' has no attribute {name!r}")
