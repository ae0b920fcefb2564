"""Fuzzing the model loader: no GGUF file may crash or hang the process.

``tests/gguf_mutants.py`` draws deterministic mutants of the project's models, semantic (a wrong
vocabulary, hyper-parameters, architecture, tensors) and byte-level (bit flips, truncations,
huge counts and offsets), and runs each in a child process: load with validation on (the
default), tokenize, detokenize, generate a few tokens or embed. A mutant passes when the child
either works or raises a clean Python exception (a ``LlamaBatchError`` or ``ValueError``); a
child killed by a signal is a crash, one that stops answering a hang.

The default suite runs every class twice (about 100 mutants); ``--runslow`` runs 1,500
(1,000 semantic, 500 byte-level).
The summary line (mutant counts, crashes, hangs) is printed with ``pytest -s``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from gguf_mutants import (
    BYTE,
    SEMANTIC,
    Bases,
    Mutant,
    Report,
    generate,
    issue_mutants,
    run_mutants,
    write_bases,
)

#: Generous for tiny models on a loaded 2-core machine; a real hang never answers.
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    return Bases(write_bases(tmp_path_factory.mktemp("fuzz-bases")))


def _check(report: Report) -> None:
    print("\n" + report.summary())
    problems = report.crashes + report.hangs + report.unclean
    assert not problems, "\n".join(str(o) for o in problems)
    # Rejected at load means rejected by the validator or by llama.cpp itself: a ModelLoadError.
    at_load = Counter(o.error_type for o in report.outcomes if o.result == "error" and o.stage == "load")
    assert set(at_load) <= {"ModelLoadError", "ValueError"}, at_load


def test_issue_cases_load_cleanly(bases: Bases, tmp_path: Path) -> None:
    """The files issue 11 found killing the process: each is now a ModelLoadError at load."""
    cases = issue_mutants(bases)
    mutants = [
        Mutant(i, name, "semantic", "llama", name, data) for i, (name, data) in enumerate(cases.items())
    ]
    report = run_mutants(mutants, tmp_path, timeout=TIMEOUT)
    _check(report)
    assert [(o.result, o.stage, o.error_type) for o in report.outcomes] == [
        ("error", "load", "ModelLoadError")
    ] * len(cases)


def test_fuzz_every_class(bases: Bases, tmp_path: Path) -> None:
    n = 2 * (len(SEMANTIC) + len(BYTE))  # every class twice, on different bases
    mutants = generate(bases, n, seed=11)
    assert {m.name for m in mutants} == set(SEMANTIC) | set(BYTE)
    report = run_mutants(mutants, tmp_path, timeout=TIMEOUT)
    _check(report)
    assert report.of("ok"), "some mutants should still load and run"


@pytest.mark.slow
def test_fuzz_long(bases: Bases, tmp_path: Path) -> None:
    """1,000 semantic and 500 byte-level mutants."""
    mutants = generate(bases, 1000, seed=2024, kinds=("semantic",))
    mutants += generate(bases, 500, seed=2024, kinds=("byte",), start=len(mutants))
    _check(run_mutants(mutants, tmp_path, timeout=TIMEOUT))


@pytest.mark.slow
def test_issue_cases_crash_without_validation(bases: Bases, tmp_path: Path) -> None:
    """What the validator prevents: with ``validate=False`` llama.cpp kills the child on the
    issue's files (all but the "none" tokenizer, which Model.tokenize refuses by itself).

    This documents llama.cpp's behaviour at the pinned version; a newer llama.cpp that rejects
    some of these files itself would make this test fail, which is good news to act on."""
    cases = issue_mutants(bases)
    mutants = [
        Mutant(i, name, "semantic", "llama", name, data) for i, (name, data) in enumerate(cases.items())
    ]
    report = run_mutants(mutants, tmp_path, validate=False, timeout=TIMEOUT)
    print("\n" + report.summary())
    results = {o.mutant.name: o.result for o in report.outcomes}
    assert results.pop("tokenizer_none") == "error"
    assert set(results.values()) == {"crash"}, results
