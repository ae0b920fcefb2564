"""``EmbedderConfig``: every option of the ``Embedder``, its default and its check, once.

``Embedder(path, config=EmbedderConfig(n_batch=1024))`` and ``Embedder(path, n_batch=1024)`` are
the same; keywords given with a config override its fields (as ``EngineConfig.from_options``).
The options llama.cpp itself checks (``n_threads``, ``flash_attn``, ``n_gpu_layers``,
``kv_unified``, ``load_mode``) are checked by ``Context`` and ``Model`` when the embedder is made.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamabatch.validate import INT32_MAX, check_positive_int

__all__ = [
    "NORMALIZATIONS",
    "POOLINGS",
    "EmbedderConfig",
    "normalize_mode",
    "round_up",
    "with_config_signature",
]

#: Pooling modes ``Embedder`` accepts (``None`` means: what the GGUF declares).
POOLINGS = ("mean", "cls", "last", "rank", "none")
#: Normalisation modes (``True`` means ``"l2"``, ``False`` means ``"none"``).
NORMALIZATIONS = ("l2", "none", "max_abs")


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def normalize_mode(normalize: Any) -> str:
    """A ``normalize`` option as one of :data:`NORMALIZATIONS` (``ValueError`` otherwise)."""
    if normalize is True:
        return "l2"
    if normalize is False or normalize is None:
        return "none"
    if isinstance(normalize, str) and normalize in NORMALIZATIONS:
        return normalize
    raise ValueError(f"normalize must be one of {NORMALIZATIONS} (or True/False), got {normalize!r}")


@dataclass(frozen=True)
class EmbedderConfig:
    """The options of an :class:`~llamabatch.Embedder` (see its docstring for each one's
    meaning), checked at construction; ``normalize`` is stored as its mode (``True`` becomes
    ``"l2"``)."""

    n_batch: int = 512
    n_ubatch: int | None = None
    n_seq_max: int = 64
    n_ctx: int | None = None
    pooling: str | None = None
    normalize: str | bool = "l2"
    truncate: bool = False
    n_threads: int | None = None
    flash_attn: bool | str | None = "auto"
    n_gpu_layers: int = 0
    kv_unified: bool = True
    load_mode: str = "mmap"
    validate: bool = True

    def __post_init__(self) -> None:
        # Context checks the others; these four are rounded before it sees them.
        check_positive_int("n_batch", self.n_batch)
        check_positive_int("n_ubatch", self.n_ubatch, allow_none=True)
        check_positive_int("n_seq_max", self.n_seq_max)
        check_positive_int("n_ctx", self.n_ctx, allow_none=True)
        if self.n_ubatch is not None and self.n_ubatch > self.n_batch:  # rounding could hide it
            raise ValueError(f"n_ubatch ({self.n_ubatch}) must be <= n_batch ({self.n_batch})")
        for name, value in (("n_batch", self.n_batch), ("n_ctx", self.n_ctx)):
            if value is not None and round_up(value, self.n_seq_max) > INT32_MAX:
                raise ValueError(
                    f"{name} ({value}) rounded up to a multiple of n_seq_max ({self.n_seq_max}) exceeds "
                    f"{INT32_MAX}, the most llama.cpp takes"
                )
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS} or None, got {self.pooling!r}")
        object.__setattr__(self, "normalize", normalize_mode(self.normalize))
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be True or False, got {self.truncate!r}")

    def replace(self, **changes: Any) -> EmbedderConfig:
        """A copy with ``changes`` applied (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, config: EmbedderConfig | None = None, **options: Any) -> EmbedderConfig:
        """``config`` (default: the defaults) with the keyword ``options`` applied over it:
        keywords win. ``TypeError`` names an unknown option."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown Embedder option(s): {', '.join(unknown)}")
        if config is None:
            return cls(**options)
        if not isinstance(config, EmbedderConfig):
            raise TypeError(f"config must be an EmbedderConfig, got {type(config).__name__}")
        return dataclasses.replace(config, **options) if options else config


def with_config_signature(init: Callable[..., None]) -> Callable[..., None]:
    """Show ``init(self, model_path, *, config=None, **options)`` with the config's fields as
    keyword parameters (``help()``, ``inspect.signature``): the options, spelt out."""
    signature = inspect.signature(init)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(EmbedderConfig)
    ]
    init.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return init
