"""Tests of llamabatch.gguf.testing: the random-weight GGUF models and the English sentences."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch import testing
from llamabatch.bench.runners.llama_cpp import load_llama_cpp
from llamabatch.gguf import testing_llama
from llamabatch.gguf.testing import (
    BOS_ID,
    BYTE_TOKEN_OFFSET,
    CHATML_TEMPLATE,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    N_SPECIAL_TOKENS,
    PRESETS,
    UNK_ID,
    ModelSpec,
    build_vocab,
    english_sentences,
    model_path,
    spec_hash,
    write_llama_gguf,
)

llama_cpp = pytest.importorskip("llama_cpp")

TINY_Q8 = dataclasses.replace(PRESETS["tiny"], dtype="Q8_0", name="llamabatch-tiny-q8")
LOADABLE = {"tiny": PRESETS["tiny"], "small": PRESETS["small"], "tiny-q8": TINY_Q8}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def tiny_llm(cache: Path):
    llm = load_llama_cpp(str(model_path("tiny", cache=cache)), verbose=False, n_ctx=256)
    yield llm
    llm.close()


def _greedy(llm, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("key", sorted(LOADABLE))
def test_model_loads_and_generates(cache: Path, key: str) -> None:
    spec = LOADABLE[key]
    llm = load_llama_cpp(str(model_path(spec, cache=cache)), verbose=False, n_ctx=256, logits_all=True)
    try:
        assert llm.n_vocab() == spec.n_vocab
        assert llm.metadata["general.architecture"] == "llama"
        assert llm.metadata["general.name"] == spec.name
        assert int(llm.metadata["llama.block_count"]) == spec.n_layer

        prompt = llm.tokenize(b"The quick brown fox jumps over the lazy dog.")
        llm.eval(prompt)
        logits = llm.scores[: len(prompt)]
        assert np.isfinite(logits).all()
        last = logits[-1]
        assert 1.0 < float(last.std()) < 10.0, "logits should have a std of a few units"
        top = np.sort(last)[::-1]
        assert top[0] - top[1] > 1e-3, "the greedy token should be well separated"
        # The next-token distribution depends on the input.
        assert len({int(np.argmax(row)) for row in logits}) > 1

        tokens = _greedy(llm, prompt, 8)
        assert len(tokens) == 8
        assert len(set(tokens)) > 1
        assert all(t >= N_SPECIAL_TOKENS for t in tokens), "greedy output should be normal pieces"
        assert np.isfinite(llm.scores[: llm.n_tokens]).all()
        llm.detokenize(tokens).decode("utf-8")  # normal pieces: valid UTF-8
        assert _greedy(llm, prompt, 8) == tokens, "greedy decoding is deterministic"
    finally:
        llm.close()


def test_special_tokens(tiny_llm) -> None:
    vocab = tiny_llm._model.vocab
    assert llama_cpp.llama_vocab_bos(vocab) == BOS_ID
    assert llama_cpp.llama_vocab_eos(vocab) == EOS_ID
    assert llama_cpp.llama_vocab_eot(vocab) == IM_END_ID
    eog = [t for t in range(tiny_llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    assert eog == [EOS_ID, IM_END_ID]
    assert llama_cpp.llama_vocab_get_add_bos(vocab)
    assert not llama_cpp.llama_vocab_get_add_eos(vocab)

    text = b"<|im_start|>user\nhi<|im_end|>"
    tokens = tiny_llm.tokenize(text, add_bos=False, special=True)
    assert tokens[0] == IM_START_ID and tokens[-1] == IM_END_ID
    assert IM_START_ID not in tiny_llm.tokenize(text, add_bos=False, special=False)
    assert tiny_llm.tokenize(b"A", add_bos=True)[0] == BOS_ID
    pieces, _, _ = build_vocab(PRESETS["tiny"].n_vocab)
    assert pieces[UNK_ID] == "<unk>" and pieces[BYTE_TOKEN_OFFSET + 0x41] == "<0x41>"


def test_chat_template(tiny_llm) -> None:
    assert tiny_llm.metadata["tokenizer.chat_template"] == CHATML_TEMPLATE
    # llama.cpp's built-in template detection recognises it as ChatML.
    messages = (llama_cpp.llama_chat_message * 2)(
        llama_cpp.llama_chat_message(b"system", b"Be brief."),
        llama_cpp.llama_chat_message(b"user", b"Hi!"),
    )
    buf = ctypes.create_string_buffer(1024)
    n = llama_cpp.llama_chat_apply_template(CHATML_TEMPLATE.encode(), messages, 2, True, buf, len(buf))
    assert n > 0
    assert buf.raw[:n].decode() == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )


UNICODE_SAMPLES = [
    "",
    "Hello, world!",
    " leading and  double  spaces ",
    "tabs\tand\nnewlines\r\n",
    "café naïve façade Ünïcödé ñ",
    "emoji 😀🎉 and a family 👩\u200d👩\u200d👧",
    "日本語のテキスト 中文字符 한국어",
    "עברית العربية Ελληνικά русский",
    "<|im_end|> is text when specials are not parsed; so is <0x41>",
    "1234567890 !@#$%^&*()_+-=[]{};':\",./<>?`~|\\",
]


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_unicode_round_trip(tiny_llm, text: str) -> None:
    tokens = tiny_llm.tokenize(text.encode(), add_bos=True, special=False)
    assert tokens[0] == BOS_ID
    assert all(0 <= t < tiny_llm.n_vocab() for t in tokens)
    assert tiny_llm.detokenize(tokens).decode("utf-8") == text


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\u2581")))
def test_any_text_round_trips(tiny_llm, text: str) -> None:
    # llama-cpp-python's detokenize drops SentencePiece's added leading space only after BOS.
    tokens = tiny_llm.tokenize(text.encode(), add_bos=True, special=False)
    assert UNK_ID not in tokens
    assert tiny_llm.detokenize(tokens).decode("utf-8") == text


def test_common_words_are_single_tokens(tiny_llm) -> None:
    tokens = tiny_llm.tokenize(b"the function returns a value", add_bos=False)
    assert len(tokens) == 5


def test_vocab_structure() -> None:
    for n_vocab in (N_SPECIAL_TOKENS + 1, 1024, 4096, 32000):
        pieces, scores, types = build_vocab(n_vocab)
        assert len(pieces) == len(scores) == len(types) == n_vocab
        assert len(set(pieces)) == n_vocab
        normal = set(pieces[N_SPECIAL_TOKENS:])
        for piece in normal:  # prefix-closed: every piece is reachable by merges
            assert all(piece[:end] in normal for end in range(1, len(piece)))
    pieces, scores, types = build_vocab(32000)
    assert pieces[:3] == ("<unk>", "<s>", "</s>")
    assert pieces[IM_START_ID] == "<|im_start|>" and pieces[IM_END_ID] == "<|im_end|>"
    assert {types[BYTE_TOKEN_OFFSET + b] for b in range(256)} == {6}  # BYTE
    assert "\u2581the" in pieces[:400]
    # Longer pieces score higher.
    by_id = {p: s for p, s in zip(pieces, scores, strict=True)}
    assert by_id["\u2581the"] > by_id["\u2581th"] > by_id["th"] > by_id["t"]


# sha256 of build_vocab(32000); see test_vocab_is_pinned.
VOCAB_DIGEST = "9a14ab640dc8af5c8a997f8a980b8b6ad9865a330f24a96c21f912ec4ae5d06d"


def test_vocab_is_pinned() -> None:
    """The vocabulary must not depend on the Python version or machine (bump FORMAT_VERSION and
    this digest together when changing the generator)."""
    pieces, scores, types = build_vocab(32000)
    digest = hashlib.sha256(repr((pieces, [round(s, 6) for s in scores], types)).encode()).hexdigest()
    assert (testing.FORMAT_VERSION, digest) == (1, VOCAB_DIGEST)


def test_weights_are_deterministic(tmp_path: Path) -> None:
    spec = PRESETS["tiny"]
    a = write_llama_gguf(tmp_path / "a.gguf", spec).read_bytes()
    b = write_llama_gguf(tmp_path / "b.gguf", spec).read_bytes()
    c = write_llama_gguf(tmp_path / "c.gguf", dataclasses.replace(spec, seed=1)).read_bytes()
    assert a == b
    assert a != c and len(a) == len(c)
    assert not list(tmp_path.glob(".*.tmp")), "temporary files are cleaned up"


def test_model_path_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMABATCH_CACHE_DIR", str(tmp_path / "cache"))
    path = model_path("tiny")
    assert path.parent == tmp_path / "cache"
    assert spec_hash(PRESETS["tiny"]) in path.name and path.suffix == ".gguf"
    mtime = path.stat().st_mtime_ns
    assert model_path("tiny") == path
    assert model_path(PRESETS["tiny"]) == path
    assert path.stat().st_mtime_ns == mtime, "a cached model is not rebuilt"
    with pytest.raises(ValueError, match="unknown preset"):
        model_path("nope")


def test_model_path_concurrent_builders(tmp_path: Path) -> None:
    spec = dataclasses.replace(PRESETS["tiny"], seed=7, name="concurrent")
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(model_path(spec, cache=tmp_path))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == [results[0].name]
    assert results[0].read_bytes() == write_llama_gguf(tmp_path / "ref.gguf", spec).read_bytes()


def test_spec_hash_changes_with_every_field() -> None:
    base = PRESETS["small"]
    changes = {
        "n_vocab": 4000,
        "n_embd": 512,
        "n_layer": 5,
        "n_head": 4,
        "n_head_kv": 2,
        "n_ff": 1024,
        "n_ctx_train": 2048,
        "dtype": "Q8_0",
        "seed": 1,
        "name": "other",
    }
    assert set(changes) == {f.name for f in dataclasses.fields(ModelSpec)}
    hashes = {spec_hash(base)}
    for field, value in changes.items():
        hashes.add(spec_hash(dataclasses.replace(base, **{field: value})))
    assert len(hashes) == len(changes) + 1
    assert spec_hash(base) == spec_hash(dataclasses.replace(base))


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(PRESETS["tiny"], dtype="Q4_0")
    with pytest.raises(ValueError):
        dataclasses.replace(PRESETS["tiny"], n_head=3)
    with pytest.raises(ValueError):
        dataclasses.replace(PRESETS["tiny"], n_vocab=100)
    with pytest.raises(ValueError):
        dataclasses.replace(PRESETS["tiny"], dtype="Q8_0", n_ff=100)
    assert PRESETS["135m"].n_params > 130_000_000


def test_english_sentences() -> None:
    sentences = english_sentences(2000)
    assert len(sentences) == 2000
    assert len(set(sentences)) == 2000
    for sentence in sentences:
        assert 5 <= len(sentence.split()) <= 60
        assert sentence[0].isupper() and sentence[-1] in ".!?"
    assert english_sentences(2000) == sentences
    assert english_sentences(10) == sentences[:10]
    assert english_sentences(0) == []
    many = english_sentences(len(testing_llama._all_sentences()) + 3)
    assert many[-3:] == many[:3]


@pytest.mark.slow
def test_135m_loads_and_decodes() -> None:
    # The default cache: the benchmarks use the same file.
    spec = PRESETS["135m"]
    llm = load_llama_cpp(str(model_path(spec)), verbose=False, n_ctx=512, logits_all=True)
    try:
        assert llm.n_vocab() == spec.n_vocab
        assert llm.metadata["general.file_type"] == "7"  # MOSTLY_Q8_0
        prompt = llm.tokenize(" ".join(english_sentences(3)).encode())
        llm.eval(prompt)
        last = llm.scores[len(prompt) - 1]
        assert np.isfinite(last).all()
        assert 1.0 < float(last.std()) < 10.0
        top = np.sort(last)[::-1]
        assert top[0] - top[1] > 1e-3
    finally:
        llm.close()
