"""``SamplerChain``: owner of a llama.cpp sampler chain built from ``SamplingParams``."""

from __future__ import annotations

import random

from llamabatch._ffi import ffi, lib
from llamabatch._ffi.model import Model
from llamabatch.params import SamplingParams

_sample = lib.llama_sampler_sample
#: characters std::regex (ECMAScript) gives a meaning; escaped in trigger words
_REGEX_SPECIAL = frozenset(".^$|()*+?[]{}\\")


def trigger_pattern(word: str) -> str:
    """The std::regex of a lazy-grammar trigger word: the word literally, anywhere; a leading
    ``^`` anchors it at the start of the output (after whitespace). The grammar applies from
    the word on (the first capture group). Only escaped literals reach ``std::regex``: an
    invalid pattern would throw a C++ exception through the C API."""
    anchored = word.startswith("^")
    literal = "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in word.removeprefix("^"))
    return f"^\\s*({literal})" if anchored else f"({literal})"


def _grammar_sampler(model: Model, params: SamplingParams):
    grammar = params.effective_grammar.encode()
    if not params.grammar_triggers:
        return lib.llama_sampler_init_grammar(model.vocab, grammar, b"root")
    patterns = [ffi.new("char[]", trigger_pattern(w).encode()) for w in params.grammar_triggers]
    array = ffi.new("const char *[]", patterns)
    return lib.llama_sampler_init_grammar_lazy_patterns(
        model.vocab, grammar, b"root", array, len(patterns), ffi.NULL, 0
    )


class SamplerChain:
    """One request's sampler chain; it keeps its own state (penalty window, grammar, RNG).

    The order follows llama.cpp's usual chain: logit bias, penalties, grammar, then either
    greedy, or top-k, typical, top-p, min-p, temperature and a seeded draw.
    """

    def __init__(self, model: Model, params: SamplingParams) -> None:
        self._ptr = ffi.NULL
        chain_params = lib.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        chain = lib.llama_sampler_chain_init(chain_params)
        if chain == ffi.NULL:
            raise MemoryError("llama_sampler_chain_init returned NULL")
        # Own the chain first so a failure below frees what was added.
        self._ptr = ffi.gc(chain, lib.llama_sampler_free)
        self.seed = params.seed if params.seed is not None else random.getrandbits(32)
        n_vocab = model.n_vocab

        if params.logit_bias:
            for token in params.logit_bias:
                if token >= n_vocab:
                    raise ValueError(f"SamplingParams.logit_bias: token id {token} >= n_vocab {n_vocab}")
            biases = ffi.new("llama_logit_bias[]", [(t, b) for t, b in params.logit_bias.items()])
            self._add(lib.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        if params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self._add(
                lib.llama_sampler_init_penalties(
                    n_vocab,
                    params.penalty_last_n,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
        if params.effective_grammar is not None:  # grammar, or json_schema / response_format's
            grammar = _grammar_sampler(model, params)
            if grammar == ffi.NULL:
                raise ValueError("SamplingParams.grammar: llama.cpp could not parse the GBNF grammar")
            self._add(grammar)
        if params.greedy:
            self._add(lib.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                self._add(lib.llama_sampler_init_top_k(params.top_k))
            if params.typical_p < 1.0:
                self._add(lib.llama_sampler_init_typical(params.typical_p, 1))
            if params.top_p < 1.0:
                self._add(lib.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                self._add(lib.llama_sampler_init_min_p(params.min_p, 1))
            self._add(lib.llama_sampler_init_temp(params.temperature))
            self._add(lib.llama_sampler_init_dist(self.seed))

    def _add(self, sampler) -> None:
        if sampler == ffi.NULL:
            raise MemoryError("llama.cpp returned a NULL sampler")
        lib.llama_sampler_chain_add(self._ptr, sampler)  # the chain owns it from here

    @property
    def ptr(self):
        if self._ptr == ffi.NULL:
            raise ValueError("the sampler chain is closed")
        return self._ptr

    def sample(self, context, idx: int) -> int:
        """Sample from the logits at batch index ``idx`` of ``context``'s last decode; the
        chosen token is accepted into the chain's state."""
        return _sample(self._ptr, context._ptr, idx)

    def close(self) -> None:
        if self._ptr != ffi.NULL:
            ffi.release(self._ptr)
            self._ptr = ffi.NULL
