"""``speculative_config``: its check, and its command-line form (llama-server's flags).

Kept apart from ``speculative.py`` (the engine side) so that ``config.py`` can check the
option without importing the engine."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from llamabatch.config_checks import positive_int

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "add_spec_cli_args",
    "spec_cli_argv",
    "spec_config_from_cli",
    "validate_speculative_config",
]

#: the most draft tokens per step (the slot table's ``MAX_DRAFT``)
MAX_SPECULATIVE_TOKENS = 64


_KEYS = frozenset(
    {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "model",
        "suffix_cache_tokens",
        "grammar_drafts",
    }
)
_METHODS = ("ngram", "suffix", "draft_model")
#: the suffix method's shared history: its default and largest bound, in tokens (~200 bytes each)
SUFFIX_CACHE_TOKENS = 1 << 16
_MAX_SUFFIX_CACHE_TOKENS = 1 << 24


def validate_speculative_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The checked, completed ``speculative_config`` (None: speculation off).

    Keys (vLLM's): ``method`` ("ngram", "suffix" or "draft_model"), ``num_speculative_tokens``
    (the most drafts per step, 1..64; default 64 for ngram and suffix, whose lengths the policy
    chooses, 5 for draft_model), ``prompt_lookup_min`` (ngram, suffix: the shortest match that
    drafts, 1..32, default 2), ``prompt_lookup_max`` (ngram: None, the default, looks up the
    longest match over the whole history; an int (min..32) bounds the suffix looked up),
    ``suffix_cache_tokens`` (suffix: the shared history's bound in tokens, 64..2**24, default
    65536), ``grammar_drafts`` (ngram, suffix: a grammar request also drafts the text its
    grammar forces, ``spec_grammar.py``; default True), ``model`` (draft_model: the draft GGUF
    path). Anything else raises ``ValueError`` naming it.
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise ValueError(f"speculative_config must be a dict or None, got {type(config).__name__}")
    unknown = sorted(str(k) for k in config if k not in _KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(_KEYS)})")
    method = config.get("method")
    if method not in _METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(_METHODS)}, got {method!r}")
    out: dict[str, Any] = {"method": method}
    k = config.get("num_speculative_tokens", 5 if method == "draft_model" else MAX_SPECULATIVE_TOKENS)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            "speculative_config['num_speculative_tokens'] must be an int in "
            f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
        )
    out["num_speculative_tokens"] = k
    if method != "suffix" and "suffix_cache_tokens" in config:
        raise ValueError(f"speculative_config['suffix_cache_tokens'] is for method 'suffix', not {method!r}")
    if method in ("ngram", "suffix"):
        grammar_drafts = config.get("grammar_drafts", True)
        if not isinstance(grammar_drafts, bool):
            raise ValueError(f"speculative_config['grammar_drafts'] must be a bool, got {grammar_drafts!r}")
        out["grammar_drafts"] = grammar_drafts
        if "model" in config:
            raise ValueError(f"speculative_config['model'] is for method 'draft_model', not {method!r}")
        if method == "suffix" and "prompt_lookup_max" in config:
            raise ValueError(
                "speculative_config['prompt_lookup_max'] is for method 'ngram' (suffix matches are unbounded)"
            )
        lo = config.get("prompt_lookup_min", 2)
        hi = config.get("prompt_lookup_max")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if name == "prompt_lookup_max" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 32:
                raise ValueError(f"speculative_config[{name!r}] must be an int in 1..32, got {v!r}")
        if hi is not None and lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        out["prompt_lookup_min"] = lo
        if method == "ngram":
            out["prompt_lookup_max"] = hi
        else:
            size = config.get("suffix_cache_tokens", SUFFIX_CACHE_TOKENS)
            if (
                not isinstance(size, int)
                or isinstance(size, bool)
                or not 64 <= size <= _MAX_SUFFIX_CACHE_TOKENS
            ):
                raise ValueError(
                    "speculative_config['suffix_cache_tokens'] must be an int in "
                    f"64..{_MAX_SUFFIX_CACHE_TOKENS}, got {size!r}"
                )
            out["suffix_cache_tokens"] = size
    else:
        for name in ("prompt_lookup_min", "prompt_lookup_max", "grammar_drafts"):
            if name in config:
                raise ValueError(
                    f"speculative_config[{name!r}] is for the methods 'ngram' and 'suffix', not 'draft_model'"
                )
        model = config.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(
                "speculative_config['model'] (the draft GGUF path) is required for 'draft_model'"
            )
        out["model"] = model
    return out


def add_spec_cli_args(parser: argparse.ArgumentParser | Any) -> None:
    """``--model-draft FILE`` and ``--draft-max N`` (with ``--spec-type``, added as the
    ``speculative_config`` field's flag)."""
    parser.add_argument(
        "-md",
        "--model-draft",
        dest="spec_model_draft",
        metavar="FILE",
        default=None,
        help="the draft model for --spec-type draft (same vocabulary as the model)",
    )
    parser.add_argument(
        "--draft-max",
        "--spec-draft-n-max",
        "--draft",
        "--draft-n",
        dest="spec_draft_max",
        type=positive_int,
        metavar="N",
        default=None,
        help="the most draft tokens per step (num_speculative_tokens; default 64 for ngram and "
        "suffix, whose lengths are chosen by what pays, 5 for draft)",
    )
    parser.add_argument(
        "--spec-grammar-drafts",
        dest="spec_grammar_drafts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ngram and suffix: a grammar or JSON-schema request also drafts the text its grammar "
        "forces (grammar_drafts; default on)",
    )


def spec_config_from_cli(args: argparse.Namespace) -> dict[str, Any] | None:
    """``speculative_config`` of ``--spec-type`` / ``--model-draft`` / ``--draft-max``."""
    kind = getattr(args, "speculative_config", None)
    model = getattr(args, "spec_model_draft", None)
    k = getattr(args, "spec_draft_max", None)
    grammar_drafts = getattr(args, "spec_grammar_drafts", None)
    if kind is None:
        if model is not None:
            kind = "draft"  # as llama-server: a draft model turns draft speculation on
        elif k is not None or grammar_drafts is not None:
            raise ValueError(
                f"{'--draft-max' if k is not None else '--[no-]spec-grammar-drafts'} needs "
                "--spec-type ngram|suffix|draft"
            )
        else:
            return None
    config: dict[str, Any] = {"method": {"draft": "draft_model", "suffix": "suffix"}.get(kind, "ngram")}
    if kind == "draft":
        if model is None:
            raise ValueError("--spec-type draft needs --model-draft FILE")
        config["model"] = model
    elif model is not None:
        raise ValueError(f"--model-draft is for --spec-type draft, not {kind}")
    if k is not None:
        config["num_speculative_tokens"] = k
    if grammar_drafts is not None:
        config["grammar_drafts"] = grammar_drafts
    return validate_speculative_config(config)


def spec_cli_argv(config: Mapping[str, Any]) -> list[str]:
    """The flags that :func:`spec_config_from_cli` reads back as ``config`` (the ngram
    lookup bounds have no flag: their defaults)."""
    argv = ["--spec-type", {"draft_model": "draft", "suffix": "suffix"}.get(config["method"], "ngram")]
    if config["method"] == "draft_model":
        argv += ["--model-draft", str(config["model"])]
    elif not config.get("grammar_drafts", True):
        argv.append("--no-spec-grammar-drafts")
    return [*argv, "--draft-max", str(config["num_speculative_tokens"])]
