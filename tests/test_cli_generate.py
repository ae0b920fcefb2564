"""``llamabatch generate`` on the tiny test model."""

from __future__ import annotations

import json

from llamabatch import testing
from llamabatch.cli import main


def test_generate_streams_one_prompt(capsys):
    model = str(testing.model_path("tiny"))
    assert main(["generate", "-m", model, "hello", "-n", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_file_writes_json_lines(tmp_path):
    model = str(testing.model_path("tiny"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n\ntwo\nthree\n")
    out = tmp_path / "out.jsonl"
    assert (
        main(["generate", "-m", model, "-f", str(prompts), "-n", "4", "-o", str(out), "--n-parallel", "2"])
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["one", "two", "three"]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert all(r["usage"]["completion_tokens"] == 4 and r["finish_reason"] == "length" for r in rows)


def test_generate_errors(tmp_path, capsys):
    assert main(["generate", "-m", str(tmp_path / "missing.gguf"), "x"]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["generate", "-m", str(testing.model_path("tiny"))]) == 2
