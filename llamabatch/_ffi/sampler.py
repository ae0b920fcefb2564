"""``SamplerChain``: owner of a llama.cpp sampler chain built from ``SamplingParams``."""

from __future__ import annotations

import hashlib
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from llamabatch._ffi import BUILD, ffi, lib
from llamabatch._ffi.model import Model
from llamabatch.errors import GrammarDeadEnd
from llamabatch.param_spec import ENGINE_STAGES

if TYPE_CHECKING:  # the binding imports nothing above it; params are only read
    from llamabatch.params import SamplingParams

_sample = lib.llama_sampler_sample
_sample_guarded = lib.llamabatch_sampler_sample_guarded
_ERROR_SIZE = 512
#: ``penalty_last_n`` when no context size is given: llama.cpp's default context
_DEFAULT_PENALTY_CTX = 4096


class SamplingError(RuntimeError):
    """llama.cpp failed while sampling a grammar request (it threw a C++ exception, caught in
    llamabatch's C++ helper); the engine ends that request with ``finish_reason="error"``."""


class NoTokenAllowed(SamplingError, GrammarDeadEnd):
    """A grammar request reached a state where its grammar (with the other constraints:
    ``min_tokens``, ``logit_bias`` bans, the vocabulary) admits no token. llama.cpp would throw
    a C++ exception out of sampling and end the process; the engine ends the request instead."""


class GrammarTooAmbiguous(SamplingError, GrammarDeadEnd):
    """A grammar request's parse stacks grew past ``GrammarLimits.max_live_stacks``."""


#: the grammar digests' key: a process's own, so that no text can be made to collide offline
_GRAMMAR_ID_KEY = os.urandom(16)


@dataclass(frozen=True)
class GrammarMaskStats:
    """What a :class:`GrammarMasks` did and holds: masks found (``hits``), masks made by a pass
    of the grammar over the whole vocabulary (``passes``), and the masks and bytes it holds."""

    hits: int
    passes: int
    entries: int
    bytes: int


class GrammarMasks:
    """Grammar masks kept between requests, one model's (its vocabulary's): which tokens a
    grammar allows depends on the grammar's state only, so a state met before (the structure of
    a schema that many requests share) costs a lookup instead of a pass over the vocabulary.
    Only passes over the whole vocabulary are kept, in at most ``max_bytes``, the least
    recently used dropped first. Thread-safe (C++, ``_build.py``); used where llama.cpp is the
    pinned version, whose grammar layout it reads."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"GrammarMasks: max_bytes must be a positive int, got {max_bytes!r}")
        ptr = lib.llamabatch_mask_cache_new(max_bytes)
        if ptr == ffi.NULL:
            raise MemoryError("llamabatch_mask_cache_new returned NULL")
        self._ptr = ffi.gc(ptr, lib.llamabatch_mask_cache_free)
        self.max_bytes = max_bytes
        #: the model whose vocabulary the masks are of (the first chain's)
        self.model: Model | None = None

    def bind(self, model: Model) -> None:
        """Serve ``model``'s chains only: a mask is a bit per token of one vocabulary."""
        if self.model is None:
            self.model = model
        elif self.model is not model:
            raise ValueError(f"GrammarMasks hold masks of {self.model.path.name}, not of {model.path.name}")

    def stats(self) -> GrammarMaskStats:
        """A snapshot of the counters."""
        out = ffi.new("uint64_t[4]")
        lib.llamabatch_mask_cache_stats(self._ptr, out)
        return GrammarMaskStats(hits=out[0], passes=out[1], entries=out[2], bytes=out[3])


def grammar_id(text: str) -> bytes:
    """A grammar text's identity in :class:`GrammarMasks` (a keyed 16-byte digest)."""
    return hashlib.blake2b(text.encode(), digest_size=16, key=_GRAMMAR_ID_KEY).digest()


#: characters std::regex (ECMAScript) gives a meaning; escaped in trigger words
_REGEX_SPECIAL = frozenset(".^$|()*+?[]{}\\")


def trigger_pattern(word: str) -> str:
    """The std::regex of a lazy-grammar trigger word: the word literally, anywhere; a leading
    ``^`` anchors it at the start of the output (after whitespace). The grammar applies from
    the word on (the first capture group). Only escaped literals reach ``std::regex``: an
    invalid pattern would throw a C++ exception through the C API.

    The word must end the text so far (``$``): llama.cpp replays the triggering token into
    the grammar, and a token running past the word with text the grammar rejects throws a
    C++ exception (an abort). So the grammar wakes only when a token ends with the word."""
    anchored = word.startswith("^")
    literal = "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in word.removeprefix("^"))
    return f"^\\s*({literal})$" if anchored else f"({literal})$"


