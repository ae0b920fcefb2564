"""``/v1/rerank`` on the real ``llamabatch serve --rerank-model`` command, with a plain HTTP client.

The reranker is the random-weight cross-encoder of ``llamabatch.gguf.testing_reranker``; its scores
are checked against transformers' logits (``tests/data/reranker_reference.json``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from serve_process import wait_until_healthy  # noqa: E402

from llamabatch.gguf.testing_reranker import PAIRS, reranker_path  # noqa: E402

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "reranker_reference.json").read_text())
LOGITS = np.array(REFERENCE["logits"])[:, 0]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [
        sys.executable, "-m", "llamabatch", "serve", "--rerank-model", str(reranker_path("f32")),
        "--rerank-model-name", "ce", "--port", str(port), "-t", "1", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, lambda: proc.stdout.read().decode() if proc.stdout else "")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_rerank_matches_transformers(base_url: str) -> None:
    query = PAIRS[0][0]
    docs = [d for q, d in PAIRS[:2]]  # both pairs of the reference start with this query
    r = httpx.post(
        f"{base_url}/v1/rerank",
        json={"model": "ce", "query": query, "documents": docs, "return_documents": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "ce" and body["object"] == "list"
    expected = 1 / (1 + np.exp(-LOGITS[:2]))  # the default activation: sigmoid
    order = list(np.argsort(-expected))
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert abs(x["relevance_score"] - expected[x["index"]]) < 1e-3
        assert x["document"] == {"text": docs[x["index"]]}
    assert body["usage"]["prompt_tokens"] == sum(len(REFERENCE["input_ids"][i]) for i in range(2))
    # /rerank (no /v1) and llama-server's /reranking names, top_n, Jina's {"text": ...}
    # documents, no documents returned
    for path in ("/rerank", "/reranking", "/v1/reranking"):
        r = httpx.post(
            f"{base_url}{path}",
            json={"query": query, "documents": [{"text": d} for d in docs], "top_n": 1},
        )
        assert r.status_code == 200 and r.json()["results"] == [
            {"index": order[0], "relevance_score": pytest.approx(expected[order[0]], abs=1e-3)}
        ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": "a"}, "documents"),
        ({"query": "q", "documents": ["a", 3]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": 3, "documents": ["a"]}, "query"),
    ],
)
def test_bad_requests_are_400_naming_the_field(base_url: str, body: dict, param: str) -> None:
    r = httpx.post(f"{base_url}/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_models_metrics_and_other_endpoints(base_url: str) -> None:
    models = httpx.get(f"{base_url}/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("ce", 64)]
    assert httpx.post(f"{base_url}/v1/embeddings", json={"input": "x"}).status_code == 404
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "the cat"}).json()
    assert tokens["max_model_len"] == 64 and tokens["count"] == 4  # [CLS] the cat [SEP]
    metrics = httpx.get(f"{base_url}/metrics").text
    packs = [
        line
        for line in metrics.splitlines()
        if line.startswith("llamabatch:embedding_packs_total") and "ce" in line
    ]
    assert packs and float(packs[0].split()[-1]) >= 1, metrics[:2000]
