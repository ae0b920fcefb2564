"""Scale-out on Ray: bulk generation and embedding with Ray Data, online serving with Ray Serve.

Installed by ``pip install "llamabatch[ray]"``.

- :class:`Generate` and :class:`Embed` are callable classes for
  ``ray.data.Dataset.map_batches``: every actor owns one ``LLM`` or ``Embedder`` and pushes its
  whole batch through it at once (see :mod:`llamabatch.ray.data`). :func:`generate` and
  :func:`embed` are the one-line forms.
- :class:`Rerank` scores (query, document) rows with a ``Reranker`` the same way
  (:mod:`llamabatch.ray.reranking`); :func:`rerank` is its one-line form.
- :func:`serve_app` is a Ray Serve application of llamabatch's HTTP server (see
  :mod:`llamabatch.ray.serve`).
- :mod:`llamabatch.ray.bench` (``llamabatch ray-bench``) measures Ray's overhead against the
  same job in one process, and the scaling over (simulated) nodes.

Models are referenced by a path that every node must be able to read: a shared file system
mounted at the same path on all nodes, or a copy of the file at the same path on each node.

The names are imported on first use (Ray takes about a second to import), so that
``llamabatch.ray.bench``'s command-line arguments cost nothing to the ``llamabatch`` command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llamabatch.ray.data import Embed, Generate, OnError, RowError, embed, generate
    from llamabatch.ray.reranking import Rerank, rerank
    from llamabatch.ray.serve import serve_app

__all__ = [
    "Embed",
    "Generate",
    "OnError",
    "Rerank",
    "RowError",
    "embed",
    "generate",
    "require_ray",
    "rerank",
    "serve_app",
]

_DATA_NAMES = frozenset({"Embed", "Generate", "OnError", "RowError", "embed", "generate"})


def require_ray() -> None:
    """Raise ``ImportError`` saying how to install Ray when it is missing."""
    try:
        import ray  # noqa: F401  (the top-level Ray package: imports are absolute)
    except ImportError as exc:
        raise ImportError('llamabatch.ray needs Ray: pip install "llamabatch[ray]"') from exc


def __getattr__(name: str) -> Any:
    if name in _DATA_NAMES:
        require_ray()
        from llamabatch.ray import data

        return getattr(data, name)
    if name in ("Rerank", "rerank"):
        require_ray()
        from llamabatch.ray import reranking

        return getattr(reranking, name)
    if name == "serve_app":  # Ray Serve and its web stack: only for those who serve
        require_ray()
        from llamabatch.ray.serve import serve_app

        return serve_app
    raise AttributeError(f"module 'llamabatch.ray' has no attribute {name!r}")
