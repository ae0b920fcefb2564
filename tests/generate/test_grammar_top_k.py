"""A sampled request under a grammar with ``top_k`` has its grammar check the best candidates
first (the C helper in ``_ffi/_build.py``): top-k keeps the k best tokens the grammar allows and
the stages after it see only those, so when k of the best few hundred pass, the rest of the
vocabulary need not be matched; when fewer pass, it is. These tests hold the shortcut to the
whole-vocabulary pass (``SamplerChain(top_k_first=False)``) token for token, for the same seed,
on the real model, where either path applies: a JSON schema (mostly free text), digits only
(mostly refused: the whole vocabulary is checked), logit bias and penalties before the grammar,
and a top-k of 1 up to more tokens than the grammar allows."""

from __future__ import annotations

import pytest
from grammar_chains import DIGITS, run_chains

from llamabatch import SamplingParams
from llamabatch._ffi.model import Model
from llamabatch._ffi.sampler import SamplerChain

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def model(smollm2_path):
    with Model(smollm2_path) as model:
        yield model


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_schema": SCHEMA},
        {"grammar": DIGITS},
        {"grammar": DIGITS, "logit_bias": {15: 5.0, 16: -3.0}, "repeat_penalty": 1.3},
    ],
    ids=["schema", "digits", "digits-bias-penalty"],
)
@pytest.mark.parametrize("top_k, temperature", [(40, 0.8), (1, 1.0), (5, 1.5), (400, 1.0)])
def test_top_k_first_draws_what_the_whole_vocabulary_pass_draws(model, constraint, top_k, temperature):
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=7, **constraint)
    chains = [SamplerChain(model, params), SamplerChain(model, params, top_k_first=False)]
    run_chains(model, chains, prompt="Write a JSON profile of a cat, with numbers:", steps=24)
