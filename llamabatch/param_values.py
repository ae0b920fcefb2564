"""The value checks of ``SamplingParams``' fields (``params.py``), and the shape of a request's
LoRA adapters (``LoRARequest``, ``lora_set``): a bad value raises ``ValueError`` naming the
field as ``SamplingParams.<name>``. A leaf module beside ``validate.py``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

from llamabatch.validate import INT32_MAX, as_float, as_int, check_bool, check_text

#: The largest finite C ``float``; larger Python floats become infinity in C.
FLOAT32_MAX = 3.4028234663852886e38
#: Largest |logit bias|: added to logits and scaled by penalties, it must stay finite in
#: float32 (infinities make the sampler's softmax NaN). ``-inf`` bans a token.
LOGIT_BIAS_MAX = 1e30
#: ``logit_bias`` entries (more than any vocabulary has tokens)
LOGIT_BIAS_ENTRIES_MAX = 1 << 18


#: LoRA adapters in one request's set, and the length of an adapter's name
LORA_SET_MAX, LORA_NAME_MAX = 16, 256


# Iterables that are not sequences of items here (bytes iterate as ints).
NOT_SEQUENCES = (bytes, bytearray, memoryview, Mapping)


def check_field(condition: bool, name: str, message: str, value: object) -> None:
    if not condition:
        raise ValueError(f"SamplingParams.{name} {message}, got {value!r}")


def int_field(name: str, value: object, lo: int, hi: int, hint: str = "") -> int:
    number = as_int(value)
    check_field(
        number is not None and lo <= number <= hi, name, f"must be an int in [{lo}, {hi}]{hint}", value
    )
    return number  # type: ignore[return-value]


def float_field(
    name: str, value: object, lo: float, hi: float, *, open_lo: bool = False, hint: str = ""
) -> float:
    number = as_float(value)
    above = number is not None and (lo < number if open_lo else lo <= number)
    ok = above and math.isfinite(number) and number <= hi  # type: ignore[arg-type,operator]
    interval = f"{'(' if open_lo else '['}{lo:g}, {hi:g}]"
    check_field(ok, name, f"must be a finite number in {interval}{hint}", value)
    return number  # type: ignore[return-value]


def bool_field(name: str, value: object) -> bool:
    return check_bool(f"SamplingParams.{name}", value)


def strings_field(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    check_field(
        isinstance(value, Iterable) and not isinstance(value, NOT_SEQUENCES),
        name,
        "must be a str or a sequence of str",
        value,
    )
    out: list[str] = []
    for i, s in enumerate(cast("Iterable[object]", value)):
        check_field(isinstance(s, str) and s != "", name, f"items must be non-empty strings (item {i})", s)
        out.append(check_text(f"SamplingParams.{name}[{i}]", s))
    return tuple(out)


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for one request, in vLLM's shape: its name (as loaded with
    ``LLM(lora_adapters={name: path})`` or ``LLM.load_lora``), an id (kept for vLLM
    compatibility; the name decides), the file (loaded on first use when the name is not
    loaded yet) and a scale (1.0: as trained)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    scale: float = 1.0


def _lora_name(value: object) -> str:
    check_field(
        isinstance(value, str) and 0 < len(value) <= LORA_NAME_MAX,
        "lora",
        f"names must be non-empty strings of at most {LORA_NAME_MAX} characters",
        value,
    )
    return check_text("SamplingParams.lora", cast(str, value))


def lora_set(value: object) -> tuple[tuple[str, float], ...]:
    """``SamplingParams.lora`` normalised: ``((name, scale), ...)`` sorted by name, scales
    finite, zero scales left out, a name at most once."""
    if value is None or value == "":
        return ()
    items: list[object] = list(value.items()) if isinstance(value, Mapping) else [value]
    if isinstance(value, (list, tuple)) and not (
        len(value) == 2 and isinstance(value[0], str) and not isinstance(value[1], str)
    ):
        items = list(value)
    pairs: dict[str, float] = {}
    for item in items:
        if isinstance(item, LoRARequest):
            name, scale = item.lora_name, item.scale
        elif isinstance(item, str):
            name, scale = item, 1.0
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            name, scale = item[0], item[1]
        else:
            check_field(False, "lora", "items must be a name, a LoRARequest or a (name, scale) pair", item)
        name = _lora_name(name)
        number = float_field("lora", scale, -FLOAT32_MAX, FLOAT32_MAX, hint=" (an adapter's scale)")
        check_field(name not in pairs, "lora", "names an adapter twice", name)
        pairs[name] = number
    check_field(len(pairs) <= LORA_SET_MAX, "lora", f"takes at most {LORA_SET_MAX} adapters", len(pairs))
    return tuple(sorted((n, s) for n, s in pairs.items() if s != 0.0))


def lora_paths(value: object) -> dict[str, str]:
    """The files of the ``LoRARequest`` items of a ``lora`` value that name one."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return {
        item.lora_name: item.lora_path for item in items if isinstance(item, LoRARequest) and item.lora_path
    }


def token_ids(name: str, value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    check_field(
        isinstance(value, Iterable) and not isinstance(value, (str, *NOT_SEQUENCES)),
        name,
        "must be a sequence of token ids (ints)",
        value,
    )
    out: list[int] = []
    for i, token in enumerate(cast("Iterable[object]", value)):
        number = as_int(token)
        check_field(
            number is not None and 0 <= number <= INT32_MAX,
            name,
            f"items must be token ids, ints in [0, {INT32_MAX}] (item {i})",
            token,
        )
        out.append(cast(int, number))
    return tuple(out)


def logit_bias_map(value: object) -> dict[int, float]:
    if value is None:
        return {}
    check_field(isinstance(value, Mapping), "logit_bias", "must be a mapping {token id: bias}", value)
    check_field(
        len(value) <= LOGIT_BIAS_ENTRIES_MAX,  # type: ignore[arg-type]
        "logit_bias",
        f"takes at most {LOGIT_BIAS_ENTRIES_MAX} entries",
        len(value),  # type: ignore[arg-type]
    )
    out: dict[int, float] = {}
    for token, bias in cast("Mapping[object, object]", value).items():
        number = as_int(token)
        check_field(
            number is not None and 0 <= number <= INT32_MAX,
            "logit_bias",
            f"keys must be token ids, ints in [0, {INT32_MAX}]",
            token,
        )
        b = as_float(bias)
        check_field(
            b is not None and (b == -math.inf or (math.isfinite(b) and abs(b) <= LOGIT_BIAS_MAX)),
            "logit_bias",
            f"values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}] or -inf (a ban)",
            bias,
        )
        out[cast(int, number)] = cast(float, b)
    return out
