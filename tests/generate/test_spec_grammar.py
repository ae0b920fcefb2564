"""Drafts of the text a grammar forces (``generate/spec_grammar.py``, ``grammar_drafts`` of the
n-gram and suffix methods): the forced text read from llama.cpp's parse stacks (the C helper in
``_ffi/_build.py``) without changing the grammar's state, its tokens as drafts, outputs equal
to a run without speculation on the real model (greedy and seeded), and, on the fake context,
forced drafts going on where failing lookups have spent the drafts' budget."""

from __future__ import annotations

import argparse
import itertools
import struct
from types import SimpleNamespace

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_speculative_fake import CHEAP_DRAFTS, OracleDrafter

from llamabatch import LLM, EngineConfig, SamplingParams
from llamabatch._ffi.model import Model
from llamabatch._ffi.sampler import SamplerChain
from llamabatch.generate.draft_model import Draft
from llamabatch.generate.spec_config import validate_speculative_config
from llamabatch.generate.spec_grammar import GrammarDrafts
from llamabatch.generate.speculative import Speculator

#: a schema whose keys are long: each key's text after its opening quote is forced
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "favourite_programming_language": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
    },
    "required": ["name", "favourite_programming_language", "age"],
}


@pytest.fixture(scope="module")
def model(smollm2_path):
    with Model(smollm2_path) as model:
        yield model


def _chain(model: Model, grammar: str, **params) -> SamplerChain:
    return SamplerChain(model, SamplingParams(temperature=0, grammar=grammar, **params))


@pytest.mark.parametrize(
    ("grammar", "max_bytes", "expected"),
    [
        ('root ::= "hello" [a-z]', 256, (b"hello", False)),
        ('root ::= "hello" [a-z]', 3, (b"hel", False)),
        ('root ::= "ab" | "ac"', 256, (b"a", False)),  # both ways take "a", then part
        ('root ::= "abc"', 256, (b"abc", True)),  # nothing but the end after it
        ('root ::= [a-z] "xyz"', 256, (b"", False)),  # a range: free
        ('root ::= "x"? "y"', 256, (b"", False)),  # the grammar may skip "x": free
        ('root ::= "h\u00e9\u2192" [0-9]', 4, ("h\u00e9".encode(), False)),  # never half a character
    ],
)
def test_the_forced_text_of_a_grammar(model, grammar, max_bytes, expected):
    chain = _chain(model, grammar)
    assert chain.forced_text(max_bytes) == expected
    assert chain.forced_text(max_bytes) == expected  # the walk put the grammar's stacks back


@pytest.mark.timeout(60)
def test_the_walk_is_bounded_where_an_ambiguous_grammar_doubles_its_stacks(model):
    """Each "a" doubles the recursive rule's parse stacks (a "b" or a "c" owed for each), and
    every stack's next character is "a" until the literal's 300: a walk of 256 characters
    would hold 2**256 stacks. It stops past 64 stacks (sampling stops such a grammar at
    ``max_live_stacks`` after a few tokens)."""
    literal = '"' + "a" * 300 + '"'
    chain = _chain(model, f'root ::= r\nr ::= "a" r "b" | "a" r "c" | {literal}')
    text, ends = chain.forced_text()
    assert 0 < len(text) <= 8 and set(text) == {ord("a")} and not ends
    long = _chain(model, f'root ::= {literal} | {literal} "b"')  # two stacks: the whole walk
    assert long.forced_text() == (b"a" * 256, False)


def test_no_forced_text_without_a_grammar_or_before_a_lazy_grammar_wakes(model):
    assert SamplerChain(model, SamplingParams(temperature=0.7)).forced_text() == (b"", False)
    lazy = SamplerChain(
        model, SamplingParams(temperature=0, grammar='root ::= "<call>" "abc"', grammar_triggers=["<call>"])
    )
    assert lazy.forced_text() == (b"", False)


