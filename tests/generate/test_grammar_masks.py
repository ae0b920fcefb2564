"""Grammar masks kept across requests (``GrammarMasks``, the C helper in ``_ffi/_build.py``):
which tokens a grammar allows depends on its state alone, so a pass over the whole vocabulary
is kept, keyed by the grammar's text and its state, and a later request of the same grammar in
the same state finds it instead of matching the vocabulary again.

The masks must never change a token: each test holds chains with masks to chains without them
(and to the whole-vocabulary pass), token for token for the same seed, on the real model:
sampled and greedy chains, top-k and top-p, logit bias bans (a mask must not keep them), a
lazy grammar (no mask while it waits for its trigger), a cache too small to keep much, and
random grammars sharing one cache (hypothesis: the state key must tell every state apart)."""

from __future__ import annotations

import json

import pytest
from grammar_chains import DIGITS, run_chains
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamabatch import LLM, EngineConfig, SamplingParams
from llamabatch._ffi.model import Model
from llamabatch._ffi.sampler import GrammarMasks, SamplerChain

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


@pytest.fixture(scope="module")
def model(smollm2_path):
    with Model(smollm2_path) as model:
        yield model


@pytest.fixture(scope="module")
def shared_masks():
    """One cache for every example of a property: each finds the others' masks."""
    return GrammarMasks(8 << 20)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.8, "top_k": 40},
        {"temperature": 1.2, "top_k": 0, "top_p": 0.9},
        {"temperature": 0.0},
        {"temperature": 1.0, "top_k": 5, "logit_bias": {90: float("-inf"), 28: -2.0}},
    ],
    ids=["top-k", "top-p", "greedy", "bias-ban"],
)
@pytest.mark.parametrize(
    "constraint", [{"json_schema": SCHEMA}, {"grammar": DIGITS}], ids=["schema", "digits"]
)
def test_masked_chains_draw_what_unmasked_chains_draw(model, sampling, constraint):
    masks = GrammarMasks(16 << 20)
    for seed in range(3):  # the later seeds meet the states the first kept
        params = SamplingParams(seed=seed, **sampling, **constraint)
        chains = [
            SamplerChain(model, params, masks=masks),
            SamplerChain(model, params),
            SamplerChain(model, params, top_k_first=False),
        ]
        run_chains(model, chains)
    stats = masks.stats()
    assert stats.entries <= stats.passes and stats.bytes <= 16 << 20, stats
    if stats.passes:  # where the grammar was matched against the whole vocabulary
        assert stats.hits >= 1 and stats.bytes > 0, stats


def test_a_ban_is_not_kept_in_the_mask(model):
    """A logit bias of -inf bans a token in its own request only: the mask is made with equal
    logits, so a request without the ban, in the same state, may still draw it."""
    masks = GrammarMasks(16 << 20)
    grammar = "root ::= [0-9] [0-9]"
    free = run_chains(model, [SamplerChain(model, SamplingParams(temperature=0, grammar=grammar))])
    banned = SamplingParams(temperature=0, grammar=grammar, logit_bias={free[0]: float("-inf")})
    first = run_chains(model, [SamplerChain(model, banned, masks=masks)])
    assert first[0] != free[0]
    plain = SamplingParams(temperature=0, grammar=grammar)
    again = run_chains(model, [SamplerChain(model, plain, masks=masks)])
    assert again == free and masks.stats().hits >= 1


def test_grammars_do_not_share_masks(model):
    """Two grammars whose rules have the same shape (the same states) keep masks of their own:
    the identity is the grammar's text."""
    masks = GrammarMasks(16 << 20)
    for grammar in ("root ::= [0-4]+", "root ::= [5-9]+"):
        params = SamplingParams(temperature=0.0, grammar=grammar, max_tokens=8)
        text = model.detokenize(run_chains(model, [SamplerChain(model, params, masks=masks)], steps=6))
        assert set(text) <= set(grammar[10:13].replace("-", "") + "01234" if "0-4" in grammar else "56789")


