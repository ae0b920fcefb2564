"""Generic validators of values handed to llama.cpp: a leaf module (it imports nothing from
llamabatch), so the binding (``_ffi``), ``params.py`` and the facades share one rule each.

``check_positive_int`` is the one integer validator of constructor parameters (``Context``,
``LLM``, ``Embedder``); ``check_text`` the one rule for text that becomes a C string.
"""

from __future__ import annotations

import argparse
import numbers
from typing import Literal, overload

import numpy as np

#: The largest value of a C ``int32_t`` (token ids, counts and sizes llama.cpp takes as int32).
INT32_MAX = 2**31 - 1


def as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (int or numpy integer, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def as_float(value: object) -> float | None:
    """``value`` as a Python float if it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def check_text(what: str, text: object, *, allow_nul: bool = False) -> str:
    """Return ``text`` as a ``str`` that encodes to UTF-8; ``ValueError`` naming ``what`` for
    a lone surrogate (text that cannot be valid UTF-8) or, unless allowed, a NUL character."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a str, got {type(text).__name__} {text!r:.80}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: {text[exc.start : exc.end]!r} at index {exc.start} "
            "(a lone surrogate) cannot be encoded as UTF-8"
        ) from None
    if not allow_nul and "\x00" in text:
        index = text.index("\x00")
        raise ValueError(f"{what} contains a NUL character (index {index}), which C strings cannot hold")
    return str(text)


@overload
def check_positive_int(
    name: str,
    value: object,
    *,
    allow_none: Literal[False] = False,
    minimum: int = 1,
    maximum: int = INT32_MAX,
) -> int: ...


@overload
def check_positive_int(
    name: str, value: object, *, allow_none: bool, minimum: int = 1, maximum: int = INT32_MAX
) -> int | None: ...


def check_positive_int(
    name: str,
    value: object,
    *,
    allow_none: bool = False,
    minimum: int = 1,
    maximum: int = INT32_MAX,
) -> int | None:
    """Return ``value`` as an int, or raise ``ValueError`` naming ``name`` unless it is an
    integer (a Python or numpy int, not a bool) in ``[minimum, maximum]`` (or None, if allowed).

    The default bounds (``1`` .. ``INT32_MAX``) fit every C parameter llama.cpp takes as an
    ``int32_t`` or ``uint32_t``; a value that does not fit would otherwise surface as cffi's
    ``OverflowError`` or as an abort inside llama.cpp.
    """
    if value is None and allow_none:
        return None
    number = as_int(value)
    if number is None or not minimum <= number <= maximum:
        if minimum == 1:
            expected = f"a positive int (at most {maximum})"
        else:
            expected = f"an int in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return number


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` as a bool, or raise ``ValueError`` naming ``name`` (ints and strings
    are refused: ``bool("false")`` is True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value
