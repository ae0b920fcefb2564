"""What the grammar sampling tests share: a grammar that refuses most of the vocabulary, and
the loop that holds sampler chains to one another on the same logits."""

from __future__ import annotations

from llamabatch._ffi.context import Context

#: digits and commas only: the first candidates seldom hold k that pass
DIGITS = 'root ::= [0-9]+ ("," [0-9]+)*'


def run_chains(model, chains, prompt="Describe a person as JSON:", steps=40):
    """Sample with every chain on the same logits, feeding the first chain's token; the tokens,
    after checking that every chain drew the same one at every step. Closes the chains."""
    tokens = []
    ids = model.tokenize(prompt)
    with Context(model, n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=1, n_threads=2) as context:
        context.decode_tokens(ids, 0, 0)
        index, pos = len(ids) - 1, len(ids)
        for step in range(steps):
            drawn = [chain.sample(context, index) for chain in chains]
            assert len(set(drawn)) == 1, (step, drawn)
            tokens.append(drawn[0])
            if model.is_eog(drawn[0]):
                break
            context.decode_tokens([drawn[0]], pos, 0)
            index, pos = 0, pos + 1
    for chain in chains:
        chain.close()
    return tokens
