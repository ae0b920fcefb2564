"""``build_engine``: the context and the ``EngineCore`` of a resolved ``EngineConfig``.
``LLM``, ``LLMEngine``, the layout switch and the fake-context tests all build the engine
through it."""

from __future__ import annotations

from collections.abc import Callable

from llamabatch._ffi.context import Context
from llamabatch._ffi.model import Model
from llamabatch.config import EngineConfig
from llamabatch.generate.core import EngineCore
from llamabatch.runtime.telemetry import Telemetry

__all__ = ["build_engine"]


def build_engine(
    model: Model,
    config: EngineConfig,
    telemetry: Telemetry,
    *,
    context_factory: Callable[..., Context] | None = None,
) -> tuple[Context, EngineCore]:
    """The context (``n_seq_max``: the slots plus the pinned-prefix sequences) and the
    engine core of ``config`` over ``model``; the context is closed again if the core fails.
    ``config`` is resolved: nothing left to the load (``kv_memory.plan_config``)."""
    make_context = context_factory if context_factory is not None else Context
    if config.n_ctx is None or config.kv_unified is None:
        raise ValueError("build_engine needs a resolved config (kv_memory.plan_config)")
    context = make_context(
        model,
        n_ctx=config.n_ctx,
        n_batch=config.n_batch,
        n_ubatch=config.n_ubatch_resolved,
        n_seq_max=config.n_seq_max,
        n_threads=config.n_threads,
        n_threads_batch=config.n_threads_batch,
        flash_attn=config.flash_attn,
        kv_unified=config.kv_unified,
        type_k=config.type_k,
        type_v=config.type_v,
    )
    try:
        core = EngineCore(model, context, config, telemetry)
    except BaseException:
        context.close()
        raise
    return context, core
