"""How a ``SamplingParams`` field is declared: once, in its dataclass field's metadata, as
``EngineConfig`` declares its options. :func:`param` makes the field; its :class:`ParamSpec`
says

- ``range``: the numbers it takes (``SamplingParams`` checks it from here);
- ``request``: the OpenAI request field(s) the server reads it from, and their JSON kind
  (``server/protocol.sampling_params`` reads the plain ones from here; ``custom`` ones it
  reads itself), or the reason no request field sets it;
- ``flag``: its ``llamabatch generate`` flag (``add_cli_args`` / ``from_cli_args``), or the
  reason it has none;
- ``stage``: the sampler stage it switches on, and when (``active_stages``: the sampler chain
  and the greedy fast path both read it), or None for a field that switches none on.

A new parameter is then a field with its ``param(...)``, a sampler stage where it samples
(``_ffi/sampler.py`` builds each stage of ``STAGES``), and a test.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DRAW_STAGES",
    "ENGINE_STAGES",
    "MIROSTAT_REPLACES",
    "STAGES",
    "Flag",
    "ParamSpec",
    "Range",
    "Request",
    "active_stages",
    "add_cli_args",
    "from_cli_args",
    "param",
    "spec_of",
    "specs",
    "undeclared_fields",
]

#: the sampler stages in the order a request's chain applies them (llama.cpp's usual chain):
#: the allowed tokens, logit bias, the penalties and DRY, grammar, the ``min_tokens`` mask,
#: then either greedy or the truncations, XTC, temperature and a seeded draw (or mirostat,
#: which draws itself)
STAGES = (
    "allowed_tokens",
    "logit_bias",
    "penalties",
    "dry",
    "grammar",
    "min_tokens",
    "greedy",
    "top_n_sigma",
    "top_k",
    "typical",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
    "dist",
    "mirostat",
)
#: the stages a greedy request replaces by ``greedy``
DRAW_STAGES = frozenset(
    {"top_n_sigma", "top_k", "typical", "top_p", "min_p", "xtc", "temperature", "dist", "mirostat"}
)
#: the stages mirostat replaces: it sets its own cut from the text's surprise, and draws
MIROSTAT_REPLACES = frozenset({"top_n_sigma", "top_k", "typical", "top_p", "min_p", "xtc", "dist"})
#: stages the engine applies to a row itself, outside the llama.cpp chain
ENGINE_STAGES = frozenset({"min_tokens"})


@dataclass(frozen=True)
class Range:
    """The numbers a field takes: ``[lo, hi]`` (``(lo, hi]`` with ``open_lo``), an ``int`` or
    a finite ``float``; ``optional``: None is taken too. ``hint`` ends the error message."""

    kind: type
    lo: float
    hi: float
    open_lo: bool = False
    hint: str = ""
    optional: bool = False


@dataclass(frozen=True)
class Request:
    """The request fields a value is read from (the first one present wins), and their JSON
    kind (``Body.get``'s: ``number``, ``int``, ``bool``, ``str``, ``list``, ``dict``);
    ``custom``: the server reads it with its own rule (``protocol.CUSTOM_FIELDS``)."""

    names: tuple[str, ...]
    kind: str
    custom: bool = False


@dataclass(frozen=True)
class Flag:
    """A ``llamabatch generate`` flag: its names and ``add_argument``'s keywords."""

    flags: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParamSpec:
    """Everything about one ``SamplingParams`` field but its name, type and default."""

    range: Range | None
    request: Request | str
    flag: Flag | str
    stage: str | None
    on: Callable[[Any], bool] | None = None


def param(
    default: Any = dataclasses.MISSING,
    *,
    request: Request | str,
    flag: Flag | str,
    stage: str | None,
    on: Callable[[Any], bool] | None = None,
    range: Range | None = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A ``SamplingParams`` field. ``request`` / ``flag``: a :class:`Request` / :class:`Flag`,
    or a string saying why there is none. ``stage`` (one of :data:`STAGES`) is switched on
    when ``on(params)`` is true; None: the field switches no stage on."""
    if stage is not None and (stage not in STAGES or on is None):
        raise ValueError(f"stage {stage!r}: one of {STAGES}, with its on(params) rule")
    spec = ParamSpec(range, request, flag, stage, on)
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"param": spec})
    return field(default=default, metadata={"param": spec})


def spec_of(f: dataclasses.Field[Any]) -> ParamSpec | None:
    """The declaration of a dataclass field (None: declared without :func:`param`)."""
    spec = f.metadata.get("param")
    return spec if isinstance(spec, ParamSpec) else None


def specs(cls: type) -> dict[str, ParamSpec]:
    """Each declared field of ``cls``, by name, in field order."""
    out = {}
    for f in dataclasses.fields(cls):
        spec = spec_of(f)
        if spec is not None:
            out[f.name] = spec
    return out


def undeclared_fields(cls: type) -> list[str]:
    """The fields of ``cls`` declared without :func:`param` (no range, request field, flag
    or stage said): a new parameter must say all four."""
    return [f.name for f in dataclasses.fields(cls) if spec_of(f) is None]


def active_stages(params: Any) -> tuple[str, ...]:
    """The sampler stages ``params`` switches on, in the chain's order (:data:`STAGES`). A
    greedy request (``params.greedy``) draws nothing: ``greedy`` stands for the draw stages.
    ``("greedy",)`` alone is plain greedy: the engine's argmax fast path."""
    on = {s.stage for s in specs(type(params)).values() if s.stage is not None and s.on and s.on(params)}
    if params.greedy:
        on = (on - DRAW_STAGES) | {"greedy"}
    elif "mirostat" in on:  # llama.cpp's chain then: temperature, mirostat
        on -= MIROSTAT_REPLACES
    else:
        on.add("dist")
    return tuple(stage for stage in STAGES if stage in on)


# -- the command line -----------------------------------------------------------------------


def add_cli_args(cls: type, parser: argparse.ArgumentParser | Any, defaults: Mapping[str, Any]) -> None:
    """The flags of ``cls``'s declared fields (``defaults``: the command's own defaults,
    else the field's: a flag not given leaves the field at its default)."""
    for f in dataclasses.fields(cls):
        spec = spec_of(f)
        if spec is None or not isinstance(spec.flag, Flag):
            continue
        options = dict(spec.flag.options)
        if options.get("action") not in ("store_true", "append"):
            options.setdefault("type", spec.range.kind if spec.range is not None else str)
            main = next(flag for flag in spec.flag.flags if flag.startswith("--"))
            options.setdefault("metavar", main[2:].upper().replace("-", "_"))
            shown = defaults.get(f.name, f.default)
            if shown is not None and shown is not dataclasses.MISSING:
                options["help"] = f"{options.get('help', '')} (default: {shown})".lstrip()
        options.setdefault("default", defaults.get(f.name))
        parser.add_argument(*spec.flag.flags, dest=f.name, **options)


def from_cli_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The field values the flags of ``cls`` gave (flags left at None are not given)."""
    out = {}
    for name, spec in specs(cls).items():
        if isinstance(spec.flag, Flag):
            value = getattr(args, name, None)
            if value is not None:
                out[name] = value
    return out


def request_fields(cls: type) -> Iterable[tuple[str, Request]]:
    """Each declared field the server reads from a request body, and how."""
    for name, spec in specs(cls).items():
        if isinstance(spec.request, Request):
            yield name, spec.request
