"""``llamabatch.Reranker`` and the cross-encoder conversion, against transformers.

The model is the random-weight ``BertForSequenceClassification`` of
``llamabatch.gguf.testing_reranker`` (numpy + safetensors + a WordPiece tokenizer, no torch),
converted by ``llamabatch convert``; ``tests/data/reranker_reference.json`` holds
transformers' ``AutoModelForSequenceClassification`` logits for the same weights (made once by
``tests/data/make_reranker_reference.py``). Everything runs on the real llama.cpp.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from llamabatch import EngineClosed, PromptTooLong, Reranker  # noqa: E402
from llamabatch.cli import main  # noqa: E402
from llamabatch.gguf.convert import convert_bert  # noqa: E402
from llamabatch.gguf.convert_head import ACTIVATION_KEY  # noqa: E402
from llamabatch.gguf.testing_reranker import (  # noqa: E402
    LONG_PAIRS,
    PAIRS,
    make_cross_encoder,
    make_xlmr_cross_encoder,
    reranker_path,
)

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "reranker_reference.json").read_text())
ALL_PAIRS = [tuple(p) for p in REFERENCE["pairs"]]
LOGITS = np.array(REFERENCE["logits"], dtype=np.float64)[:, 0]
TOLERANCE = 1e-3


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return reranker_path("f32")


@pytest.fixture(scope="module")
def reranker(gguf_path: Path):
    with Reranker(gguf_path) as r:
        yield r


def test_reference_is_current() -> None:
    assert ALL_PAIRS == [*PAIRS, *LONG_PAIRS], "stale reference: run tests/data/make_reranker_reference.py"


# --------------------------------------------------------------------------- conversion


def test_converted_cross_encoder_keeps_its_head(gguf_path: Path) -> None:
    reader = gguf.GGUFReader(gguf_path)
    assert reader.fields["bert.pooling_type"].contents() == int(gguf.PoolingType.RANK)
    assert reader.fields["bert.classifier.output_labels"].contents() == ["LABEL_0"]
    assert ACTIVATION_KEY not in reader.fields  # none recorded in this config.json
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes["cls.weight"] == (64, 64) and shapes["cls.bias"] == (64,)
    assert shapes["cls.output.weight"] == (64, 1) and shapes["cls.output.bias"] == (1,)


def test_cli_converts_a_cross_encoder_with_its_activation(tmp_path: Path) -> None:
    src = make_cross_encoder(tmp_path / "ce", activation_fn="torch.nn.modules.linear.Identity")
    out = tmp_path / "ce.gguf"
    assert main(["convert", str(src), str(out), "--dtype", "f32"]) == 0
    reader = gguf.GGUFReader(out)
    assert reader.fields[ACTIVATION_KEY].contents() == "identity"
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    with Reranker(out) as r:  # the recorded activation is the default
        assert r.activation_fn == "identity"
        np.testing.assert_allclose(r.predict(ALL_PAIRS[:4]), LOGITS[:4], atol=TOLERANCE)


def test_a_classifier_without_pooler_is_refused(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    src = make_cross_encoder(tmp_path / "ce")
    weights = load_file(src / "model.safetensors")
    del weights["bert.pooler.dense.weight"], weights["bert.pooler.dense.bias"]
    save_file(weights, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="pooler"):
        convert_bert(src, tmp_path / "x.gguf")


# --------------------------------------------------------------------------- scores


def test_tokens_and_types_match_the_hf_tokenizer(reranker: Reranker) -> None:
    for pair, ids, types in zip(ALL_PAIRS, REFERENCE["input_ids"], REFERENCE["token_type_ids"], strict=True):
        assert reranker.tokenize(*pair) == (ids, types), pair


def test_predict_matches_transformers(reranker: Reranker) -> None:
    logits = reranker.predict(ALL_PAIRS, activation_fn="identity")
    assert logits.shape == (len(ALL_PAIRS),) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, LOGITS, atol=TOLERANCE)
    # the default for one label: sigmoid, as sentence-transformers' CrossEncoder
    assert reranker.activation_fn == "sigmoid"
    np.testing.assert_allclose(reranker.predict(ALL_PAIRS), _sigmoid(LOGITS), atol=TOLERANCE / 4)
    # alone, the score is the same as packed with others
    single = reranker.predict(ALL_PAIRS[2], activation_fn="identity")
    assert np.ndim(single) == 0 and abs(float(single) - LOGITS[2]) < TOLERANCE
    assert reranker.predict([]).shape == (0,)


def test_two_label_head(tmp_path: Path) -> None:
    two = make_cross_encoder(tmp_path / "two", seed=26, num_labels=2)
    out = convert_bert(two, tmp_path / "two.gguf", dtype="f32")
    expected = np.array(REFERENCE["logits_two_labels"])
    with Reranker(out) as r:
        assert r.num_labels == 2 and r.activation_fn == "identity"
        scores = r.predict(ALL_PAIRS)
        assert scores.shape == (len(ALL_PAIRS), 2)
        np.testing.assert_allclose(scores, expected, atol=TOLERANCE)
        soft = r.predict(ALL_PAIRS, apply_softmax=True)
        np.testing.assert_allclose(soft.sum(axis=1), 1, atol=1e-5)
        with pytest.raises(ValueError, match="one-label"):
            r.rank("q", ["d"])


def test_rank_sorts_best_first(reranker: Reranker) -> None:
    docs = [d for q, d in PAIRS[:8]]
    query = "what is the capital of france"
    expected = _sigmoid(reranker.predict([(query, d) for d in docs], activation_fn="identity"))
    ranked = reranker.rank(query, docs, return_documents=True)
    assert [r["corpus_id"] for r in ranked] == list(np.argsort(-expected, kind="stable"))
    assert all(r["text"] == docs[r["corpus_id"]] for r in ranked)
    assert [r["score"] for r in ranked] == sorted((r["score"] for r in ranked), reverse=True)
    top = reranker.rank(query, docs, top_k=3)
    assert [r["corpus_id"] for r in top] == [r["corpus_id"] for r in ranked[:3]] and "text" not in top[0]
    assert reranker.rank(query, []) == []


def test_over_long_pairs_truncate_or_raise(gguf_path: Path, reranker: Reranker) -> None:
    assert reranker.truncate and reranker.max_length == 64
    n = len(PAIRS)
    np.testing.assert_allclose(
        reranker.predict(LONG_PAIRS, activation_fn="identity"), LOGITS[n:], atol=TOLERANCE
    )
    with Reranker(gguf_path, truncate=False) as strict:
        assert strict.predict(PAIRS[:2]).shape == (2,)
        with pytest.raises(PromptTooLong, match=r"pair 1 has .* tokens, more than the 64") as info:
            strict.predict([PAIRS[0], LONG_PAIRS[0]])
        assert info.value.index == 1  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="max_length"):
        Reranker(gguf_path, max_length=65)


def test_a_model_without_a_head_is_refused() -> None:
    with pytest.raises(ValueError, match="not a reranker"):
        Reranker(reranker_path("f32", head=False))


def test_bad_inputs_name_the_problem(reranker: Reranker, gguf_path: Path) -> None:
    with pytest.raises(TypeError, match="not a string"):
        reranker.predict("just a string")
    with pytest.raises(TypeError, match=r"pairs\[1\]"):
        reranker.predict([("q", "d"), ("only one",)])
    with pytest.raises(TypeError, match=r"pairs\[0\] must hold two strings"):
        reranker.predict([("q", 3)])
    with pytest.raises(ValueError, match="activation_fn"):
        reranker.predict(PAIRS[:1], activation_fn="relu")
    with pytest.raises(ValueError, match="batch_size"):
        reranker.predict(PAIRS, batch_size=0)
    with pytest.raises(ValueError, match="activation_fn"):
        Reranker(gguf_path, activation_fn="nope")


def test_threads_and_asyncio_share_the_packs(reranker: Reranker) -> None:
    expected = reranker.predict(ALL_PAIRS, activation_fn="identity")
    results: dict[int, np.ndarray] = {}

    def work(k: int) -> None:
        results[k] = reranker.predict(ALL_PAIRS[k:] + ALL_PAIRS[:k], activation_fn="identity", batch_size=3)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, got in results.items():
        np.testing.assert_allclose(np.roll(got, k), expected, atol=TOLERANCE)

    async def both() -> tuple[np.ndarray, list[dict]]:
        return await asyncio.gather(
            reranker.apredict(ALL_PAIRS, activation_fn="identity"), reranker.arank("rain", ["a", "b"])
        )

    scores, ranked = asyncio.run(both())
    np.testing.assert_allclose(scores, expected, atol=TOLERANCE)
    assert sorted(r["corpus_id"] for r in ranked) == [0, 1]


def test_progress_bar(reranker: Reranker, capsys: pytest.CaptureFixture[str]) -> None:
    reranker.predict(PAIRS, show_progress_bar=True)
    assert "Reranking" in capsys.readouterr().err


def test_closed(gguf_path: Path) -> None:
    r = Reranker(gguf_path)
    r.close()
    r.close()
    assert r.closed
    with pytest.raises(EngineClosed):
        r.predict(PAIRS[:1])


def test_the_document_segment_needs_its_token_type(gguf_path: Path) -> None:
    """What llama-server computes (every token of type 0) is not the model's score: the
    reference needs the document's type row, which the Reranker feeds as input vectors."""
    with Reranker(gguf_path, activation_fn="identity") as r:
        r._pairs.table._delta[:] = 0  # as if llama.cpp's graph alone added the type rows
        naive = r.predict(PAIRS[:8])
    assert np.abs(naive - LOGITS[:8]).max() > 20 * TOLERANCE


