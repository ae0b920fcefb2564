"""``llamabatch.ray.Rerank``: a cross-encoder over Ray Data, scores checked against transformers.

One real Ray Data job (a one-node local cluster) and the row-error policy on ``process``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='the Ray tests need Ray: pip install "llamabatch[ray]"')
pytest.importorskip("ray.data", reason='the Ray tests need Ray Data: pip install "llamabatch[ray]"')
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from llamabatch.gguf.testing_reranker import PAIRS, reranker_path  # noqa: E402
from llamabatch.ray import Rerank, RowError, rerank  # noqa: E402

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "reranker_reference.json").read_text())
LOGITS = np.array(REFERENCE["logits"])[:, 0]
OPTIONS = {"n_threads": 1, "activation_fn": "identity"}


@pytest.fixture(scope="module")
def model() -> str:
    return str(reranker_path("f32"))


def test_rerank_through_ray_data(model: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-cwd"))  # workers import the installed llamabatch
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        rows = [{"id": i, "query": q, "document": d} for i, (q, d) in enumerate(PAIRS)]
        out = rerank(ray.data.from_items(rows), model, batch_size=5, rerank_options=OPTIONS).take_all()
    finally:
        ray.shutdown()
        os.chdir(cwd)
    assert [row["id"] for row in out] == list(range(len(PAIRS)))
    assert all(row["error"] is None for row in out)
    scores = np.array([row["score"] for row in out])
    np.testing.assert_allclose(scores, LOGITS[: len(PAIRS)], atol=1e-3)


def test_row_errors(model: str) -> None:
    r = Rerank(model, truncate=False, **OPTIONS)
    try:
        long_doc = "word " * 100
        queries = np.array([PAIRS[0][0], "q", None, PAIRS[1][0]], dtype=object)
        docs = np.array([PAIRS[0][1], long_doc, "d", PAIRS[1][1]], dtype=object)
        out = r.process({"query": queries, "document": docs})
        scores, errors = out["score"], list(out["error"])
        assert scores.dtype == np.float32 and scores.shape == (4,)
        assert errors[0] is None and errors[3] is None
        assert errors[1].startswith("PromptTooLong") and "no 'query'" in errors[2]
        assert np.isnan(scores[1:3]).all()
        np.testing.assert_allclose(scores[[0, 3]], LOGITS[:2], atol=1e-3)
    finally:
        r.close()
    raising = Rerank(model, on_error="raise", **OPTIONS)
    try:
        with pytest.raises(RowError, match="row 1"):
            raising.process({"query": np.array(["q", 3], dtype=object), "document": np.array(["a", "b"])})
    finally:
        raising.close()
