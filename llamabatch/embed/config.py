"""``EmbedderConfig``: every option of the ``Embedder``, its default and its check, once.

``Embedder(path, config=EmbedderConfig(n_batch=1024))`` and ``Embedder(path, n_batch=1024)`` are
the same; keywords given with a config override its fields (as ``EngineConfig.from_options``).
The options llama.cpp itself checks (``n_threads``, ``flash_attn``, ``n_gpu_layers``,
``kv_unified``, ``load_mode``) are checked by ``Context`` and ``Model`` when the embedder is made.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llamabatch.config import OptionsConfig, flag, positive_int
from llamabatch.prompts.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    check_image_options,
)
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
class EmbedderConfig(OptionsConfig):
    """The options of an :class:`~llamabatch.Embedder` (see its docstring for each one's
    meaning), checked at construction; ``normalize`` is stored as its mode (``True`` becomes
    ``"l2"``)."""

    _options_of = "Embedder"

    n_batch: int = field(
        default=512,
        metadata=flag("--n-batch", type=positive_int, help="tokens per decode (also the per-text limit)"),
    )
    n_ubatch: int | None = field(
        default=None,
        metadata=flag("--n-ubatch", type=positive_int, help="llama.cpp's micro-batch (<= n_batch)"),
    )
    n_seq_max: int = field(
        default=64, metadata=flag("--n-seq-max", type=positive_int, help="texts per decode")
    )
    n_ctx: int | None = field(
        default=None,
        metadata=flag("--n-ctx", type=positive_int, help="KV cache size (models with memory)"),
    )
    pooling: str | None = field(
        default=None, metadata=flag("--pooling", choices=POOLINGS, help="default: the model's")
    )
    normalize: str | bool = "l2"
    truncate: bool = field(
        default=False,
        metadata=flag("--truncate", action="store_true", help="cut over-long texts instead of failing"),
    )
    n_threads: int | None = field(
        default=None,
        metadata=flag(
            "-t", "--threads", type=positive_int, metavar="THREADS", help="CPU threads (default: all cores)"
        ),
    )
    flash_attn: bool | str | None = "auto"
    n_gpu_layers: int = field(
        default=0,
        metadata=flag("-ngl", "--n-gpu-layers", type=int, help="layers offloaded to a GPU (-1: all)"),
    )
    kv_unified: bool = True
    load_mode: str = "mmap"
    validate: bool = True
    mmproj: str | None = field(
        default=None,
        metadata=flag("--mmproj", metavar="PATH", help="image encoder + projector GGUF: embed images too"),
    )
    allow_remote_images: bool = False
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST

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
        check_image_options(self)
        if self.mmproj is not None and self.pooling == "rank":
            raise ValueError("mmproj cannot be combined with pooling 'rank' (a reranker scores text pairs)")

    # -- the command line -----------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser | Any,
        *,
        only: Iterable[str] | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Add the embedder's flags to ``parser`` (or an argument group), each with its field's
        name as ``dest`` and its default (shown in ``--help``), as ``EngineConfig.add_cli_args``.

        ``only`` picks fields (default: every field that has a flag); ``overrides`` replaces
        ``add_argument`` keywords per field (the flags themselves with ``"flags"``)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        overrides = overrides or {}
        for name in list(only) if only is not None else cls.cli_fields():
            spec = fields[name]
            if "cli" not in spec.metadata:
                raise ValueError(f"EmbedderConfig.{name} has no command-line flag")
            flags, kwargs = spec.metadata["cli"]
            kwargs = {"default": spec.default, **kwargs, **overrides.get(name, {})}
            flags = kwargs.pop("flags", flags)
            help_text = kwargs.get("help")
            if help_text is not None and kwargs.get("action") is None and "default" not in help_text:
                kwargs["help"] = (
                    f"{help_text} (default: {'none' if kwargs['default'] is None else kwargs['default']})"
                )
            parser.add_argument(*flags, dest=name, **kwargs)


def with_config_signature(init: Callable[..., None]) -> Callable[..., None]:
    """Show ``init(self, model_path, *, config=None, **options)`` with the config's fields as
    keyword parameters (``help()``, ``inspect.signature``): the options, spelt out."""
    return EmbedderConfig.signature_of(init)
