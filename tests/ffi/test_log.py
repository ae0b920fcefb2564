"""llama.cpp's log: routed to the ``llamabatch.llama_cpp`` logger, quiet by default.

Expected messages (an aborted decode, a KV-cache retry, a context shorter or longer than the
training context) go to DEBUG whatever llama.cpp's level; real errors stay errors; nothing
reaches stderr unless a warning or error is real. Failed loads carry llama.cpp's reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llamabatch import LLM, ModelLoadError, SamplingParams
from llamabatch._ffi import ensure_backend, ffi, lib, log
from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch.errors import DecodeError, KVCacheFull
from llamabatch.gguf.testing import model_path

LOGGER = "llamabatch.llama_cpp"
#: ggml's log levels (ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5)
LEVELS = {"INFO": 2, "WARN": lib.GGML_LOG_LEVEL_WARN, "ERROR": lib.GGML_LOG_LEVEL_ERROR}


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_path("tiny")


def _say(level: int, text: str) -> None:
    """Send ``text`` through the real C log callback, as llama.cpp does."""
    ensure_backend()
    lib._llamabatch_log_callback(level, ffi.new("char[]", text.encode()), ffi.NULL)


def _records(caplog: pytest.LogCaptureFixture, at_least: int = logging.DEBUG) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= at_least]


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize(
    ("level", "line"),
    [
        ("ERROR", "process_ubatch: failed to compute graph, compute status: 1"),
        ("ERROR", "graph_compute: ggml_backend_sched_graph_compute_async failed with error 1"),
        ("ERROR", "llama_decode: failed to decode, ret = 2"),
        ("ERROR", "llama_encode: failed to encode, ret = 2"),
        ("ERROR", "decode: compute aborted"),
        ("WARN", "decode: failed to find a memory slot for batch of size 512"),
        ("WARN", "decode: removing memory module entries for seq_id = 0, pos = [12, +inf)"),
        (
            "WARN",
            "llama_context: n_ctx_seq (8192) > n_ctx_train (4096) -- possible training context overflow",
        ),
        ("INFO", "llama_context: n_ctx_seq (512) < n_ctx_train (4096) -- the full capacity will not be used"),
    ],
)
def test_expected_messages_go_to_debug(caplog: pytest.LogCaptureFixture, level: str, line: str) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    _say(LEVELS[level], line + "\n")
    [record] = _records(caplog)
    assert record.getMessage() == line
    assert record.levelno == logging.DEBUG


@pytest.mark.parametrize(
    ("level", "line", "expected"),
    [
        ("ERROR", "llama_decode: failed to decode, ret = -3", logging.ERROR),
        ("ERROR", "process_ubatch: failed to compute graph, compute status: -1", logging.ERROR),
        ("ERROR", "init: invalid token[0] = 99999", logging.ERROR),
        ("WARN", "load: control-looking token: 7 '<|im_end|>' was not control-type", logging.WARNING),
        ("INFO", "print_info: file type = all F32", logging.DEBUG),
    ],
)
def test_real_messages_keep_their_level(
    caplog: pytest.LogCaptureFixture, level: str, line: str, expected: int
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    _say(LEVELS[level], line + "\n")
    [record] = _records(caplog)
    assert (record.getMessage(), record.levelno) == (line, expected)


def test_pieces_of_a_line_are_joined(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    _say(lib.GGML_LOG_LEVEL_ERROR, "llama_decode: ")
    _say(lib.GGML_LOG_LEVEL_CONT, "failed to decode, ")
    _say(lib.GGML_LOG_LEVEL_CONT, "ret = -3\n")
    [record] = _records(caplog)
    assert (record.getMessage(), record.levelno) == (
        "llama_decode: failed to decode, ret = -3",
        logging.ERROR,
    )


def test_capture_holds_warnings_until_released(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with log.capture() as held:
        _say(lib.GGML_LOG_LEVEL_ERROR, "llama_model_load: error loading model: key not found in model: x\n")
        _say(LEVELS["INFO"], "print_info: general.name = y\n")
        assert [r.getMessage() for r in _records(caplog)] == ["print_info: general.name = y"]
        assert held.errors == ["llama_model_load: error loading model: key not found in model: x"]
        held.release(failed=True)
    assert [r.levelno for r in _records(caplog)] == [logging.DEBUG, logging.DEBUG]
    caplog.clear()
    with log.capture():  # not released: logged at its own level when the block ends
        _say(lib.GGML_LOG_LEVEL_WARN, "load: something odd\n")
    assert [(r.getMessage(), r.levelno) for r in _records(caplog)] == [
        ("load: something odd", logging.WARNING)
    ]


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        (
            [
                "llama_model_load: error loading model: error loading model hyperparameters: "
                "key not found in model: llama.context_length",
                "llama_model_load_from_file_impl: failed to load model",
            ],
            "key not found in model: llama.context_length",
        ),
        (
            [
                "gguf_init_from_file_impl: tensor 'a' has offset 0, expected 64",
                "gguf_init_from_file_impl: failed to read tensor data",
                "llama_model_load: error loading model: llama_model_loader: failed to load model from x",
                "llama_model_load_from_file_impl: failed to load model",
            ],
            "tensor 'a' has offset 0, expected 64; failed to read tensor data",
        ),
        (["llama_model_load_from_file_impl: failed to load model"], ""),
    ],
)
def test_load_reason(lines: list[str], reason: str) -> None:
    assert log.load_reason(lines) == reason


# --------------------------------------------------------------------------- against llama.cpp


def test_rejected_file_carries_llama_cpps_reason(
    tmp_path: Path, tiny: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    data = tiny.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) - 1000])  # the header is intact, the last tensor is cut
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with pytest.raises(ModelLoadError) as info:
        Model(bad, validate=False)
    message = str(info.value)
    assert "truncated.gguf" in message
    assert "llama.cpp rejected the file: tensor 'output.weight' data is not within the file bounds" in message
    assert not _records(caplog, logging.WARNING)  # in the exception, not logged as an error too
    assert capfd.readouterr().err == ""


def test_kv_retry_and_abort_are_quiet(
    tiny: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with Model(tiny) as model, Context(model, n_ctx=256, n_batch=256, n_threads=1) as ctx:
        prompt = model.tokenize("the " * 150)[:150]
        ctx.decode_tokens(prompt)
        with pytest.raises(KVCacheFull):  # 150 + 150 tokens in 256 cells
            ctx.decode_tokens(prompt, pos0=150)
        ctx.abort()
        with pytest.raises(DecodeError, match="abort"):
            ctx.decode_tokens(prompt[:8], seq_id=0, pos0=150)
        ctx.clear_abort()
    messages = [r.getMessage() for r in _records(caplog)]
    assert any("failed to find a memory slot" in m for m in messages)
    assert any("failed to decode, ret = 2" in m for m in messages)
    assert not _records(caplog, logging.WARNING), [r.getMessage() for r in _records(caplog, logging.WARNING)]
    assert capfd.readouterr().err == ""


def test_real_decode_error_stays_an_error(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with Model(tiny) as model, Context(model, n_ctx=64, n_batch=64, n_threads=1) as ctx:
        with pytest.raises(DecodeError):
            ctx.decode_tokens([model.n_vocab + 5])  # llama.cpp refuses the token id
    errors = [r.getMessage() for r in _records(caplog, logging.ERROR)]
    assert any("failed to decode, ret = -1" in m for m in errors), errors


def test_training_context_warning_is_quiet(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with LLM(tiny, n_ctx=8192, n_parallel=1, n_batch=64, n_threads=1):  # 8192 > n_ctx_train 4096
        pass
    assert any("n_ctx_train" in r.getMessage() for r in _records(caplog))
    assert not _records(caplog, logging.WARNING), [r.getMessage() for r in _records(caplog, logging.WARNING)]


# --------------------------------------------------------------------------- the C filter


def _filter(level: int, text: str) -> None:
    """Send ``text`` through the C filter llama.cpp calls (``llamabatch_log_filter``)."""
    ensure_backend()
    lib.llamabatch_log_filter(level, ffi.new("char[]", text.encode()), ffi.NULL)


def test_lines_under_warn_stop_in_c_unless_debug_was_asked_for(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log.sync_level()
    try:
        assert lib.llamabatch_log_debug == 0
        caplog.set_level(logging.DEBUG, logger=LOGGER)  # not synced: C still drops them
        _filter(LEVELS["INFO"], "print_info: ")
        _filter(lib.GGML_LOG_LEVEL_CONT, "dropped with its line\n")
        _filter(lib.GGML_LOG_LEVEL_WARN, "load: ")
        _filter(lib.GGML_LOG_LEVEL_CONT, "kept with its line\n")
        _filter(lib.GGML_LOG_LEVEL_ERROR, "init: kept too\n")
        assert [r.getMessage() for r in _records(caplog)] == ["load: kept with its line", "init: kept too"]
        caplog.clear()
        log.sync_level()  # what a new model or context does
        _filter(LEVELS["INFO"], "print_info: shown\n")
        shown = [(r.getMessage(), r.levelno) for r in _records(caplog)]
        assert shown == [("print_info: shown", logging.DEBUG)]
    finally:
        caplog.set_level(logging.WARNING, logger=LOGGER)
        log.sync_level()


def test_a_decodes_debug_lines_never_reach_python_by_default(
    tiny: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parallel samples copy their prompt across KV streams, and llama.cpp logs each copy and
    the graph it reserves again at DEBUG: from inside llama_decode, each line took the GIL."""
    lines: list[str] = []
    monkeypatch.setattr(log, "_emit", lambda level, line: lines.append(line))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with LLM(tiny, n_ctx=1024, n_parallel=4, kv_unified=False, n_threads=1) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, n=4), use_tqdm=False)
        assert llm.stats().kv_unified is False
    assert lines == []
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with LLM(tiny, n_ctx=1024, n_parallel=4, kv_unified=False, n_threads=1) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, n=4), use_tqdm=False)
    assert any("copying KV buffer" in line for line in lines), lines[-5:]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    log.sync_level()


def test_the_log_is_routed_here_again_after_llama_cpp_python_takes_it(tmp_path: Path, tiny: Path) -> None:
    """llama-cpp-python sets its own log callback when imported, for the one libllama both use:
    a model loaded after that failed with 'no reason given'."""
    import ctypes

    import llama_cpp

    @llama_cpp.llama_log_callback
    def theirs(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        pass

    ensure_backend()
    llama_cpp.llama_log_set(theirs, ctypes.c_void_p(0))  # what its import does with its own
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="data is not within the file bounds"):
        Model(bad, validate=False)