def test_xlm_roberta_cross_encoder(tmp_path: Path) -> None:
    """The bge-reranker shape: XLM-R positions (offset by pad_token_id + 1), a Unigram tokenizer
    as llama.cpp's t5 (UGM) one, ``<s> q </s></s> d </s>``, the RobertaClassificationHead."""
    out = convert_bert(make_xlmr_cross_encoder(tmp_path / "xlmr"), tmp_path / "xlmr.gguf", dtype="f32")
    reader = gguf.GGUFReader(out)
    assert reader.fields["tokenizer.ggml.model"].contents() == "t5"
    assert reader.fields["bert.context_length"].contents() == 64  # 66 rows less RoBERTa's 2
    assert reader.fields["bert.pooling_type"].contents() == int(gguf.PoolingType.RANK)
    with Reranker(out, activation_fn="identity") as r:
        assert r.max_length == 64
        for pair, ids in zip(ALL_PAIRS, REFERENCE["xlmr_input_ids"], strict=True):
            assert r.tokenize(*pair) == (ids, [0] * len(ids)), pair
        np.testing.assert_allclose(
            r.predict(ALL_PAIRS), np.array(REFERENCE["xlmr_logits"])[:, 0], atol=TOLERANCE
        )


def test_torch_outputs(reranker: Reranker) -> None:
    torch = pytest.importorskip("torch", reason="convert_to_tensor needs torch")
    tensor = reranker.predict(PAIRS[:3], convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (3,)
    rows = reranker.predict(PAIRS[:3], convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == 3
    np.testing.assert_allclose(tensor.numpy(), reranker.predict(PAIRS[:3]), atol=1e-6)


def test_sentence_transformers_6_cross_encoder_layout(tmp_path: Path) -> None:
    """``CrossEncoder.save_pretrained`` (sentence-transformers 6): a modules.json naming
    ``sentence_transformers.base.modules.transformer.Transformer``, the activation in
    ``config_sentence_transformers.json``, tokenizer.json without vocab.txt."""
    from llamabatch.gguf.convert import cached_conversion
    from llamabatch.gguf.testing_reranker import cross_encoder_dir

    src = tmp_path / "saved"
    src.mkdir()
    for f in cross_encoder_dir().iterdir():
        if f.name != "vocab.txt":
            (src / f.name).write_bytes(f.read_bytes())
    module = {
        "idx": 0,
        "name": "0",
        "path": "",
        "type": "sentence_transformers.base.modules.transformer.Transformer",
    }
    (src / "modules.json").write_text(json.dumps([module]))
    st_config = {"activation_fn": "torch.nn.modules.linear.Identity", "model_type": "CrossEncoder"}
    (src / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    with Reranker(cached_conversion(src, dtype="f32", cache_dir=tmp_path / "cache")) as r:
        assert r.activation_fn == "identity"
        np.testing.assert_allclose(r.predict(ALL_PAIRS), LOGITS, atol=TOLERANCE)
