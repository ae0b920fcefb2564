"""Which LoRA adapters a completions or chat request runs with, and the adapters' model cards.

Two conventions, both accepted:

- vLLM's: ``"model"`` names an adapter (as loaded with ``--lora name=path``), scale 1;
- llama-server's: ``"lora": [{"id": i, "scale": s}, ...]``, ``i`` the adapter's position among
  the server's adapters (the order of the ``--lora`` flags), adapters not listed off.

A ``"model"`` that names no adapter is the base model (any name, as before). Without either,
a request runs the server's applied adapters (llama-server's: those given as a bare ``--lora
FILE``, scale 1, unless ``--lora-init-without-apply``; ``applied_adapters``), else the base
model. A bad ``lora`` entry is a 400 naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from llamabatch.config_checks import parse_lora_arg
from llamabatch.param_values import LORA_SET_MAX
from llamabatch.server.protocol import Body, bad_request

__all__ = ["adapter_cards", "applied_adapters", "applied_lora", "request_lora"]


def applied_adapters(specs: Sequence[str] | None, init_without_apply: bool) -> tuple[str, ...]:
    """The names of the ``--lora`` adapters applied to every request that selects none:
    llama-server's bare ``FILE`` form applies at scale 1 unless ``init_without_apply``; the
    ``name=FILE`` form (vLLM's) is selected per request only."""
    if init_without_apply:
        return ()
    return tuple(parse_lora_arg(spec)[0] for spec in specs or () if "=" not in spec)


def applied_lora(llm: Any, names: Sequence[str]) -> tuple[str, ...]:
    """``names`` checked against ``llm``'s adapters (``ValueError`` naming one it lacks)."""
    if isinstance(names, str):
        raise ValueError(f"lora_applied must be a sequence of adapter names, got {names!r}")
    known = llm.lora_adapters() if llm is not None else {}
    for name in names:
        if name not in known:
            listed = ", ".join(sorted(known)) or "none"
            raise ValueError(f"lora_applied: no LoRA adapter named {name!r} (loaded: {listed})")
    return tuple(names)


def request_lora(
    body: Body, adapters: list[str], applied: Sequence[str] = ()
) -> tuple[tuple[str, float], ...]:
    """The adapter set of ``body`` among ``adapters`` (the server's, in ``--lora`` order);
    ``applied`` (scale 1) when it selects none by ``"model"`` or ``"lora"``."""
    chosen: dict[str, float] = {}
    model = body.data.get("model")
    if isinstance(model, str) and model in adapters:
        chosen[model] = 1.0
    entries = body.get("lora", "list")
    if not chosen and entries is None:
        return tuple(sorted((name, 1.0) for name in applied))
    if entries is not None:
        if len(entries) > LORA_SET_MAX:
            raise bad_request(f"'lora' takes at most {LORA_SET_MAX} entries", param="lora")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or set(entry) - {"id", "scale"}:
                raise bad_request(f"'lora[{i}]' must be an object {{id, scale}}", param="lora")
            index, scale = entry.get("id"), entry.get("scale", 1.0)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(adapters):
                raise bad_request(
                    f"'lora[{i}].id' must be an adapter id in [0, {len(adapters)}), got {index!r}",
                    param="lora",
                )
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise bad_request(f"'lora[{i}].scale' must be a finite number, got {scale!r}", param="lora")
            if abs(scale) > 1e6:
                raise bad_request(f"'lora[{i}].scale' {scale} is out of range", param="lora")
            chosen[adapters[index]] = float(scale)
    return tuple(sorted((name, scale) for name, scale in chosen.items() if scale != 0.0))


def adapter_cards(base: str | None, adapters: dict[str, str], created: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters (vLLM's shape: each names its ``parent``)."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "llamabatch",
            "parent": base,
            "root": path,
        }
        for name, path in adapters.items()
    ]
