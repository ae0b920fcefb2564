"""What ``EngineConfig`` (``config.py``) and its option modules share without importing it:
the flag types (``positive_int``, ``validate.py``'s; ``positive_float``, ``on_off``,
``parse_flash_attn``), the checks of values, and the explicit settings
``batch_invariant=True`` refuses (``generate/batch_invariant.py`` decides the rest when the
model is loaded)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any, Protocol

from llamabatch.validate import positive_int

__all__ = [
    "INVARIANT_KV_TYPE",
    "InvariantSettings",
    "batch_invariant_conflict",
    "check_count",
    "check_milliseconds",
    "lora_adapter_pairs",
    "on_off",
    "parse_flash_attn",
    "parse_lora_arg",
    "positive_float",
    "positive_int",
]

#: the KV cache type ``batch_invariant=True`` uses in place of the default f16
INVARIANT_KV_TYPE = "q8_0"


# -- batch_invariant ---------------------------------------------------------------------------


class InvariantSettings(Protocol):
    """The settings :func:`batch_invariant_conflict` reads (an ``EngineConfig``)."""

    @property
    def kv_unified(self) -> bool | None: ...
    @property
    def flash_attn(self) -> bool | str | None: ...
    @property
    def type_k(self) -> str: ...
    @property
    def type_v(self) -> str: ...
    @property
    def n_gpu_layers(self) -> int: ...


def batch_invariant_conflict(config: InvariantSettings) -> str | None:
    """Why ``config``'s explicit settings cannot be batch-invariant (None: they can). Only
    meaningful with ``config.batch_invariant``."""
    if config.kv_unified is True:
        return (
            "batch_invariant=True needs one KV stream per sequence (kv_unified=False or None); "
            "kv_unified=True was given: in one buffer a sequence's cells sit wherever the other "
            "sequences left room, and llama.cpp's kernels group them by where they sit"
        )
    if config.flash_attn is False:
        return (
            "batch_invariant=True needs flash attention (flash_attn=True or None); flash_attn=False "
            "was given: without it llama.cpp multiplies a stream's one-row attention with another "
            "kernel than its several rows, which round differently"
        )
    for name in ("type_k", "type_v"):
        if getattr(config, name) == "f32":
            return (
                f"batch_invariant=True needs a KV type other than f16/f32 ({name}='f32' was given): "
                "ggml's flash attention picks its kernel by the batch's shape for those; use "
                f"{INVARIANT_KV_TYPE} (the default here), bf16 or another quantized type"
            )
    if config.n_gpu_layers != 0:
        return (
            "batch_invariant=True is made and checked for ggml's CPU kernels only; "
            f"n_gpu_layers={config.n_gpu_layers} was given (use n_gpu_layers=0)"
        )
    return None


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def on_off(text: str) -> bool:
    """An argparse type: ``on`` or ``off`` as a bool."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def parse_flash_attn(text: str) -> bool | None:
    """An argparse type: ``on`` / ``off`` / ``auto`` as ``True`` / ``False`` / ``None``."""
    try:
        return {"on": True, "off": False, "auto": None}[text]
    except KeyError:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from on, off, auto)") from None


def check_milliseconds(name: str, value: object) -> None:
    """``ValueError`` unless the option ``name`` is None or a finite number of ms above 0."""
    if value is not None and (
        not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf")
    ):
        raise ValueError(f"{name} must be a positive number (ms) or None, got {value!r}")


def check_count(name: str, value: object, note: str = "", *, none_ok: bool = False) -> None:
    """``ValueError`` unless the option ``name`` is an int >= 0 (or None, with ``none_ok``);
    ``note`` follows "an int >= 0" in the message."""
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0{note}, got {value!r}")


#: ``EngineConfig.slo_reject``'s flag (``config.flag``'s shape)
SLO_REJECT: dict[str, Any] = {
    "cli": (
        ("--slo-reject",),
        {
            "action": argparse.BooleanOptionalAction,
            "help": "refuse a request that cannot meet its TTFT SLO (the server: 503 with Retry-After)",
        },
    )
}


# -- lora_adapters -----------------------------------------------------------------------------


def parse_lora_arg(spec: str) -> tuple[str, str]:
    """``name=path`` (vLLM's form) or a bare ``path`` (llama-server's ``--lora FILE``: named by
    the file's stem) as ``(name, path)``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--lora takes name=path or a file, got {spec!r}")
    name, sep, path = spec.partition("=")
    if not sep:
        path, name = spec, os.path.splitext(os.path.basename(spec))[0]
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--lora takes name=path or a file, got {spec!r}")
    return name, path


def lora_adapter_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """``lora_adapters`` normalised: ``((name, path), ...)`` from a mapping ``{name: path}`` or
    a sequence of ``--lora`` strings; a name at most once."""
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if isinstance(value, Mapping):
        items = [(k, os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [tuple(v) if isinstance(v, (list, tuple)) else parse_lora_arg(os.fspath(v)) for v in value]
    else:
        raise ValueError(f"lora_adapters must be a mapping {{name: path}}, got {type(value).__name__}")
    out: dict[str, str] = {}
    for item in items:
        if len(item) != 2 or not all(isinstance(x, str) and x and "\0" not in x for x in item):
            raise ValueError(f"lora_adapters: each adapter is a (name, path) pair of strings, got {item!r}")
        name, path = item
        if name in out:
            raise ValueError(f"lora_adapters names {name!r} twice")
        out[name] = path
    return tuple(out.items())


def check_merge_lora(
    merge_lora: Any, adapters: tuple[tuple[str, str], ...], max_loras: Any, batch_invariant: Any = False
) -> None:
    """``merge_lora`` needs exactly one adapter and no ``max_loras`` (nothing loads at run time);
    its F16 matrices are what ``batch_invariant=True`` refuses."""
    if not isinstance(merge_lora, bool):
        raise ValueError(f"merge_lora must be True or False, got {merge_lora!r}")
    if not merge_lora:
        return
    if len(adapters) != 1:
        raise ValueError(
            f"merge_lora=True merges exactly one LoRA adapter into the weights, but lora_adapters "
            f"names {len(adapters)}; give one, or serve several unmerged (merge_lora=False)"
        )
    if max_loras is not None:
        raise ValueError(
            f"max_loras={max_loras!r} does not apply with merge_lora=True: the merged model loads no "
            "adapters at run time"
        )
    if batch_invariant is True:
        raise ValueError(
            "merge_lora=True writes the adapted matrices as F16, which batch_invariant=True refuses "
            "(its kernels need quantized matrices): use one or the other"
        )
