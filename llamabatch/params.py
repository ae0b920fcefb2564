"""``SamplingParams``: how one request samples and when it stops. Validated on creation."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def _check(condition: bool, name: str, message: str, value: object) -> None:
    if not condition:
        raise ValueError(f"SamplingParams.{name} {message}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one generation request.

    ``temperature=0`` is greedy decoding. Penalties follow llama.cpp: ``repeat_penalty``
    (1.0 = off) divides the logits of recent tokens, ``frequency_penalty`` and
    ``presence_penalty`` (0.0 = off) subtract; ``penalty_last_n`` is the window of recent
    tokens they look at (-1: the whole context). ``stop`` strings end the generation; they
    are not part of the output, and text that could begin a stop string is held back
    until it is resolved. ``logprobs=N`` reports, per generated token, the log-probability
    of the sampled token and of the N most likely ones under the model's raw
    distribution. ``grammar`` is a GBNF grammar (root rule ``root``). ``n`` asks for that
    many completions of the prompt (the prompt is computed once). ``truncate=True`` keeps
    the last tokens of a prompt that is too long instead of raising ``PromptTooLong``.
    """

    max_tokens: int = 16
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str | None = None
    logprobs: int | None = None
    n: int = 1
    truncate: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "must be an int >= 1",
            self.max_tokens,
        )
        _check(
            _is_real(self.temperature) and self.temperature >= 0,
            "temperature",
            "must be >= 0",
            self.temperature,
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an int >= 0 (0 = off)", self.top_k)
        for name in ("top_p", "typical_p"):
            value = getattr(self, name)
            _check(_is_real(value) and 0 < value <= 1, name, "must be in (0, 1]", value)
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(
            _is_real(self.repeat_penalty) and self.repeat_penalty > 0,
            "repeat_penalty",
            "must be > 0 (1.0 = off)",
            self.repeat_penalty,
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, "must be in [-2, 2]", value)
        _check(
            _is_int(self.penalty_last_n) and self.penalty_last_n >= -1,
            "penalty_last_n",
            "must be an int >= -1",
            self.penalty_last_n,
        )
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**32),
            "seed",
            "must be None or an int in [0, 2**32)",
            self.seed,
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop
        )
        for token, bias in self.logit_bias.items():
            _check(_is_int(token) and token >= 0, "logit_bias", "keys must be token ids >= 0", token)
            _check(_is_real(bias) and not math.isnan(bias), "logit_bias", "values must be numbers", bias)
        _check(
            self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
            "grammar",
            "must be None or a non-empty GBNF string",
            self.grammar,
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 100),
            "logprobs",
            "must be None or an int in [0, 100]",
            self.logprobs,
        )
        _check(_is_int(self.n) and self.n >= 1, "n", "must be an int >= 1", self.n)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int > 0 (or None, if allowed)."""
    if value is None and allow_none:
        return
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