def _grammar_sampler(model: Model, params: SamplingParams):
    text = params.effective_grammar
    assert text is not None  # only called for a grammar
    grammar = text.encode()
    if not params.grammar_triggers:
        return lib.llama_sampler_init_grammar(model.vocab, grammar, b"root")
    patterns = [ffi.new("char[]", trigger_pattern(w).encode()) for w in params.grammar_triggers]
    array = ffi.new("const char *[]", patterns)
    return lib.llama_sampler_init_grammar_lazy_patterns(
        model.vocab, grammar, b"root", array, len(patterns), ffi.NULL, 0
    )


def penalty_window(penalty_last_n: int, n_ctx: int | None) -> int:
    """The penalty window llama.cpp gets: ``-1`` is the whole context (llama.cpp itself reads
    -1 as 0, i.e. off), and no window is longer than the context."""
    limit = n_ctx if n_ctx is not None and n_ctx > 0 else _DEFAULT_PENALTY_CTX
    return limit if penalty_last_n < 0 else min(penalty_last_n, limit)


#: DRY samplers made, kept to be cloned: making one reads every sequence breaker against the
#: whole vocabulary (16 breakers of 40 characters: 0.2 s on a 49,152-token vocabulary), a
#: clone copies what that found
DRY_TEMPLATES_MAX = 32
_dry_templates: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_dry_lock = threading.Lock()


def _dry_sampler(model: Model, params: SamplingParams, n_ctx: int | None):
    """DRY over the window ``penalty_window`` makes of ``dry_penalty_last_n``: a clone of the
    one made last for the same model and values (the request's submit made it, in the caller's
    thread, when it checked the chain), else made here."""
    window = penalty_window(params.dry_penalty_last_n, n_ctx)
    values = (params.dry_multiplier, params.dry_base, params.dry_allowed_length, window)
    key: tuple[Any, ...] = (str(model.path), model.n_vocab, *values, *params.dry_sequence_breakers)
    with _dry_lock:
        template = _dry_templates.get(key)
        if template is not None:
            _dry_templates.move_to_end(key)
            return lib.llama_sampler_clone(template)
    breakers = [ffi.new("char[]", text.encode()) for text in params.dry_sequence_breakers]
    array = ffi.new("const char *[]", breakers) if breakers else ffi.NULL
    made = lib.llama_sampler_init_dry(
        model.vocab,
        params.dry_multiplier,
        params.dry_base,
        params.dry_allowed_length,
        window,
        array,
        len(breakers),
    )
    if made == ffi.NULL:
        return made
    with _dry_lock:
        if key not in _dry_templates:
            _dry_templates[key] = ffi.gc(made, lib.llama_sampler_free)
            while len(_dry_templates) > DRY_TEMPLATES_MAX:
                _dry_templates.popitem(last=False)
            return lib.llama_sampler_clone(made)
    return made


def _allowed_tokens_sampler(allowed: Sequence[int], n_vocab: int):
    """llama.cpp's logit-bias sampler banning every token but ``allowed`` (built with numpy:
    a list of 49,152 pairs took 27 ms, this 0.5)."""
    if max(allowed) >= n_vocab:
        raise ValueError(f"SamplingParams.allowed_token_ids: token id {max(allowed)} >= n_vocab {n_vocab}")
    banned = np.ones(n_vocab, dtype=bool)
    banned[list(allowed)] = False
    pairs = np.zeros(int(banned.sum()), dtype=[("token", "<i4"), ("bias", "<f4")])
    pairs["token"] = np.flatnonzero(banned)
    pairs["bias"] = -np.inf
    array = ffi.cast("llama_logit_bias *", ffi.from_buffer(pairs))  # llama.cpp copies it
    return lib.llama_sampler_init_logit_bias(n_vocab, len(pairs), array)


