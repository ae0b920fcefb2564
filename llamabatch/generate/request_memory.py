"""What a request holds in memory, and when: its samplers are built at admission and freed at
its end, and its estimated size is checked at submit against ``max_request_memory_mb``.

A sampler chain with a grammar holds llama.cpp's parser of it: the rules, and a stack of rule
positions per alternative being followed (about 10 bytes per byte of GBNF text, and up to
megabytes for a deeply nested grammar). Built for each of ``n`` completions at submit, a
queue of such requests would hold all their parsers while waiting. Here:

- at submit, on the caller's thread, :func:`check_sampling` checks token ids against the
  vocabulary and the request's estimated memory against the budget (``RequestTooLarge``), and
  :func:`check_sampler_builds` builds the leader's chain once and frees it, so a grammar
  llama.cpp refuses still raises at the caller;
- :class:`SamplerBuilder`, owned by the engine core, builds a completion's chain when it is
  admitted (on the engine's thread; a preempted completion keeps its chain and its state), and
  after a flood of grammars or of requests, once the engine is idle, gives the freed heap back
  to the system (``trim_heap``: glibc keeps freed small allocations otherwise). ``Request.finish`` frees the
  chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from llamabatch._ffi.heap import trim_heap
from llamabatch._ffi.model import Model
from llamabatch._ffi.sampler import GrammarMasks, SamplerChain
from llamabatch.errors import RequestTooLarge
from llamabatch.generate.request import Request, RequestKind
from llamabatch.params import SamplingParams
from llamabatch.prompts.grammar_check import check_grammar, get_grammar_limits

__all__ = [
    "SamplerBuilder",
    "build_sampler",
    "check_sampler_builds",
    "check_sampling",
    "check_vocabulary_ids",
    "estimate_request_bytes",
    "grammar_parser_bytes",
]

MIB = 1 << 20
#: a generated token in its request and output: its id (twice), its time, its share of the text
TOKEN_BYTES = 160
#: one token's log-probability dict, empty, and per entry (measured with tracemalloc)
LOGPROBS_DICT_BYTES, LOGPROB_ENTRY_BYTES = 232, 80
#: grammar text built into parsers since the last heap trim above which the idle engine trims
TRIM_AFTER_TEXT_BYTES = 1 << 20
#: completions admitted since the last heap trim above which the idle engine trims (a flood of
#: requests leaves freed C heap in glibc's arenas: tens of MB after a minute of them)
TRIM_AFTER_COMPLETIONS = 256


def grammar_parser_bytes(grammar: str) -> int:
    """An upper estimate of the memory one llama.cpp parser of ``grammar`` takes: its text
    (kept twice), its elements and rules, and its initial stacks (one per alternative entering
    a rule, as deep as the longest chain of references). Measured 0.6 to 0.8 times this on
    wide, deep, literal and JSON-like grammars."""
    stats = check_grammar(grammar, what="SamplingParams.grammar")  # remembered: checked at coerce
    n_bytes = len(grammar.encode("utf-8", "surrogatepass"))
    stacks = stats.max_stacks * (48 + 8 * stats.ref_depth)
    return 2 * n_bytes + 16 * stats.n_elements + 48 * stats.n_rules + stacks


def estimate_request_bytes(params: SamplingParams, n_parallel: int, n_prompt: int = 0) -> int:
    """The memory a request of ``params`` may hold at once: a grammar parser per running
    completion (at most ``n_parallel`` run together: a waiting completion has none), every
    completion's output of ``max_tokens`` tokens with its log-probabilities, and those of the
    ``n_prompt`` prompt tokens (``prompt_logprobs``)."""
    grammar = params.effective_grammar
    parsers = 0 if grammar is None else min(params.n, n_parallel) * grammar_parser_bytes(grammar)
    per_token = TOKEN_BYTES
    if params.logprobs is not None:
        per_token += LOGPROBS_DICT_BYTES + LOGPROB_ENTRY_BYTES * (params.logprobs + 1)
    prompt = 0
    if params.prompt_logprobs is not None:
        prompt = n_prompt * (LOGPROBS_DICT_BYTES + LOGPROB_ENTRY_BYTES * (params.prompt_logprobs + 1))
    return parsers + params.n * params.max_tokens * per_token + prompt


def check_vocabulary_ids(params: SamplingParams, n_vocab: int) -> None:
    """``ValueError`` naming the field when ``stop_token_ids``, ``logit_bias`` or
    ``allowed_token_ids`` holds a token id outside the vocabulary (``SamplingParams`` cannot
    know its size)."""
    allowed = params.allowed_token_ids or ()
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", allowed[-1:]),  # sorted: the largest
    ):
        for token in ids:
            if token >= n_vocab:
                raise ValueError(f"SamplingParams.{name}: token id {token} >= n_vocab {n_vocab}")


def build_sampler(
    model: Model,
    params: SamplingParams,
    index: int,
    n_ctx_seq: int,
    masks: GrammarMasks | None = None,
    prompt: Sequence[int] = (),
) -> SamplerChain:
    """The sampler chain of completion ``index`` of a request (``seed + index``: completions
    of one seeded request differ, reproducibly); a grammar's masks are kept in ``masks``; the
    penalties and DRY see the end of ``prompt``, as in llama-server."""
    if params.seed is not None and index:
        params = replace(params, seed=(params.seed + index) % 2**32)
    limits = get_grammar_limits()
    return SamplerChain(
        model, params, n_ctx=n_ctx_seq, max_live_stacks=limits.max_live_stacks, masks=masks, history=prompt
    )


def check_sampling(
    params: SamplingParams, n_vocab: int, *, n_parallel: int, max_mb: int, n_prompt: int = 0
) -> None:
    """The submit-time checks of a request's sampling before its prompt is read (again with
    its ``n_prompt`` tokens when it asks for ``prompt_logprobs``): token ids against the
    vocabulary (``ValueError`` naming the field), the estimated memory against
    ``max_request_memory_mb`` (``RequestTooLarge``)."""
    check_vocabulary_ids(params, n_vocab)
    size = estimate_request_bytes(params, n_parallel, n_prompt)
    if size > max_mb * MIB:
        grammar = params.effective_grammar
        raise RequestTooLarge(
            f"the request may take about {-(-size // MIB)} MiB, above max_request_memory_mb={max_mb}: "
            f"n={params.n} completions of up to max_tokens={params.max_tokens} tokens, "
            f"logprobs={params.logprobs}"
            + (
                ""
                if not n_prompt
                else f", prompt_logprobs={params.prompt_logprobs} of {n_prompt} prompt tokens"
            )
            + ("" if grammar is None else f", a grammar of {len(grammar)} characters")
            + "; ask for fewer completions (n), tokens (max_tokens) or logprobs"
        )


def check_sampler_builds(model: Model, leader: Request, n_ctx_seq: int) -> None:
    """Build the leader's sampler chain once and free it: a grammar llama.cpp refuses raises
    here, at the caller (its completions' own chains are built at admission)."""
    if not leader.fast_greedy:
        build_sampler(model, leader.params, 0, n_ctx_seq).close()


class SamplerBuilder:
    """The engine core's: a completion's sampler chain, built when it is admitted."""

    def __init__(self, model: Model, n_ctx_seq: int, grammar_cache_mb: int = 0) -> None:
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        #: the grammar masks requests share (``grammar_cache_mb``; None: off)
        self.masks = GrammarMasks(grammar_cache_mb * MIB) if grammar_cache_mb > 0 else None
        #: grammar text built into parsers, and completions admitted, since the heap was last
        #: trimmed; and the trims
        self.grammar_bytes_built = 0
        self.completions_admitted = 0
        self.heap_trims = 0

    def attach(self, request: Request) -> Exception | None:
        """Give ``request`` its sampler chain unless it has one or needs none; the exception
        when it cannot be built (the caller ends that request, not the engine)."""
        self.completions_admitted += 1
        if request.sampler is not None or request.fast_greedy or request.kind is RequestKind.PIN:
            return None
        try:
            request.sampler = build_sampler(
                self.model, request.params, request.index, self.n_ctx_seq, self.masks, request.prompt_tokens
            )
        except Exception as exc:  # out of memory, or llama.cpp refusing what it took at submit
            return exc
        grammar = request.params.effective_grammar
        if grammar is not None:
            self.grammar_bytes_built += len(grammar)
        return None

    def mask_stats(self) -> dict[str, Any]:
        """``GenerationStats``' ``grammar_cache_*`` fields (zeros with the cache off)."""
        if self.masks is None:
            return {}
        return {f"grammar_cache_{k}": v for k, v in dataclasses.asdict(self.masks.stats()).items()}

    def when_idle(self) -> None:
        """The engine has nothing left to do: after a flood of grammars, or of requests, give
        the freed C heap back to the system."""
        if (
            self.grammar_bytes_built >= TRIM_AFTER_TEXT_BYTES
            or self.completions_admitted >= TRIM_AFTER_COMPLETIONS
        ):
            self.grammar_bytes_built = self.completions_admitted = 0
            self.heap_trims += 1
            trim_heap()
