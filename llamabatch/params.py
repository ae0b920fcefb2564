"""``SamplingParams``: how one request samples and when it stops. Validated on creation.

Every field is checked when the object is made, so a bad value fails at the caller's line
with a ``ValueError`` naming the field, never later inside cffi or llama.cpp: ints must fit
the C type they are passed as, floats must be finite (where infinity means nothing), and
strings must be valid Unicode without NUL characters (llama.cpp reads C strings). Numpy
scalars are accepted and stored as Python ``int``/``float``.

The generic validators (``check_positive_int``, ``check_bool``, ``check_text``) live in the leaf
module ``validate.py`` (the binding uses them too) and are re-exported here; the field checks
and the shape of a request's LoRA adapters live in ``param_values.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from llamabatch import param_spec
from llamabatch.param_spec import Flag, Range, Request, param
from llamabatch.param_values import (
    FLOAT32_MAX,
    LOGIT_BIAS_ENTRIES_MAX,
    LoRARequest,
    logit_bias_map,
    lora_paths,
    lora_set,
    token_ids,
)
from llamabatch.param_values import bool_field as _bool_field
from llamabatch.param_values import check_field as _check
from llamabatch.param_values import float_field as _float_field
from llamabatch.param_values import int_field as _int_field
from llamabatch.param_values import strings_field as _strings
from llamabatch.validate import (
    INT32_MAX,
    as_float,
    as_int,
    check_bool,
    check_positive_int,
    check_text,
    positive_int,
)

#: Temperatures below this decode greedily (vLLM's rule): logits divided by a smaller one
#: overflow float32, and the softmax of infinities is NaN.
GREEDY_TEMPERATURE = 1e-5
#: llama.cpp reads seed 0xFFFFFFFF as "pick a random seed", so it is not a reproducible seed.
SEED_LIMIT = 2**32 - 1
#: Caps on what sizes an allocation (llama.cpp zero-fills a ``penalty_last_n``-entry ring
#: buffer per completion; the window is further clamped to the request's context).
PENALTY_LAST_N_MAX = 1 << 20
#: completions of one prompt (OpenAI's and the server's cap)
N_MAX = 128
#: stop strings per request, and the length of each (characters)
STOP_MAX, STOP_LEN_MAX = 64, 1024
#: DRY's default sequence breakers (llama.cpp's), how many a request may give (each one costs
#: a pass over the vocabulary when its sampler is made), and their length (llama.cpp's cut)
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")
DRY_BREAKERS_MAX, DRY_BREAKER_LEN_MAX = 16, 40
#: ``stop_token_ids`` entries
STOP_TOKEN_IDS_MAX = 1024


def _bounded_strings(
    name: str, value: object, max_items: int, max_len: int, hint: str = ""
) -> tuple[str, ...]:
    """``value`` as non-empty strings (``_strings``), at most ``max_items`` of at most ``max_len``
    characters each."""
    texts = _strings(name, value)
    _check(len(texts) <= max_items, name, f"takes at most {max_items} strings", len(texts))
    for i, text in enumerate(texts):
        _check(len(text) <= max_len, f"{name}[{i}]", f"must be at most {max_len} characters{hint}", len(text))
    return texts


#: lazy-grammar trigger words: at most this many, each at most this long (tool calls)
MAX_TRIGGERS, MAX_TRIGGER_LEN = 16, 256


def _grammar_triggers(value: object) -> tuple[str, ...]:
    words = _strings("grammar_triggers", value)
    _check(len(words) <= MAX_TRIGGERS, "grammar_triggers", f"takes at most {MAX_TRIGGERS} words", value)
    for word in words:
        _check(
            0 < len(word.removeprefix("^")) <= MAX_TRIGGER_LEN,
            "grammar_triggers",
            f"words must be 1 to {MAX_TRIGGER_LEN} characters (besides a leading ^)",
            word,
        )
    return words


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one generation request.

    ``temperature=0`` (or any below 1e-5) is greedy decoding. Penalties follow llama.cpp: ``repeat_penalty``
    (1.0 = off) divides the logits of recent tokens, ``frequency_penalty`` and
    ``presence_penalty`` (0.0 = off) subtract; ``penalty_last_n`` is the window of recent
    tokens they look at (-1: the whole context). ``stop`` strings end the generation; they
    are not part of the output, and text that could begin a stop string is held back
    until it is resolved. ``stop_token_ids`` end the generation when one of them is sampled
    (like end-of-generation tokens, the token is not part of the text). ``min_tokens``
    suppresses end-of-generation tokens and ``stop_token_ids`` until that many tokens have
    been generated. ``logprobs=N`` reports, per generated token, the log-probability
    of the sampled token and of the N most likely ones under the model's raw
    distribution; ``prompt_logprobs=N`` does the same for each prompt token (the first has
    none), computing the whole prompt again. ``grammar`` is a GBNF grammar (root rule
    ``root``). ``json_schema`` (a
    dict or JSON string) constrains the output to JSON values the schema accepts, and
    ``response_format`` takes OpenAI's ``{"type": "json_object"}``, ``{"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` or ``{"type": "text"}``;
    both become a grammar (``effective_grammar``), so at most one of ``grammar``,
    ``json_schema`` and ``response_format`` may be given. ``n`` asks for that
    many completions of the prompt (the prompt is computed once). ``truncate=True`` keeps
    the last tokens of a prompt that is too long instead of raising ``PromptTooLong``.

    Every field is validated here: a bad value raises ``ValueError`` naming the field.
    ``SamplingParams.coerce`` turns a mapping of fields (or None) into an instance.
    """

    max_tokens: int = param(
        16,
        range=Range(int, 1, INT32_MAX),
        request=Request(("max_tokens", "max_completion_tokens"), "int", custom=True),
        flag=Flag(("-n", "--max-tokens"), {"type": positive_int, "help": "the most tokens to generate"}),
        stage=None,
    )
    temperature: float = param(
        0.8,
        range=Range(float, 0.0, FLOAT32_MAX, hint=" (0 = greedy)"),
        request=Request(("temperature",), "number"),
        flag=Flag(("--temperature",), {"help": "0: greedy"}),
        stage="temperature",
        on=lambda p: True,
    )
    top_k: int = param(
        40,
        range=Range(int, 0, INT32_MAX, hint=" (0 = off)"),
        request=Request(("top_k",), "int", custom=True),
        flag=Flag(("--top-k",), {"help": "0: off"}),
        stage="top_k",
        on=lambda p: p.top_k > 0,
    )
    top_p: float = param(
        0.95,
        range=Range(float, 0.0, 1.0, open_lo=True),
        request=Request(("top_p",), "number"),
        flag=Flag(("--top-p",), {"help": "1: off"}),
        stage="top_p",
        on=lambda p: p.top_p < 1.0,
    )
    min_p: float = param(
        0.05,
        range=Range(float, 0.0, 1.0),
        request=Request(("min_p",), "number"),
        flag=Flag(("--min-p",), {"help": "0: off"}),
        stage="min_p",
        on=lambda p: p.min_p > 0.0,
    )
    typical_p: float = param(
        1.0,
        range=Range(float, 0.0, 1.0, open_lo=True),
        request=Request(("typical_p",), "number"),
        flag=Flag(("--typical-p", "--typical"), {"help": "1: off"}),
        stage="typical",
        on=lambda p: p.typical_p < 1.0,
    )
    repeat_penalty: float = param(
        1.0,
        range=Range(float, 0.0, FLOAT32_MAX, open_lo=True, hint=" (1 = off)"),
        request=Request(("repetition_penalty", "repeat_penalty"), "number"),
        flag=Flag(("--repeat-penalty",), {"help": "1: off"}),
        stage="penalties",
        on=lambda p: p.repeat_penalty != 1.0,
    )
    frequency_penalty: float = param(
        0.0,
        range=Range(float, -2.0, 2.0),
        request=Request(("frequency_penalty",), "number"),
        flag=Flag(("--frequency-penalty",), {"help": "0: off"}),
        stage="penalties",
        on=lambda p: p.frequency_penalty != 0.0,
    )
    presence_penalty: float = param(
        0.0,
        range=Range(float, -2.0, 2.0),
        request=Request(("presence_penalty",), "number"),
        flag=Flag(("--presence-penalty",), {"help": "0: off"}),
        stage="penalties",
        on=lambda p: p.presence_penalty != 0.0,
    )
    penalty_last_n: int = param(
        64,
        range=Range(
            int,
            -1,
            PENALTY_LAST_N_MAX,
            hint=" (-1 = whole context; the window is also clamped to the context)",
        ),
        request=Request(("repeat_last_n", "penalty_last_n"), "int"),
        flag=Flag(("--repeat-last-n",), {"help": "the penalties' window of recent tokens (-1: the context)"}),
        stage=None,
    )
    # -- llama-server's other samplers ----------------------------------------------------
    #: DRY ("don't repeat yourself"): a token that would extend a repeat of earlier text longer
    #: than ``dry_allowed_length`` tokens loses ``dry_multiplier * dry_base ** (length -
    #: dry_allowed_length)`` of its logit; a repeat does not run across a sequence breaker
    dry_multiplier: float = param(
        0.0,
        range=Range(float, 0.0, FLOAT32_MAX, hint=" (0 = off)"),
        request=Request(("dry_multiplier",), "number"),
        flag=Flag(("--dry-multiplier",), {"help": "DRY's strength (0: off)"}),
        stage="dry",
        on=lambda p: p.dry_multiplier > 0.0 and p.dry_penalty_last_n != 0,
    )
    dry_base: float = param(
        1.75,
        range=Range(float, 1.0, FLOAT32_MAX),
        request=Request(("dry_base",), "number"),
        flag=Flag(("--dry-base",), {"help": "DRY's growth per repeated token"}),
        stage=None,
    )
    dry_allowed_length: int = param(
        2,
        range=Range(int, 0, PENALTY_LAST_N_MAX),
        request=Request(("dry_allowed_length",), "int"),
        flag=Flag(("--dry-allowed-length",), {"help": "repeats this long go unpenalised"}),
        stage=None,
    )
    dry_penalty_last_n: int = param(
        -1,
        range=Range(int, -1, PENALTY_LAST_N_MAX, hint=" (-1 = whole context, 0 = off)"),
        request=Request(("dry_penalty_last_n",), "int"),
        flag=Flag(("--dry-penalty-last-n",), {"help": "DRY's window of recent tokens (-1: the context)"}),
        stage=None,
    )
    dry_sequence_breakers: Sequence[str] = param(
        DRY_SEQUENCE_BREAKERS,
        request=Request(("dry_sequence_breakers",), "list"),
        flag=Flag(
            ("--dry-sequence-breaker",), {"action": "append", "help": "a DRY sequence breaker (repeatable)"}
        ),
        stage=None,
    )
    #: XTC ("exclude top choices"): with probability ``xtc_probability``, every token at least
    #: ``xtc_threshold`` likely but the least likely of them is removed (off above 0.5)
    xtc_probability: float = param(
        0.0,
        range=Range(float, 0.0, 1.0, hint=" (0 = off)"),
        request=Request(("xtc_probability",), "number"),
        flag=Flag(("--xtc-probability",), {"help": "0: off"}),
        stage="xtc",
        on=lambda p: p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5,
    )
    xtc_threshold: float = param(
        0.1,
        range=Range(float, 0.0, 1.0, hint=" (above 0.5: off)"),
        request=Request(("xtc_threshold",), "number"),
        flag=Flag(("--xtc-threshold",), {"help": "above 0.5: off"}),
        stage=None,
    )
    #: top-n-sigma: keeps the tokens whose logit is within ``top_n_sigma`` standard deviations
    #: of the largest (<= 0: off)
    top_n_sigma: float = param(
        -1.0,
        range=Range(float, -1.0, FLOAT32_MAX, hint=" (<= 0 = off)"),
        request=Request(("top_n_sigma",), "number"),
        flag=Flag(("--top-n-sigma", "--top-nsigma"), {"help": "<= 0: off"}),
        stage="top_n_sigma",
        on=lambda p: p.top_n_sigma > 0.0,
    )
    #: mirostat 1 or 2 (0: off) draws aiming at ``mirostat_tau`` bits of surprise per token,
    #: learning at ``mirostat_eta``; it replaces top-k, top-p, min-p, typical, XTC and the draw
    mirostat: int = param(
        0,
        range=Range(int, 0, 2, hint=" (0 = off, 1 or 2: the version)"),
        request=Request(("mirostat",), "int"),
        flag=Flag(("--mirostat",), {"help": "0: off, 1 or 2: mirostat's version"}),
        stage="mirostat",
        on=lambda p: p.mirostat > 0,
    )
    mirostat_tau: float = param(
        5.0,
        range=Range(float, 0.0, FLOAT32_MAX),
        request=Request(("mirostat_tau",), "number"),
        flag=Flag(("--mirostat-ent",), {"help": "mirostat's target surprise (tau)"}),
        stage=None,
    )
    mirostat_eta: float = param(
        0.1,
        range=Range(float, 0.0, 1.0),
        request=Request(("mirostat_eta",), "number"),
        flag=Flag(("--mirostat-lr",), {"help": "mirostat's learning rate (eta)"}),
        stage=None,
    )
    seed: int | None = param(
        None,
        range=Range(int, 0, SEED_LIMIT - 1, hint=" or None (2**32-1 means random)", optional=True),
        request=Request(("seed",), "int", custom=True),
        flag=Flag(("--seed",), {"help": "the draw's seed (default: random)"}),
        stage=None,
    )
    stop: Sequence[str] = param(
        (),
        request=Request(("stop",), "list", custom=True),
        flag=Flag(("--stop",), {"action": "append", "help": "a stop string (repeatable)"}),
        stage=None,
    )
    stop_token_ids: Sequence[int] = param(
        (),
        request=Request(("stop_token_ids",), "list"),
        flag="token ids are a library and server option",
        stage=None,
    )
    min_tokens: int = param(
        0,
        range=Range(int, 0, INT32_MAX),
        request=Request(("min_tokens",), "int"),
        flag=Flag(("--min-tokens",), {"help": "no end of generation before this many tokens"}),
        stage="min_tokens",
        on=lambda p: p.min_tokens > 0,
    )
    #: the stop string that ended the output stays at its end (vLLM's field)
    include_stop_str_in_output: bool = param(
        False,
        request=Request(("include_stop_str_in_output",), "bool"),
        flag=Flag(("--include-stop-str",), {"action": "store_true", "help": "keep the matched stop string"}),
        stage=None,
    )
    ignore_eos: bool = param(
        False,
        request=Request(("ignore_eos",), "bool"),
        flag=Flag(("--ignore-eos",), {"action": "store_true", "help": "go on past end-of-generation tokens"}),
        stage=None,
    )
    #: vLLM's: only these tokens may be sampled (every other one is banned)
    allowed_token_ids: Sequence[int] | None = param(
        None,
        request=Request(("allowed_token_ids",), "list"),
        flag="token ids are a library and server option",
        stage="allowed_tokens",
        on=lambda p: p.allowed_token_ids is not None,
    )
    logit_bias: Mapping[int, float] = param(
        default_factory=dict,
        request=Request(("logit_bias",), "dict", custom=True),
        flag="token ids are a library and server option",
        stage="logit_bias",
        on=lambda p: bool(p.logit_bias),
    )
    grammar: str | None = param(
        None,
        request=Request(("grammar", "guided_grammar"), "str"),
        flag=Flag(("--grammar",), {"help": "a GBNF grammar (root rule: root)"}),
        stage="grammar",
        on=lambda p: p.effective_grammar is not None,
    )
    json_schema: Mapping[str, Any] | str | None = param(
        None,
        request=Request(("json_schema", "guided_json"), "dict"),
        flag=Flag(("--json-schema",), {"help": "a JSON schema the output follows"}),
        stage="grammar",
        on=lambda p: p.effective_grammar is not None,
    )
    response_format: Mapping[str, Any] | None = param(
        None,
        request=Request(("response_format",), "dict"),
        flag="--json-schema gives the command line's structured output",
        stage="grammar",
        on=lambda p: p.effective_grammar is not None,
    )
    #: vLLM's structured outputs besides JSON: the whole output matches this regular
    #: expression (``guided_regex``), or is one of these strings (``guided_choice``)
    regex: str | None = param(
        None,
        request=Request(("regex", "guided_regex"), "str"),
        flag=Flag(("--regex",), {"help": "a regular expression the whole output matches"}),
        stage="grammar",
        on=lambda p: p.effective_grammar is not None,
    )
    choice: Sequence[str] | None = param(
        None,
        request=Request(("choice", "guided_choice"), "list"),
        flag=Flag(("--choice",), {"action": "append", "help": "a string the output may be (repeatable)"}),
        stage="grammar",
        on=lambda p: p.effective_grammar is not None,
    )
    logprobs: int | None = param(
        None,
        range=Range(int, 0, 100, hint=" or None", optional=True),
        request=Request(("logprobs", "top_logprobs"), "int", custom=True),
        flag="the command line prints text, not log-probabilities",
        stage=None,
    )
    prompt_logprobs: int | None = param(
        None,
        range=Range(int, 0, 100, hint=" or None", optional=True),
        request=Request(("prompt_logprobs",), "int"),
        flag="the command line prints text, not log-probabilities",
        stage=None,
    )
    n: int = param(
        1,
        range=Range(int, 1, N_MAX),
        request=Request(("n",), "int", custom=True),
        flag="the command line makes one completion per prompt",
        stage=None,
    )
    truncate: bool = param(
        False,
        request="the server refuses a prompt too long for the context (400)",
        flag=Flag(
            ("--truncate",),
            {"action": "store_true", "help": "keep the end of a prompt too long for the context"},
        ),
        stage=None,
    )
    skip_special_tokens: bool = param(
        True,
        request=Request(("skip_special_tokens",), "bool"),
        flag="the command line prints text as the model's users see it",
        stage=None,
    )
    # -- tool calls (llamabatch.toolcalls): a lazy grammar --------------------------------
    #: with ``grammar`` (or a schema): the grammar stays off until one of these words appears
    #: in the output, then applies from that word on (llama.cpp's lazy grammar). A word
    #: starting with ``^`` only counts at the start of the output (after whitespace).
    grammar_triggers: Sequence[str] = param(
        (),
        request="set by the chat pipeline from tools and tool_choice",
        flag="set by the chat pipeline from tools and tool_choice",
        stage="grammar",
        on=lambda p: p.effective_grammar is not None,
    )
    #: with the engine's ``speculative_config``: whether this request speculates (False: opt out)
    speculative: bool = param(
        True,
        request=Request(("speculative",), "bool"),
        flag="speculation is the engine's --spec-type",
        stage=None,
    )
    #: the LoRA adapters this request runs with: a loaded adapter's name, a
    #: :class:`LoRARequest`, a mapping ``{name: scale}``, or a sequence of those; stored as
    #: ``((name, scale), ...)`` sorted by name, zero scales left out (``()``: the base model)
    lora: Any = param(  # noqa: RUF009 (param is this class's field(); Any hides it from ruff)
        (),
        request="the server's handlers pass the adapters a request names (server/lora.py)",
        flag="adapters are the engine's options",
        stage=None,
    )
    #: this request's service-level objectives in ms (None: the engine's ``slo_ttft_ms`` /
    #: ``slo_itl_ms``): its first token within ``slo_ttft_ms``, no gap over ``slo_itl_ms``
    slo_ttft_ms: float | None = param(
        None,
        range=Range(float, 0.0, FLOAT32_MAX, open_lo=True, hint=" or None", optional=True),
        request=Request(("slo_ttft_ms",), "number"),
        flag="the engine's --slo-ttft-ms",
        stage=None,
    )
    slo_itl_ms: float | None = param(
        None,
        range=Range(float, 0.0, FLOAT32_MAX, open_lo=True, hint=" or None", optional=True),
        request=Request(("slo_itl_ms",), "number"),
        flag="the engine's --slo-itl-ms",
        stage=None,
    )

    def __post_init__(self) -> None:
        put = self._put
        for name, limits in _RANGES.items():  # the declared ranges (param_spec.Range)
            value = getattr(self, name)
            if value is not None or not limits.optional:
                put(name, _in_range(name, value, limits))
        put("stop", _bounded_strings("stop", self.stop, STOP_MAX, STOP_LEN_MAX))
        breakers = _bounded_strings(
            "dry_sequence_breakers",
            self.dry_sequence_breakers,
            DRY_BREAKERS_MAX,
            DRY_BREAKER_LEN_MAX,
            " (llama.cpp's limit)",
        )
        put("dry_sequence_breakers", breakers)
        put("stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids))
        _check(
            len(self.stop_token_ids) <= STOP_TOKEN_IDS_MAX,
            "stop_token_ids",
            f"takes at most {STOP_TOKEN_IDS_MAX} ids",
            len(self.stop_token_ids),
        )
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        put("ignore_eos", _bool_field("ignore_eos", self.ignore_eos))
        put(
            "include_stop_str_in_output",
            _bool_field("include_stop_str_in_output", self.include_stop_str_in_output),
        )
        put("speculative", _bool_field("speculative", self.speculative))
        if self.allowed_token_ids is not None:
            allowed = token_ids("allowed_token_ids", self.allowed_token_ids)
            _check(
                0 < len(allowed) <= LOGIT_BIAS_ENTRIES_MAX,
                "allowed_token_ids",
                f"must hold 1 to {LOGIT_BIAS_ENTRIES_MAX} token ids",
                len(allowed),
            )
            put("allowed_token_ids", tuple(sorted(set(allowed))))
        put("logit_bias", logit_bias_map(self.logit_bias))
        if self.grammar is not None:
            _check(
                isinstance(self.grammar, str) and self.grammar.strip() != "",
                "grammar",
                "must be None or a non-empty GBNF string",
                self.grammar,
            )
            put("grammar", check_text("SamplingParams.grammar", self.grammar))
            from llamabatch.prompts.grammar_check import check_grammar

            check_grammar(self.grammar, what="SamplingParams.grammar")
        put("truncate", _bool_field("truncate", self.truncate))
        put("skip_special_tokens", _bool_field("skip_special_tokens", self.skip_special_tokens))
        put("grammar_triggers", _grammar_triggers(self.grammar_triggers))  # tool calls
        put("_lora_paths", lora_paths(self.lora))  # LoRARequest files, loaded on first use
        put("lora", lora_set(self.lora))
        if self.choice is not None:
            put("choice", _strings("choice", self.choice))
        if self.regex is not None:
            put("regex", check_text("SamplingParams.regex", self.regex))
        if any(v is not None for v in (self.json_schema, self.response_format, self.regex, self.choice)):
            from llamabatch.prompts.structured import resolve_grammar

            made = resolve_grammar(
                self.grammar, self.json_schema, self.response_format, regex=self.regex, choice=self.choice
            )
            put("_effective_grammar", made)
        else:
            put("_effective_grammar", self.grammar)
        if self.grammar_triggers and self.effective_grammar is None:  # tool calls
            _check(False, "grammar_triggers", "needs a grammar (or json_schema)", self.grammar_triggers)

    def _put(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # frozen: store the normalised value

    @property
    def greedy(self) -> bool:
        """Greedy decoding: ``temperature`` below ``GREEDY_TEMPERATURE`` (as vLLM does), since
        dividing logits by a tinier one overflows float32 and the draw becomes garbage."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def lora_files(self) -> dict[str, str]:
        """``{name: path}`` of the ``LoRARequest`` items that gave a file."""
        return dict(getattr(self, "_lora_paths", {}))

    @property
    def active_stages(self) -> tuple[str, ...]:
        """The sampler stages these params switch on, in the chain's order
        (``param_spec.active_stages``); ``("greedy",)`` alone is plain greedy decoding."""
        return param_spec.active_stages(self)

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser | Any, defaults: Mapping[str, Any] | None = None
    ) -> None:
        """The flags of the fields that have one (``llamabatch generate``); ``defaults``: the
        command's own defaults (a flag not given otherwise leaves the field's)."""
        param_spec.add_cli_args(cls, parser, defaults or {})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> SamplingParams:
        """The params of parsed flags (see :meth:`add_cli_args`); ``overrides`` win."""
        return cls(**{**param_spec.from_cli_args(cls, args), **overrides})

    @property
    def effective_grammar(self) -> str | None:
        """The GBNF grammar the sampler enforces: ``grammar``, or the one made from
        ``json_schema`` or ``response_format`` (None: unconstrained)."""
        return self._effective_grammar  # type: ignore[attr-defined]

    @classmethod
    def coerce(cls, obj: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        """``obj`` as a ``SamplingParams``: an instance as is, ``None`` as the defaults, a mapping
        of field names to values (``{"max_tokens": 4}``) converted.

        Raises ``TypeError`` for any other type or a mapping with unknown keys, and
        ``ValueError`` (naming the field) for a bad value.
        """
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        raise TypeError(
            "sampling params must be a SamplingParams, a dict of its fields, or None; "
            f"got {type(obj).__name__} {obj!r:.80}"
        )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> SamplingParams:
        """A ``SamplingParams`` from a mapping of field names to values; ``TypeError`` names
        unknown keys (with the valid ones)."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"SamplingParams.from_dict needs a mapping, got {type(mapping).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = [key for key in mapping if key not in names]
        if unknown:
            raise TypeError(
                f"unknown SamplingParams field(s) {', '.join(repr(k) for k in unknown)}; "
                f"the fields are: {', '.join(sorted(names))}"
            )
        return cls(**mapping)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``SamplingParams.from_dict`` reverses it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: the fields whose values are numbers in a declared range, checked in field order
_RANGES: dict[str, Range] = {
    name: spec.range for name, spec in param_spec.specs(SamplingParams).items() if spec.range is not None
}


def _in_range(name: str, value: object, limits: Range) -> float:
    if limits.kind is int:
        return _int_field(name, value, int(limits.lo), int(limits.hi), limits.hint)
    return _float_field(name, value, limits.lo, limits.hi, open_lo=limits.open_lo, hint=limits.hint)


__all__ = [
    "INT32_MAX",
    "LoRARequest",
    "SamplingParams",
    "as_float",
    "as_int",
    "check_bool",
    "check_positive_int",
    "check_text",
]
