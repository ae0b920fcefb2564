"""``LoraAdapter``: owner of a ``llama_adapter_lora``, and applying adapter sets to a context.

Lifetimes, as llama.cpp has them: an adapter belongs to its model (``llama_model_free`` frees the
adapters still loaded), and a context holds raw pointers to the adapters set on it
(``llama_set_adapters_lora``). So an adapter is freed exactly once, by whichever comes first:
its own ``close()`` (which first clears it from every context it is set on), or the model's
``close()`` (which closes its contexts, then its adapters, then itself).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamabatch._ffi import ffi, lib, log
from llamabatch.errors import LoraLoadError
from llamabatch.gguf.check_lora import LoraReport, check_lora

if TYPE_CHECKING:
    from llamabatch._ffi.context import Context
    from llamabatch._ffi.model import Model

__all__ = ["LoraAdapter", "set_adapters"]


class LoraAdapter:
    """A LoRA adapter GGUF loaded by llama.cpp for ``model``.

    The file is checked first (:func:`llamabatch.gguf.check_lora.check_lora`: structure,
    architecture, tensor names and shapes against the model), so a wrong file is a
    :class:`~llamabatch.errors.LoraLoadError` naming it, never an abort.

    Raises:
        FileNotFoundError: no such file.
        LoraLoadError: the file is not an adapter for this model, or llama.cpp refused it.
    """

    def __init__(self, model: Model, path: str | os.PathLike[str], *, validate: bool = True) -> None:
        self._ptr = ffi.NULL
        self.path = Path(path)
        self.model = model
        #: contexts this adapter is set on (cleared from them before it is freed)
        self._contexts: weakref.WeakSet[Any] = weakref.WeakSet()
        self.report: LoraReport | None = check_lora(self.path, model.path) if validate else None
        with log.capture() as logged:
            ptr = lib.llama_adapter_lora_init(model.ptr, os.fsencode(self.path))
            failed = ptr == ffi.NULL
            reason = (log.load_reason(logged.errors) or log.load_reason(logged.warnings)) if failed else ""
            logged.release(failed=failed)
        if failed:
            raise LoraLoadError(str(self.path), f"llama.cpp rejected the file: {reason or 'no reason given'}")
        self._ptr = ptr  # freed by close() or by the model's close(), never by the collector alone
        model.register_adapter(self)

    @property
    def ptr(self) -> Any:
        """The ``llama_adapter_lora *``."""
        if self._ptr == ffi.NULL:
            raise ValueError(f"the LoRA adapter {self.path.name} is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr == ffi.NULL

    def attached(self, context: Context) -> None:
        """Record that ``context`` holds this adapter (``set_adapters``)."""
        self._contexts.add(context)

    def detached(self, context: Context) -> None:
        self._contexts.discard(context)

    def close(self) -> None:
        """Free the adapter now (after clearing it from the contexts it is set on). Idempotent;
        a no-op once the model is closed (llama.cpp freed it with the model)."""
        if self._ptr == ffi.NULL:
            return
        for context in list(self._contexts):
            if not context.closed and any(a is self for a in context.adapters):
                set_adapters(context, [a for a in context.adapters if a is not self], None)
        self._contexts = weakref.WeakSet()
        ptr, self._ptr = self._ptr, ffi.NULL
        if not self.model.closed:
            lib.llama_adapter_lora_free(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"<llamabatch.LoraAdapter {self.path.name}{' closed' if self.closed else ''}>"


def set_adapters(context: Context, adapters: Sequence[LoraAdapter], scales: Sequence[float] | None) -> None:
    """Make ``adapters`` (with ``scales``, 1.0 each by default) the context's adapter set; an
    empty sequence clears it. llama.cpp re-plans its graph on the next decode after a change."""
    adapters = list(adapters)
    scale_list = [1.0] * len(adapters) if scales is None else [float(s) for s in scales]
    if len(scale_list) != len(adapters):
        raise ValueError(f"{len(adapters)} adapters but {len(scale_list)} scales")
    for adapter in adapters:
        if adapter.model.ptr != context.model.ptr:
            raise ValueError(f"{adapter!r} was loaded for another model than the context's")
    if adapters:
        ptrs = ffi.new("struct llama_adapter_lora *[]", [a.ptr for a in adapters])
        c_scales = ffi.new("float[]", scale_list)
        lib.llama_set_adapters_lora(context.ptr, ptrs, len(adapters), c_scales)
    else:
        lib.llama_set_adapters_lora(context.ptr, ffi.NULL, 0, ffi.NULL)
    for adapter in context.adapters:
        adapter.detached(context)
    context.adapters = tuple(adapters)
    context.adapter_scales = tuple(scale_list)
    for adapter in adapters:
        adapter.attached(context)
