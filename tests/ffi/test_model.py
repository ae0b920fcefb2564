"""Model / Context owners: errors, metadata, tokenization parity, lifetime."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamabatch import ModelLoadError, testing
from llamabatch._ffi.chat import apply_template, builtin_templates
from llamabatch._ffi.context import Context, check_decode
from llamabatch._ffi.model import Model
from llamabatch.bench.runners.llama_cpp import load_llama_cpp
from llamabatch.errors import DecodeError, KVCacheFull


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return testing.model_path("tiny")


@pytest.fixture(scope="module")
def tiny(tiny_path):
    with Model(tiny_path) as model:
        yield model


@pytest.fixture(scope="module")
def reference(tiny_path):
    return load_llama_cpp(str(tiny_path), vocab_only=True, verbose=False)


# -- errors ---------------------------------------------------------------------------------


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        Model(tmp_path / "nope.gguf")


def test_not_a_gguf_names_the_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model\n")
    with pytest.raises(ModelLoadError, match=r"notes\.gguf") as info:
        Model(path)
    assert "not a GGUF" in str(info.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"empty\.gguf"):
        Model(path)


@pytest.mark.parametrize("fraction", [0.001, 0.3, 0.9])
def test_truncated_gguf_raises_not_crashes(tmp_path, tiny_path, fraction):
    data = tiny_path.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf"):
        Model(path)


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="not a regular file"):
        Model(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"load_mode": "bogus"}, "load_mode"),
        ({"main_gpu": -1}, "main_gpu"),
        ({"n_gpu_layers": 1.5}, "n_gpu_layers"),
    ],
)
def test_invalid_model_params(tiny_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Model(tiny_path, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n_ctx": 0}, "n_ctx"),
        ({"n_batch": -1}, "n_batch"),
        ({"n_batch": 64, "n_ubatch": 128}, "n_ubatch"),
        ({"n_seq_max": 0}, "n_seq_max"),
        ({"n_seq_max": 100_000}, "n_seq_max"),
        ({"n_threads": 0}, "n_threads"),
        ({"pooling": "median"}, "pooling"),
        ({"flash_attn": "yes"}, "flash_attn"),
    ],
)
def test_invalid_context_params(tiny, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Context(tiny, **kwargs)


def test_decode_codes_map_to_exceptions():
    check_decode(0)
    with pytest.raises(KVCacheFull):
        check_decode(1)
    for code in (2, -1, -3):
        with pytest.raises(DecodeError, match=f"code {code}"):
            check_decode(code)


# -- metadata and tokens ----------------------------------------------------------------------


def test_metadata(tiny, reference):
    spec = testing.PRESETS["tiny"]
    assert tiny.architecture == "llama"
    assert tiny.n_vocab == spec.n_vocab == reference.n_vocab()
    assert tiny.n_embd == spec.n_embd
    assert tiny.n_layer == spec.n_layer
    assert tiny.n_ctx_train == spec.n_ctx_train
    assert tiny.n_head == spec.n_head and tiny.n_head_kv == spec.n_head_kv
    assert tiny.size > 0 and tiny.n_params > 0
    assert tiny.chat_template and "<|im_start|>" in tiny.chat_template
    assert tiny.bos == testing.BOS_ID and tiny.eos == testing.EOS_ID
    assert tiny.is_eog(tiny.eos) and not tiny.is_eog(tiny.bos + 300)
    assert tiny.meta("general.architecture") == "llama"
    assert tiny.meta("no.such.key") is None
    assert "general.architecture" in tiny.metadata()
    assert tiny.pooling_type == "unspecified"


def test_tokenization_matches_llama_cpp_python(tiny, reference):
    sentences = testing.english_sentences(3000)
    assert len(set(sentences)) >= 2000
    for text in sentences:
        data = text.encode()
        for add_special in (True, False):
            ours = tiny.tokenize(text, add_special=add_special)
            theirs = reference.tokenize(data, add_bos=add_special, special=False)
            assert ours == theirs, text
    special = "<|im_start|>user\nhello<|im_end|>"
    assert tiny.tokenize(special, parse_special=True) == reference.tokenize(special.encode(), special=True)
    assert tiny.tokenize(special, parse_special=False) == reference.tokenize(special.encode(), special=False)


@pytest.mark.parametrize(
    "text", ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 mix", "tabs\tand\nnewlines", " "]
)
def test_detokenize_round_trip(tiny, text):
    tokens = tiny.tokenize(text, add_special=False)
    assert tiny.detokenize(tokens).lstrip(" ") == text.lstrip(" ")
    pieces = b"".join(tiny.token_to_piece(t) for t in tokens)
    assert pieces.decode().lstrip(" ") == text.lstrip(" ")


def test_bad_token_ids(tiny):
    with pytest.raises(ValueError, match="out of range"):
        tiny.detokenize([tiny.n_vocab])
    with pytest.raises(ValueError, match="out of range"):
        tiny.token_to_piece(-1)


def test_chat_template(tiny):
    assert "chatml" in builtin_templates()
    text = apply_template(tiny.chat_template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role"):
        apply_template("chatml", [{"content": "x"}])
    with pytest.raises(ValueError):
        apply_template("not a template I know {{", [{"role": "user", "content": "x"}])


# -- lifetime ---------------------------------------------------------------------------------


def test_close_is_idempotent_and_closes_contexts(tiny_path):
    model = Model(tiny_path)
    context = Context(model, n_ctx=256, n_batch=32)
    model.close()
    assert context.closed and model.closed
    model.close()
    context.close()
    with pytest.raises(ValueError, match="closed"):
        model.tokenize("x")


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_repeated_load_free_does_not_leak(tiny_path):
    def cycle():
        with Model(tiny_path) as model, Context(model, n_ctx=256, n_batch=32) as context:
            context.decode_tokens(model.tokenize("hello world"))

    for _ in range(5):
        cycle()
    gc.collect()
    before = _rss_kib()
    for _ in range(40):
        cycle()
    gc.collect()
    growth = _rss_kib() - before
    assert growth < 8 * 1024, f"RSS grew by {growth} KiB over 40 load/free cycles"


def test_context_memory_ops(tiny):
    with Context(tiny, n_ctx=256, n_batch=64, n_seq_max=2) as context:
        tokens = tiny.tokenize("the quick brown fox")
        context.decode_tokens(tokens, seq_id=0)
        assert context.seq_pos_max(0) == len(tokens) - 1
        assert context.seq_pos_max(1) == -1
        context.seq_cp(0, 1, 0, 2)
        assert context.seq_pos_max(1) == 1
        context.seq_rm(0)
        context.seq_rm(1)
        assert context.seq_pos_max(0) == -1 == context.seq_pos_max(1)
        assert context.logits_ith(-1).shape == (tiny.n_vocab,)


def test_llama_log_goes_to_logging(tiny_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="llamabatch.llama_cpp"):
        Model(tiny_path).close()
    assert any(r.name == "llamabatch.llama_cpp" for r in caplog.records)


def test_installed_package_imports_from_any_directory(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LLAMABATCH", "LD_LIBRARY_PATH", "PYTHONPATH"))
    }
    code = "import llamabatch._ffi as f; print(f.llama_version())"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_vocab_only_model_tokenizes_and_reports_shape(tiny_path, reference):
    with Model(tiny_path, vocab_only=True) as model:
        spec = testing.PRESETS["tiny"]
        assert (model.n_vocab, model.n_embd, model.n_layer) == (spec.n_vocab, spec.n_embd, spec.n_layer)
        assert model.tokenize("hello world") == reference.tokenize(b"hello world")
        assert "vocabulary only" in model.description
        with pytest.raises(ValueError, match="vocab_only"):
            Context(model)
