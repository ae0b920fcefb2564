"""Prompt validation: what the facade accepts as a prompt, checked before anything reaches llama.cpp.

A prompt is either text (a non-empty ``str`` of valid Unicode) or token ids: a flat sequence
of ints (``list``, ``tuple``, ``range``, ``array.array`` of an integer type, or a 1-D numpy
array of any integer dtype). vLLM-style dicts (``{"prompt": text}`` or
``{"prompt_token_ids": ids}``) are accepted too. ``bytes`` are refused rather than read as
token ids, and so are bools, floats and nested lists: a wrong type raises ``TypeError`` and a
wrong value (empty, invalid Unicode, an id outside the vocabulary) ``ValueError``, each
message saying what was given and what is accepted.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from llamabatch.params import INT32_MAX, as_int

#: A prompt as callers may give it (text, token ids, or a vLLM-style dict).
PromptInput = str | Sequence[int] | np.ndarray | Mapping[str, Any]

_ACCEPTED = (
    "a prompt must be a non-empty str, or token ids: a list/tuple of ints, an integer array.array "
    "or a 1-D numpy integer array"
)
_INT_TYPECODES = frozenset("bBhHiIlLqQ")
# llama_tokenize takes the text's length, and the room for its tokens, as int32.
_MAX_TEXT_BYTES = INT32_MAX - 8


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def normalize_prompt(prompt: object) -> str | list[int]:
    """Return ``prompt`` as text (``str``) or token ids (``list[int]``), or raise.

    Raises:
        TypeError: not a str or a flat sequence of ints (``bytes``, bools, floats, nested
            lists, numpy bool/float arrays, ...).
        ValueError: an empty prompt, text with a lone surrogate (not valid Unicode), a
            multi-dimensional array, or an id that does not fit a token id (int32).
    """
    if isinstance(prompt, Mapping):
        return _normalize_mapping(prompt)
    if isinstance(prompt, str):
        return _normalize_text(prompt)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"{_ACCEPTED}; got {_describe(prompt)}: bytes are not token ids, decode text first "
            "(e.g. data.decode('utf-8'))"
        )
    if isinstance(prompt, np.ndarray):
        return _normalize_array(prompt)
    if isinstance(prompt, array.array):
        if prompt.typecode not in _INT_TYPECODES:
            raise TypeError(f"{_ACCEPTED}; got an array.array of typecode {prompt.typecode!r}")
        return _checked_ids(prompt.tolist())
    if isinstance(prompt, Sequence):
        return _normalize_sequence(prompt)
    raise TypeError(f"{_ACCEPTED}; got {_describe(prompt)}")


def _normalize_text(text: str) -> str:
    if not text:
        raise ValueError("the prompt is empty (an empty str)")
    try:
        n_bytes = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the prompt is not valid Unicode: {text[exc.start : exc.end]!r} at index {exc.start} is a "
            "lone surrogate, which cannot be encoded as UTF-8"
        ) from None
    if n_bytes > _MAX_TEXT_BYTES:
        raise ValueError(
            f"the prompt is too long ({n_bytes} bytes of UTF-8; llama.cpp takes at most {_MAX_TEXT_BYTES})"
        )
    return str(text)  # a plain str, also for str subclasses


def _normalize_array(arr: np.ndarray) -> list[int]:
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{_ACCEPTED}; got a numpy array of dtype {arr.dtype} (token ids need an integer dtype)"
        )
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D array, got a numpy array of shape {arr.shape}")
    return _checked_ids(arr.tolist())


def _normalize_sequence(seq: Sequence[Any]) -> list[int]:
    tokens: list[int] = []
    for i, item in enumerate(seq):
        token = as_int(item)
        if token is None:
            if isinstance(item, (bool, np.bool_)):
                why = "bools are not token ids"
            elif isinstance(item, (str, bytes, Sequence, np.ndarray, Mapping)):
                why = "token ids must be a flat sequence of ints (several prompts: a list of prompts)"
            else:
                why = "token ids must be ints"
            raise TypeError(f"{_ACCEPTED}; item {i} of the {type(seq).__name__} is {_describe(item)}: {why}")
        tokens.append(token)
    return _checked_ids(tokens)


def _checked_ids(tokens: list[int]) -> list[int]:
    if not tokens:
        raise ValueError("the prompt is empty (no token ids)")
    for i, token in enumerate(tokens):
        if not 0 <= token <= INT32_MAX:
            raise ValueError(f"prompt token id {token} at index {i} is not a token id (an int in [0, 2**31))")
    return tokens


def _normalize_mapping(prompt: Mapping[Any, Any]) -> str | list[int]:
    keys = set(prompt)
    if keys == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"a {{'prompt': ...}} dict holds text (a str), got {_describe(prompt['prompt'])}")
        return _normalize_text(prompt["prompt"])
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str):
            raise TypeError("a {'prompt_token_ids': ...} dict holds token ids, got a str")
        return normalize_prompt(ids)  # type: ignore[return-value]
    raise TypeError(
        "a prompt dict must have exactly one key, 'prompt' (text) or 'prompt_token_ids' (token ids); "
        f"got keys {sorted(map(str, keys))}"
    )


def check_token_ids(tokens: Iterable[int], n_vocab: int) -> None:
    """Raise ``ValueError`` naming the first id outside ``[0, n_vocab)`` and its index."""
    for i, token in enumerate(tokens):
        if not 0 <= token < n_vocab:
            raise ValueError(f"prompt token id {token} at index {i} is not in the vocabulary [0, {n_vocab})")


def is_single_prompt(prompts: object) -> bool:
    """Whether ``prompts`` (the argument of ``generate``) is ONE prompt rather than a list.

    One prompt: a ``str``, ``bytes`` (refused later by :func:`normalize_prompt`, with its
    reason), a dict, an ``array.array``, a 1-D numpy array, or a sequence whose first item
    is not itself prompt-like (``[1, 2, 3]``; also ``[True]`` or ``[1.5]``, which
    ``normalize_prompt`` then refuses). Many: any other sequence, including an empty one,
    and a 2-D numpy array (one prompt per row).
    """
    if isinstance(prompts, (str, bytes, bytearray, memoryview, Mapping, array.array)):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim <= 1
    if isinstance(prompts, Sequence):
        if len(prompts) == 0:
            return False
        first = prompts[0]
        return not isinstance(first, (str, bytes, bytearray, memoryview, Mapping, Sequence, np.ndarray))
    return True  # anything else is one (invalid) prompt: normalize_prompt says why


def as_prompt_list(prompts: object) -> tuple[list[Any], bool]:
    """``(list of prompts, single)``: ``prompts`` as a list of prompt inputs (not yet
    normalized), and whether a single prompt was given."""
    if is_single_prompt(prompts):
        return [prompts], True
    return list(prompts), False  # type: ignore[call-overload]  # a 2-D array gives its rows
