"""Embeddings and reranking: the ``Embedder`` facade (``embedder.py``) over the embedding core
(``core.py``: the worker side, packing texts into shared decodes), sentence-transformers'
``encode`` (``st_compat.py``), the options (``config.py``), and the cross-encoder ``Reranker``
(``reranker.py``, ``reranker_inputs.py``) built on the same core."""

from llamabatch.embed.config import EmbedderConfig
from llamabatch.embed.embedder import Embedder
from llamabatch.embed.reranker import Reranker

__all__ = ["Embedder", "EmbedderConfig", "Reranker"]