#: the stages that are one llama.cpp sampler made from the params alone (and the seed)
_STAGE_SAMPLERS: dict[str, Callable[[SamplingParams, int], Any]] = {
    "greedy": lambda p, seed: lib.llama_sampler_init_greedy(),
    "top_k": lambda p, seed: lib.llama_sampler_init_top_k(p.top_k),
    "typical": lambda p, seed: lib.llama_sampler_init_typical(p.typical_p, 1),
    "top_p": lambda p, seed: lib.llama_sampler_init_top_p(p.top_p, 1),
    "min_p": lambda p, seed: lib.llama_sampler_init_min_p(p.min_p, 1),
    "top_n_sigma": lambda p, seed: lib.llama_sampler_init_top_n_sigma(p.top_n_sigma),
    "xtc": lambda p, seed: lib.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, seed),
    "temperature": lambda p, seed: lib.llama_sampler_init_temp(p.temperature),
    "dist": lambda p, seed: lib.llama_sampler_init_dist(seed),
}
#: mirostat 1.0's ``m``: the tokens its estimate of the distribution's shape reads (llama.cpp's)
MIROSTAT_M = 100
#: the stages :class:`SamplerChain` builds (the others are ``ENGINE_STAGES``)
CHAIN_STAGES = frozenset(
    {"allowed_tokens", "logit_bias", "penalties", "dry", "grammar", "mirostat", *_STAGE_SAMPLERS}
)


