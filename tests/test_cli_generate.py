"""``llamabatch generate`` on the tiny test model."""

from __future__ import annotations

import json
import sys

import pytest

from llamabatch import testing
from llamabatch.cli import main


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testing.model_path("tiny"))


def test_generate_streams_one_prompt(tiny, capsys):
    assert main(["generate", "-m", tiny, "hello", "-n", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_file_writes_json_lines(tiny, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n\ntwo\nthree\n")
    out = tmp_path / "out.jsonl"
    assert (
        main(["generate", "-m", tiny, "-f", str(prompts), "-n", "4", "-o", str(out), "--n-parallel", "2"])
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["one", "two", "three"]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert all(r["usage"]["completion_tokens"] == 4 and r["finish_reason"] == "length" for r in rows)


def test_generate_json_lines_and_the_bar(tiny, capsys, monkeypatch):
    # With a terminal on stderr the bar is drawn there; stdout still gets whole JSON lines.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    prompts = [f"prompt {i}" for i in range(5)]
    argv = ["generate", "-m", tiny, *prompts, "-n", "3", "--n-parallel", "2", "--ignore-eos", "--seed", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["prompt"] for r in rows] == prompts and all(len(r["token_ids"]) == 3 for r in rows)
    assert "5/5" in captured.err and "generated tokens/s" in captured.err


def test_generate_needs_a_prompt(tiny, capsys):
    assert main(["generate", "-m", tiny]) == 2
    assert capsys.readouterr().err.strip() == "llamabatch generate: error: give PROMPT arguments or --file"