def test_a_lazy_grammar_is_free_until_its_trigger(model):
    """A lazy grammar allows every token while it waits for its trigger: no mask is kept then
    (it would open every token to the same grammar's requests in its first state)."""
    masks = GrammarMasks(16 << 20)
    prompt = "Once upon a time"
    greedy = run_chains(model, [SamplerChain(model, SamplingParams(temperature=0))], prompt=prompt)
    trigger = model.detokenize(greedy[:3])[-3:]
    grammar = f"root ::= {json.dumps(trigger)} [0-9] [0-9]"
    lazy = SamplingParams(temperature=0.7, top_k=0, seed=1, grammar=grammar, grammar_triggers=[trigger])
    run_chains(model, [SamplerChain(model, lazy, masks=masks), SamplerChain(model, lazy)], prompt=prompt)
    strict = SamplingParams(temperature=0.7, top_k=0, seed=1, grammar=grammar)
    tokens = run_chains(
        model, [SamplerChain(model, strict, masks=masks), SamplerChain(model, strict)], prompt=prompt
    )
    assert model.detokenize(tokens).startswith(trigger)


def test_a_small_cache_stays_within_its_budget(model):
    masks = GrammarMasks(20_000)  # three masks of SmolLM2's 49,152 tokens at most
    for seed in range(2):
        params = SamplingParams(temperature=1.0, top_k=0, json_schema=SCHEMA, seed=seed)
        run_chains(model, [SamplerChain(model, params, masks=masks), SamplerChain(model, params)])
    stats = masks.stats()
    assert stats.passes > 3 and 1 <= stats.entries <= 3 and stats.bytes <= 20_000, stats


def test_grammar_masks_serve_one_model(model, tiny_path):
    masks = GrammarMasks(1 << 20)
    params = SamplingParams(grammar=DIGITS)
    SamplerChain(model, params, masks=masks).close()
    with Model(tiny_path) as other, pytest.raises(ValueError, match="GrammarMasks hold masks of"):
        SamplerChain(other, params, masks=masks)


def test_grammar_masks_refuse_a_bad_budget():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            GrammarMasks(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grammar_cache_mb must be an int >= 0"):
        EngineConfig(grammar_cache_mb=-1)


def test_the_engine_shares_masks_across_requests(smollm2_path):
    """Eight requests of one schema: the later ones find the structure's masks; the tokens are
    those of an engine without the cache (``grammar_cache_mb=0``)."""
    params = SamplingParams(json_schema=SCHEMA, max_tokens=48, temperature=0.8, seed=5)
    prompts = [f"Describe person {i} as JSON:" for i in range(8)]
    outputs = {}
    for mb in (32, 0):
        with LLM(smollm2_path, n_parallel=4, n_ctx=2048, grammar_cache_mb=mb, prefix_cache=False) as llm:
            outputs[mb] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.stats()
        if mb:
            assert stats.grammar_cache_hits > stats.grammar_cache_passes > 0, stats
            assert stats.grammar_cache_entries > 0 and stats.grammar_cache_bytes > 0
        else:
            assert stats.grammar_cache_hits == stats.grammar_cache_passes == stats.grammar_cache_bytes == 0
    assert outputs[32] == outputs[0]
    for tokens in outputs[32]:
        assert tokens


# -- random grammars: the state key must tell every state apart --------------------------------

#: pieces of grammars: literals, classes, repetitions, alternations and references; the rules
#: reach each other, so the states repeat (in one request and across requests)
_ATOMS = st.sampled_from(['"a"', '" "', '"{"', '"}"', '","', "[0-9]", "[a-z]", "[^a-z0-9]", '"ab"', "item"])


@st.composite
def grammars(draw) -> str:
    def seq() -> str:
        parts = [draw(_ATOMS) + draw(st.sampled_from(["", "+", "{1,3}"]))]  # never empty
        for _ in range(draw(st.integers(0, 2))):
            parts.append(draw(_ATOMS) + draw(st.sampled_from(["", "?", "*", "+", "{1,3}"])))
        return " ".join(parts)

    root = " | ".join(seq() for _ in range(draw(st.integers(1, 3))))
    item = " | ".join(seq().replace("item", '"x"') for _ in range(draw(st.integers(1, 2))))
    return f"root ::= ({root}) ({root})*\nitem ::= {item}\n"


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(grammar=grammars(), seed=st.integers(0, 3), top_k=st.sampled_from([0, 1, 40]))
def test_random_grammars_draw_the_same_tokens_with_masks(model, shared_masks, grammar, seed, top_k):
    params = SamplingParams(grammar=grammar, temperature=1.5, top_k=top_k, seed=seed)
    chains = [SamplerChain(model, params, masks=shared_masks), SamplerChain(model, params, top_k_first=False)]
    run_chains(model, chains, prompt="Output:", steps=16)