class SamplerChain:
    """One request's sampler chain; it keeps its own state (penalty window, grammar, RNG).

    The order follows llama.cpp's usual chain: logit bias, penalties, DRY, grammar, then either
    greedy, or top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature and a seeded draw
    (with mirostat: temperature, then mirostat's own draw).
    """

    def __init__(
        self,
        model: Model,
        params: SamplingParams,
        *,
        n_ctx: int | None = None,
        max_live_stacks: int = 0,
        top_k_first: bool = True,
        masks: GrammarMasks | None = None,
        history: Sequence[int] = (),
    ) -> None:
        """``history``: the tokens before the first one sampled (the prompt; negative ids, an
        image's positions, are skipped): as llama-server does, the penalties and DRY see the
        last of them their windows hold, the grammar none.
        ``n_ctx``: the request's context size, which bounds the penalty window
        (``penalty_last_n=-1`` means all of it); without it, llama.cpp's default 4096.
        ``max_live_stacks``: a grammar request's cap on its parse stacks, checked after every
        token (``GrammarLimits.max_live_stacks``; the engine passes the process-wide one); 0: none.
        ``top_k_first``: a grammar request with ``top_k`` has its grammar check the best
        candidates until ``top_k`` pass, not the whole vocabulary: the same token as the
        whole pass, for the same seed (``False``: the whole pass, which tests compare with).
        ``masks``: where a grammar request's passes over the whole vocabulary are kept and
        found again (None: none kept)."""
        self._ptr = ffi.NULL
        self._error = None  # a message buffer: grammar requests sample guarded (see ``sample``)
        self._max_stacks = 0
        self._masks: GrammarMasks | None = None
        self._mask_args: tuple[Any, bytes, int] = (ffi.NULL, b"", 0)  # the cache, the grammar's id
        self._forced: tuple[Any, Any] | None = None  # forced_text's buffers (text, ends)
        stages = params.active_stages
        self._top_k = params.top_k if top_k_first and "top_k" in stages else 0
        chain_params = lib.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        chain = lib.llama_sampler_chain_init(chain_params)
        if chain == ffi.NULL:
            raise MemoryError("llama_sampler_chain_init returned NULL")
        # Own the chain first so a failure below frees what was added.
        self._ptr = ffi.gc(chain, lib.llama_sampler_free)
        self.seed = params.seed if params.seed is not None else random.getrandbits(32)
        n_vocab = model.n_vocab
        windows: dict[int, int] = {}  # the chain's samplers that see the history: their windows
        for stage in stages:  # in the chain's order (param_spec.STAGES)
            if stage == "allowed_tokens":  # every other token banned, by llama.cpp's logit bias
                self._add(_allowed_tokens_sampler(params.allowed_token_ids or (), n_vocab))
            elif stage == "logit_bias":
                for token in params.logit_bias:
                    if token >= n_vocab:
                        raise ValueError(f"SamplingParams.logit_bias: token id {token} >= n_vocab {n_vocab}")
                biases = ffi.new("llama_logit_bias[]", [(t, b) for t, b in params.logit_bias.items()])
                self._add(lib.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
            elif stage == "penalties":
                window = penalty_window(params.penalty_last_n, n_ctx)
                self._add(
                    lib.llama_sampler_init_penalties(
                        n_vocab,
                        window,
                        params.repeat_penalty,
                        params.frequency_penalty,
                        params.presence_penalty,
                    )
                )
                windows[lib.llama_sampler_chain_n(chain) - 1] = window
            elif stage == "grammar":  # grammar, or json_schema / response_format's
                grammar = _grammar_sampler(model, params)
                if grammar == ffi.NULL:
                    raise ValueError("SamplingParams.grammar: llama.cpp could not parse the GBNF grammar")
                self._add(grammar)
                self._error = ffi.new("char[]", _ERROR_SIZE)
                # Counting and masks read llama.cpp internals laid out as in the pinned version only.
                self._max_stacks = max_live_stacks if BUILD.origin == "pinned" else 0
                if masks is not None and BUILD.origin == "pinned":
                    masks.bind(model)
                    self._masks = masks  # kept alive with the chain
                    key = grammar_id(params.effective_grammar or "")
                    self._mask_args = (masks._ptr, key, len(key))
            elif stage == "dry":
                self._add(_dry_sampler(model, params, n_ctx))
                windows[lib.llama_sampler_chain_n(chain) - 1] = penalty_window(
                    params.dry_penalty_last_n, n_ctx
                )
            elif stage == "mirostat":  # the draw, after the temperature
                tau, eta = params.mirostat_tau, params.mirostat_eta
                if params.mirostat == 1:
                    self._add(lib.llama_sampler_init_mirostat(n_vocab, self.seed, tau, eta, MIROSTAT_M))
                else:
                    self._add(lib.llama_sampler_init_mirostat_v2(self.seed, tau, eta))
            elif stage in _STAGE_SAMPLERS:
                self._add(_STAGE_SAMPLERS[stage](params, self.seed))
            elif stage not in ENGINE_STAGES:  # declared in param_spec, built nowhere
                raise NotImplementedError(f"no sampler builds the stage {stage!r}")
        if windows and history:
            text = [t for t in history if t >= 0]
            for index, window in windows.items():
                sampler = lib.llama_sampler_chain_get(chain, index)
                for token in text[-window:] if window > 0 else ():
                    lib.llama_sampler_accept(sampler, token)

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
        chosen token is accepted into the chain's state.

        A grammar request samples through llamabatch's guarded C++ helper: the chosen token is
        accepted only if the chain allowed it (``NoTokenAllowed`` when the grammar left no
        token), and a C++ exception from llama.cpp becomes ``SamplingError``; either would
        otherwise end the process."""
        error = self._error
        if error is None:
            return _sample(self._ptr, context._ptr, idx)
        token = _sample_guarded(
            self._ptr, context._ptr, idx, self._max_stacks, self._top_k, *self._mask_args, error, _ERROR_SIZE
        )
        if token >= 0:
            return token
        if token == -1:
            raise NoTokenAllowed(
                "the grammar admits no token here (with this vocabulary, min_tokens, stop tokens and "
                "logit_bias): generation cannot go on"
            )
        message = ffi.string(error).decode(errors="replace")
        if token == -3:
            raise GrammarTooAmbiguous(
                f"the grammar is too ambiguous: {message} after this token, above the limit of "
                f"{self._max_stacks} (GrammarLimits.max_live_stacks)"
            )
        raise SamplingError(f"llama.cpp failed while sampling: {message}")

    def forced_text(self, max_bytes: int = 256) -> tuple[bytes, bool]:
        """The text the chain's grammar forces next, up to ``max_bytes`` UTF-8 bytes: the
        characters that every way on through the grammar takes, one after another, while each
        is the only one allowed (a JSON schema's key after its opening quote, say); and whether
        the grammar can only end after it. ``(b"", False)`` without a grammar, where the next
        character is free, or while a lazy grammar waits for its trigger. The chain's state
        is unchanged. Reads llama.cpp's grammar internals: the pinned version only."""
        if self._error is None or BUILD.origin != "pinned" or max_bytes < 1:
            return b"", False
        if self._forced is None or len(self._forced[0]) < max_bytes:  # (once per chain: per tick)
            self._forced = (ffi.new("char[]", max_bytes), ffi.new("int32_t *"))
        out, ends = self._forced
        n = lib.llamabatch_grammar_forced(self.ptr, out, max_bytes, ends, self._error, _ERROR_SIZE)
        if n < 0:
            message = ffi.string(self._error).decode(errors="replace")
            raise SamplingError(f"llama.cpp failed while reading the grammar's forced text: {message}")
        return ffi.unpack(out, n), bool(ends[0])

    @property
    def closed(self) -> bool:
        """Whether the chain was freed (``close``)."""
        return self._ptr == ffi.NULL

    def close(self) -> None:
        """Free the chain (its grammar with it) now; idempotent."""
        if self._ptr != ffi.NULL:
            ffi.release(self._ptr)
            self._ptr = ffi.NULL