def test_reading_the_forced_text_leaves_the_tokens_sampled_unchanged(smollm2_path):
    """The same schema request sampled with and without the forced text read before every
    token (the grammar's stacks are walked and put back each time): the same tokens."""
    outputs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 8}):
        with LLM(smollm2_path, n_parallel=1, speculative_config=spec) as llm:
            out = llm.generate(
                ["A person as JSON:"],
                SamplingParams(max_tokens=60, temperature=0.8, seed=5, json_schema=SCHEMA),
            )
            outputs.append(out[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1]


def test_a_forced_text_drafts_its_tokens_but_the_last_one_unless_the_grammar_ends(model):
    tokenize = lambda text: model.tokenize(text, add_special=False)  # noqa: E731
    texts = iter([(b'favourite_programming_language"', False), (b"}", True), (b"", False)])
    drafts = GrammarDrafts(tokenize, forced=lambda request: next(texts))
    full = tokenize(b'favourite_programming_language"')
    request = SimpleNamespace(arrival=0)
    assert drafts.draft(request, 64) == full[:-1]  # type: ignore[arg-type]
    assert drafts.draft(request, 64) == tokenize(b"}")  # type: ignore[arg-type]
    assert drafts.draft(request, 64) == []  # type: ignore[arg-type]


def test_schema_requests_draft_their_keys_and_keep_their_tokens(smollm2_path):
    """SmolLM2 writing JSON under a schema: greedy tokens equal to a run without speculation,
    its keys drafted (every forced draft accepted here), none with ``grammar_drafts`` off."""
    messages = [{"role": "user", "content": "Describe a fictional programmer as JSON."}]
    params = SamplingParams(max_tokens=80, temperature=0, json_schema=SCHEMA)
    runs = {}
    for name, spec in (
        ("off", None),
        ("on", {"method": "ngram"}),
        ("lookups only", {"method": "ngram", "grammar_drafts": False}),
    ):
        with LLM(smollm2_path, n_parallel=1, speculative_config=spec) as llm:
            out = llm.chat(messages, params)[0].outputs[0]
            runs[name] = (out.token_ids, llm.stats())
    assert runs["on"][0] == runs["off"][0] == runs["lookups only"][0]
    stats = runs["on"][1]
    assert stats.spec_grammar_drafts >= 2  # (at least two of the three keys)
    assert stats.spec_grammar_accepted_tokens > 0
    assert stats.spec_grammar_draft_tokens <= stats.spec_draft_tokens
    assert stats.spec_grammar_accepted_tokens <= stats.spec_accepted_tokens
    assert runs["lookups only"][1].spec_grammar_drafts == 0


def _oracle_forced(model, n):
    """Forced text for the fake model: its next ``n`` greedy tokens (as 4-byte ints)."""

    def forced(request):
        history = list(request.prompt_tokens) + list(request.output_tokens)
        tokens = []
        for _ in range(n):
            tokens.append(model.next_token(history))
            history.append(tokens[-1])
        return struct.pack(f"<{n}I", *tokens), False

    return forced


def _unpack(text: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(text) // 4}I", text))


def test_forced_drafts_go_on_where_failing_lookups_spent_the_budget():
    """Lookups that failed have spent the drafts' budget (a ledger far over it): no lookup is
    made, the forced drafts still run (their class's own evidence decides them), and every
    completion is what it is alone."""
    core, ctx, model = make_core(n_parallel=2, n_batch=32)
    lookups = OracleDrafter(model, p_wrong=1.0)
    grammar = GrammarDrafts(_unpack, forced=_oracle_forced(model, 3), applies=lambda request: True)
    core.spec = Speculator({"method": "ngram", "num_speculative_tokens": 8}, lookups, grammar=grammar)
    core.spec.ledger.loss = 1e6  # (decays by 0.1% a tick: over budget for the whole run)
    ctx.cost = CHEAP_DRAFTS
    core.clock = ctx.clock
    rec = Recorder(core, ctx, model)
    for i in range(4):
        rec.new(prompt(6, i), greedy(60))
    rec.run()
    for r in rec.requests:
        rec.check_done(r)
    assert lookups.calls == 0
    assert grammar.drafts > 20 and grammar.accepted == grammar.draft_tokens > 0
    assert core.counters.spec_draft_tokens == grammar.draft_tokens


def test_a_forced_draft_is_cut_before_a_stop_token_too():
    """Forced text running past the request's stop token (the oracle's next 8 tokens): cut
    before it like a lookup's draft, so every forced token drafted is accepted."""
    core, ctx, model = make_core(n_parallel=1, n_batch=32)
    full, _ = model.completion(prompt(6, 1), 40, 1024)
    grammar = GrammarDrafts(_unpack, forced=_oracle_forced(model, 8), applies=lambda request: True)
    core.spec = Speculator(
        {"method": "ngram", "num_speculative_tokens": 8}, OracleDrafter(model, 1.0), grammar=grammar
    )
    core.spec.ledger.loss = 1e6  # (no lookups: the forced drafts alone)
    ctx.cost = CHEAP_DRAFTS
    core.clock = ctx.clock
    rec = Recorder(core, ctx, model)
    (r,) = rec.new(prompt(6, 1), greedy(40, stop_token_ids=[full[12]]))
    rec.run()
    assert r.output.token_ids == full[: full.index(full[12]) + 1]
    timings = r.output.timings  # (13 drafted, 9 kept, before the cut applied to forced text)
    assert grammar.drafts > 0 and timings.spec_draft_tokens == timings.spec_accepted_tokens > 0


def test_the_grammar_drafts_option():
    assert (
        validate_speculative_config({"method": "suffix", "grammar_drafts": False})["grammar_drafts"] is False
    )
    with pytest.raises(ValueError, match="grammar_drafts'\\] must be a bool"):
        validate_speculative_config({"method": "ngram", "grammar_drafts": 1})
    with pytest.raises(ValueError, match="grammar_drafts'\\] is for the methods 'ngram' and 'suffix'"):
        validate_speculative_config({"method": "draft_model", "model": "d.gguf", "grammar_drafts": True})
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(
        parser.parse_args(["--spec-type", "ngram", "--no-spec-grammar-drafts"])
    )
    assert config.speculative_config is not None and config.speculative_config["grammar_drafts"] is False
    again = EngineConfig.from_cli_args(parser.parse_args(config.to_cli_args()))
    assert again.speculative_config == config.speculative_config
    with pytest.raises(ValueError, match="needs --spec-type"):
        EngineConfig.from_cli_args(parser.parse_args(["--spec-grammar-drafts"]))


def test_over_budget_requests_without_a_grammar_draft_nothing():
    core, ctx, model = make_core(n_parallel=2, n_batch=32)
    lookups = OracleDrafter(model, p_wrong=0.0)
    grammar = GrammarDrafts(_unpack, forced=_oracle_forced(model, 3), applies=lambda request: False)
    core.spec = Speculator({"method": "ngram", "num_speculative_tokens": 8}, lookups, grammar=grammar)
    core.spec.ledger.loss = 1e6
    ctx.cost = CHEAP_DRAFTS
    core.clock = ctx.clock
    rec = Recorder(core, ctx, model)
    (r,) = rec.new(prompt(6, 1), greedy(30))
    rec.run()
    rec.check_done(r)
    assert lookups.calls == 0 and grammar.drafts == 0 and core.counters.spec_draft_tokens == 0


# -- the forced text against a brute-force reference --------------------------------------------

_LETTERS = "abc"


def _node():
    """A finite grammar over ``_LETTERS``: literals, sequences, alternatives and optionals, as
    ``(gbnf, language)`` (every string the grammar accepts)."""
    literal = st.text(_LETTERS, min_size=1, max_size=3).map(lambda s: (f'"{s}"', {s}))

    def extend(children):
        seq = st.lists(children, min_size=2, max_size=3).map(
            lambda parts: (
                "(" + " ".join(g for g, _ in parts) + ")",
                {"".join(p) for p in itertools.product(*(lang for _, lang in parts))},
            )
        )
        alt = st.lists(children, min_size=2, max_size=3).map(
            lambda parts: (
                "(" + " | ".join(g for g, _ in parts) + ")",
                set().union(*(lang for _, lang in parts)),
            )
        )
        opt = children.map(lambda c: (f"{c[0]}?", c[1] | {""}))
        return st.one_of(seq, alt, opt)

    return st.recursive(literal, extend, max_leaves=6)


def _common_prefix(strings: set[str]) -> str:
    first, last = min(strings), max(strings)  # (the prefix common to all is theirs)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(grammar=_node())
def test_the_forced_text_is_what_every_string_of_the_grammar_starts_with(model, grammar):
    """Random finite grammars of literals: the forced text is the longest prefix common to
    every string the grammar accepts, cut where one of them ends there (the grammar could stop),
    and it "ends" exactly when that prefix is the only string."""
    gbnf, language = grammar
    language = {x + "z" for x in language}  # (a grammar that may produce nothing is refused)
    common = _common_prefix(language)
    text, ends = _chain(model, f'root ::= {gbnf} "z"').forced_text()
    assert text.decode() == common
    assert ends == (language == {common})


def test_a_lookup_that_goes_on_past_the_forced_text_is_kept():
    forced = GrammarDrafts(
        _unpack, forced=lambda r: (struct.pack("<3I", 1, 2, 3), False), applies=lambda r: True
    )
    requests = [SimpleNamespace(arrival=i) for i in range(4)]
    drafts = {0: Draft([1, 2, 7, 8], "match"), 1: Draft([1, 2], "match"), 2: Draft([9, 9, 9], "match")}
    chosen = forced.merge(requests, [8, 8, 8, 1], drafts)  # (forced text: 1, 2, 3; its last one left out)
    assert chosen == {1, 2, 3}
    assert [drafts[i].tokens for i in range(4)] == [[1, 2, 7, 8], [1, 2], [1, 2], [1]]


def test_the_token_the_model_wrote_for_a_left_out_one_is_drafted_next_time():
    """``name"`` drafts ``name`` (its ``"`` left out) and the model writes ``":``: the next
    forced text that leaves ``"`` out drafts ``":`` after its tokens."""
    quote, colon = 90, 91
    vocab = {b"name": 10, b"age": 11, b'"': quote}

    def tokenize(text: bytes) -> list[int]:
        return [vocab[text[:-1]], quote]

    texts = iter([b'name"', b'age"', b'age"'])
    drafts = GrammarDrafts(tokenize, forced=lambda r: (next(texts), False), applies=lambda r: True)
    request = SimpleNamespace(arrival=7)
    assert drafts.draft(request, 8) == [10]  # type: ignore[arg-type]
    drafts.verified(7, 1, 1, [10, colon])  # the forced token held; then the model wrote ":
    assert drafts.draft(request, 8) == [11, colon]  # type: ignore[arg-type]
    drafts.release(7)
    assert drafts.draft(request, 8) == [11]  # type: ignore[arg-type]
