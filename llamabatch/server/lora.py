"""Which LoRA adapters a completions or chat request runs with, and the adapters' model cards.

Two conventions, both accepted:

- vLLM's: ``"model"`` names an adapter (as loaded with ``--lora name=path``), scale 1;
- llama-server's: ``"lora": [{"id": i, "scale": s}, ...]``, ``i`` the adapter's position among
  the server's adapters (the order of the ``--lora`` flags), adapters not listed off.

A ``"model"`` that names no adapter is the base model (any name, as before). Without either,
a request runs the base model. A bad ``lora`` entry is a 400 naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from llamabatch.params import LORA_SET_MAX
from llamabatch.server.protocol import Body, bad_request

__all__ = ["adapter_cards", "request_lora"]


def request_lora(body: Body, adapters: list[str]) -> tuple[tuple[str, float], ...]:
    """The adapter set of ``body`` among ``adapters`` (the server's, in ``--lora`` order)."""
    chosen: dict[str, float] = {}
    model = body.data.get("model")
    if isinstance(model, str) and model in adapters:
        chosen[model] = 1.0
    entries = body.get("lora", "list")
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
