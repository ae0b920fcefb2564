"""How the KV cache is laid out and how big it is by default, and what it costs: the layout
and flash attention chosen at load (:func:`choose_layout`, :func:`choose_flash_attn`),
``n_ctx`` from the model's trained context under a memory budget, the KV bytes for the chosen
``type_k`` / ``type_v``, and the one log line and ``stats()`` fields that report them.

The default (``EngineConfig.n_ctx=None``), as llama-server's: the model's trained context
(``n_ctx_train``), so that every request may use the whole context the model was trained
for. With one KV stream per sequence (``kv_unified=False``) each stream gets that context, so
``n_ctx`` is ``n_seq_max`` times it. A given ``n_ctx`` is a request's context in the same way
(used as given, in each stream), except with ``kv_unified=False`` given, where llama.cpp's own
rule divides it among the streams. It is capped so that the KV cache takes at most
:data:`KV_BUDGET_FRACTION` of the machine's physical memory (at least :data:`MIN_N_CTX` cells
a request, rounded down to llama.cpp's 256-cell padding). The KV bytes are ``n_ctx x n_layer x
n_head_kv x (head_k x size(type_k) + head_v x size(type_v))`` (``_ffi/kv_types.py``), what
llama.cpp's own ``llama_kv_cache: size = ...`` line says for a model whose layers are alike.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamabatch._ffi.cpu_backend import has_amx_build
from llamabatch._ffi.kv_types import head_dims, kv_bytes_per_cell
from llamabatch.generate.batch_invariant import invariant_config
from llamabatch.generate.slot_count import MIN_PER_STREAM_SLOTS, SlotCount, slots_for_kv

if TYPE_CHECKING:
    from llamabatch._ffi.context import Context
    from llamabatch._ffi.model import Model
    from llamabatch.config import EngineConfig

__all__ = [
    "CPU_FA_TILE_ROWS",
    "KV_BUDGET_FRACTION",
    "MIN_N_CTX",
    "PER_STREAM_BUDGET_FRACTION",
    "KVPlan",
    "choose_flash_attn",
    "choose_layout",
    "draft_rows_below",
    "kv_budget_bytes",
    "log_plan",
    "per_stream_flash_attn",
    "plan_config",
    "plan_kv",
    "ubatch_cost_cells",
]

logger = logging.getLogger("llamabatch")

#: ggml's CPU flash attention takes its tiled kernel from this many query rows of one KV
#: stream in a ubatch (``GGML_FA_TILE_Q``, ggml-cpu/common.h at the pinned commit)
CPU_FA_TILE_ROWS = 64

#: the share of physical memory the default ``n_ctx``'s KV cache may take
KV_BUDGET_FRACTION = 0.25
#: the smallest default ``n_ctx`` (a budget too small for it is not obeyed below this)
MIN_N_CTX = 1024
#: the share of physical memory that per-stream KV (the default layout where it fits, see
#: :func:`choose_layout`) may take: half the KV budget, as it buys speed, not context
PER_STREAM_BUDGET_FRACTION = KV_BUDGET_FRACTION / 2
#: the ``n_ctx`` used when the GGUF names no trained context
FALLBACK_N_CTX = 4096
_PAD = 256


def kv_budget_bytes() -> int | None:
    """The KV byte budget of the default ``n_ctx``: :data:`KV_BUDGET_FRACTION` of physical
    memory (None where the platform does not say)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return int(memory * KV_BUDGET_FRACTION) if memory > 0 else None


@dataclass(frozen=True)
class KVPlan:
    """The KV cache's size and what it costs (``stats()`` reports these)."""

    #: the ``n_ctx`` asked of llama.cpp (llama.cpp may pad it up to a multiple of 256)
    n_ctx: int
    n_ctx_train: int
    #: bytes of one KV cell over all layers, for ``type_k`` / ``type_v``, and at f16
    cell_bytes: int
    cell_bytes_f16: int
    #: the budget the default obeys (None: unknown memory, or ``n_ctx`` given explicitly)
    budget_bytes: int | None
    #: why ``n_ctx`` is what it is, in words
    reason: str
    type_k: str
    type_v: str
    #: the layout: one buffer for all sequences, or a stream per sequence; and why
    kv_unified: bool = True
    layout_reason: str = "kv_unified given"
    #: flash attention: on, off, or None (llama.cpp's own "auto"); see :func:`choose_flash_attn`
    flash_attn: bool | None = None
    #: the slots (``n_parallel``), and why: given, or chosen by ``generate/slot_count.py``
    n_parallel: int = 1
    slots_reason: str = "n_parallel given"

    def kv_bytes(self, n_ctx: int) -> int:
        """The KV cache's bytes for ``n_ctx`` cells (the context's, after padding)."""
        return n_ctx * self.cell_bytes

    def kv_bytes_f16(self, n_ctx: int) -> int:
        """What the same cells would take with f16 K and V."""
        return n_ctx * self.cell_bytes_f16


def plan_kv(model: Model, config: EngineConfig, budget: int | bool | None = True) -> KVPlan:
    """The KV cache of ``config`` over ``model``: its layout (``config.kv_unified``, or the
    choice of :func:`choose_layout`) and its size (``config.n_ctx``, or the default described
    above); ``budget``: the byte budget, default :func:`kv_budget_bytes`."""
    cell = kv_bytes_per_cell(model, config.type_k, config.type_v)
    cell_f16 = kv_bytes_per_cell(model, "f16", "f16")
    n_train = int(model.n_ctx_train or 0)
    cap = kv_budget_bytes() if budget is True else (budget or None)
    if config.n_ctx is not None:  # a request's context, in either layout (see choose_layout)
        n_ctx_seq, reason = config.n_ctx, "n_ctx given"
    elif n_train <= 0:
        n_ctx_seq, reason = FALLBACK_N_CTX, f"the model names no trained context: {FALLBACK_N_CTX}"
    else:
        n_ctx_seq, reason = n_train, "the model's trained context (n_ctx_train)"
    # without flash attention llama.cpp keeps one ubatch's f32 attention scores per stream's
    # cells (KQ: cells x tokens x heads), in a compute buffer the KV bytes do not count
    scores = n_ctx_seq * config.n_ubatch_resolved * int(model.n_head or 0) * 4
    slots_asked, streams_fit = config.n_parallel, None
    # with n_ctx given, kv_unified=False divides it among the streams (llama.cpp's own rule)
    divides = config.n_ctx is not None and config.kv_unified is False
    if slots_asked is None and config.kv_unified is not True and not divides:
        # as many streams as the per-stream budget holds, if that is enough for the layout
        streams_fit = per_stream_slots(config, n_ctx_seq * cell, cap, scores)
        config = config.replace(n_parallel=streams_fit.n_parallel)
    unified, layout_reason = choose_layout(config, n_ctx_seq * cell, cap, scores)
    config = config.replace(kv_unified=unified)
    kv = (config.type_k, config.type_v, unified, layout_reason, choose_flash_attn(config))
    if unified and streams_fit is not None:  # the slots of the buffer, not of the streams
        config = config.replace(n_parallel=slots_asked)
    if config.n_ctx is not None and (unified or divides):
        slots = resolve_slots(config, slots_asked, config.n_ctx, n_ctx_seq * cell, cap)
        return KVPlan(config.n_ctx, n_train, cell, cell_f16, None, "n_ctx given", *kv, *slots)
    if config.n_ctx is not None:  # one stream of the given n_ctx per sequence
        n_ctx = config.n_seq_max * n_ctx_seq
        reason = f"n_ctx given, in each of {config.n_seq_max} streams"
        slots = (
            (streams_fit.n_parallel, streams_fit.reason)
            if streams_fit
            else resolve_slots(config, slots_asked, n_ctx, n_ctx_seq * cell, cap)
        )
        return KVPlan(n_ctx, n_train, cell, cell_f16, None, reason, *kv, *slots)
    if slots_asked is None and unified:  # the buffer's size first, with one slot, then the slots
        config = config.replace(n_parallel=1)
    # One stream per sequence: every stream holds the whole context, so that a request may
    # use all of it in either layout (n_seq_max times the cells, under the same budget).
    streams = 1 if unified else config.n_seq_max
    floor = max(MIN_N_CTX, config.n_seq_max) if streams == 1 else MIN_N_CTX
    if cap is not None and cell > 0 and streams * n_ctx_seq * cell > cap:
        fit = cap // cell // streams // _PAD * _PAD
        n_ctx_seq = max(fit, min(floor, n_ctx_seq))
        reason = (
            f"n_ctx_train ({n_train}) capped by the KV budget ({cap / 2**20:.0f} MiB, "
            f"{KV_BUDGET_FRACTION:.0%} of physical memory)"
        )
    if streams > 1:
        reason += f", in each of {streams} streams"
    n_ctx = max(streams * n_ctx_seq, config.n_seq_max)
    if streams_fit is not None and not unified:  # per-stream: the streams that fit
        slots = (streams_fit.n_parallel, streams_fit.reason)
    else:
        slots = resolve_slots(config, slots_asked, n_ctx, n_ctx_seq * cell, cap)
    return KVPlan(n_ctx, n_train, cell, cell_f16, cap, reason, *kv, *slots)


def per_stream_slots(
    config: EngineConfig, stream_bytes: int, budget: int | None, scores_bytes: int
) -> SlotCount:
    """The slots one stream per sequence would get by default: as many streams of
    ``stream_bytes`` (one of the whole context, or of a given ``n_ctx``) as fit the per-stream budget
    beside the attention scores (without flash attention), but :data:`MIN_PER_STREAM_SLOTS`
    when fewer fit (then :func:`choose_layout` finds them over the budget and chooses one
    unified buffer); never more than ``config``'s ``n_batch`` allows with its pinned prefixes."""
    per_stream = config.replace(kv_unified=False, n_parallel=1)
    room = None
    if budget is not None:
        scores = scores_bytes if choose_flash_attn(per_stream) is False else 0
        room = max(0, int(budget * PER_STREAM_BUDGET_FRACTION / KV_BUDGET_FRACTION) - scores)
    count = slots_for_kv(
        unified=False,
        n_ctx=None,
        stream_bytes=stream_bytes,
        budget=room,
        n_prefixes=per_stream.n_prefixes,
        n_batch=config.n_batch - config.n_prefixes + per_stream.n_prefixes,
    )
    fewest = min(MIN_PER_STREAM_SLOTS, config.n_batch - config.n_prefixes)
    if count.n_parallel < fewest:
        return SlotCount(fewest, f"{fewest} slots, the fewest for one stream each")
    return count


def resolve_slots(
    config: EngineConfig, asked: int | None, n_ctx: int, stream_bytes: int, budget: int | None
) -> tuple[int, str]:
    """``(n_parallel, why)`` for ``config``'s layout (decided): ``asked`` when given, else
    :func:`slots_for_kv` over ``n_ctx`` cells."""
    if asked is not None:
        return asked, "n_parallel given"
    count = slots_for_kv(
        unified=bool(config.kv_unified),
        n_ctx=n_ctx,
        stream_bytes=stream_bytes,
        budget=budget,
        n_prefixes=config.n_prefixes,
        n_batch=config.n_batch,
    )
    return count.n_parallel, count.reason


def plan_config(model: Model, config: EngineConfig) -> tuple[KVPlan, EngineConfig]:
    """The KV plan of ``config`` over ``model``, and ``config`` with what it left to the load
    (``n_ctx``, ``kv_unified``, ``flash_attn``) set from the plan; with ``batch_invariant``
    the layout, flash attention and KV types it decides come first (``invariant_config``)."""
    config = invariant_config(config, model)
    plan = plan_kv(model, config)
    resolved = {"n_ctx": plan.n_ctx, "kv_unified": plan.kv_unified, "flash_attn": plan.flash_attn}
    return plan, config.replace(n_parallel=plan.n_parallel, **resolved)


def choose_layout(
    config: EngineConfig, stream_bytes: int, budget: int | None, scores_bytes: int = 0
) -> tuple[bool, str]:
    """``(kv_unified, why)``: ``config.kv_unified`` when given, else the default layout.

    One stream per sequence (flash attention as :func:`choose_flash_attn` chooses) was the
    fastest choice on the CPU for uniform batches, mixed arrivals and a multi-turn chat, and
    0.81-0.91x of the best for many requests on one long prompt and one long request among
    short ones (README, "Memory"): in one unified buffer every token's attention spans every
    sequence's cells. But it costs ``n_seq_max`` times the memory for whole-context
    requests, so it is the default only while that stays
    small: ``stream_bytes`` (one stream of the whole context) times the streams, plus
    ``scores_bytes`` (the attention scores' compute buffer, when flash attention would be off)
    within :data:`PER_STREAM_BUDGET_FRACTION` of physical memory (half of ``budget``, which is
    :data:`KV_BUDGET_FRACTION` of it). A given ``n_ctx`` is a request's context like the
    trained one, and ``stream_bytes`` a stream of it: one unified buffer of it made every
    decode row attend over every sequence's cells (32 uniform requests: 0.77-0.83x
    llama-batched-bench's speed, 0.92-0.96x in streams). Unified otherwise: when layers run on
    a GPU (the budget counts host memory, and the measurements were made on a CPU), or when
    one slot has nothing to gain.
    """
    if config.kv_unified is not None:
        return config.kv_unified, "kv_unified given"
    if config.n_gpu_layers != 0:
        return True, "unified: layers offloaded to a GPU (the per-stream budget counts host memory)"
    if config.n_parallel == 1:
        return True, "unified: one slot"
    per_stream = config.replace(kv_unified=False)
    streams = per_stream.n_seq_max
    scores = scores_bytes if choose_flash_attn(per_stream) is False else 0
    need = streams * stream_bytes + scores
    if budget is None:
        return True, "unified: physical memory unknown"
    room = int(budget * PER_STREAM_BUDGET_FRACTION / KV_BUDGET_FRACTION)
    mib = 2**20
    streams_text = f"{streams} streams of the whole context take {need / mib:.0f} MiB"
    if scores:
        streams_text += f" (attention scores without flash attention: {scores / mib:.0f} MiB)"
    budget_text = (
        f"per-stream budget ({room / mib:.0f} MiB, {PER_STREAM_BUDGET_FRACTION:.1%} of physical memory)"
    )
    if need > room:
        return True, f"unified: {streams_text}, over the {budget_text}"
    return False, f"per-stream: {streams_text}, within the {budget_text}"


def per_stream_flash_attn() -> bool:
    """Flash attention's default with one KV stream per sequence on this CPU: off where the
    CPU backend has AMX kernels, on elsewhere (llama.cpp's own default on the CPU).

    Measured on two CPUs (README, "Memory"). On an Intel Xeon with AMX kernels, ggml's
    flash-attention kernel, which takes a decode row's KV cells one at a time, decoded
    1.2-2.6x slower than the plain path's whole-matrix products (llamafile's sgemm), and the
    chat, shared-prefix and uniform workloads ran 1.2-2.3x slower. On an AMD EPYC (AVX-512,
    bf16, no AMX) it ran four workloads of five 1.07-1.76x faster and the chat within noise,
    and decoded 8 streams of 1,024 cells 1.19x faster (``llama-batched-bench`` agrees). CPUs
    not measured get llama.cpp's default."""
    return not has_amx_build()


def choose_flash_attn(config: EngineConfig) -> bool | None:
    """``config.flash_attn`` when given (``True`` / ``False``), else the default for the
    layout ``config.kv_unified`` (decided): with one KV stream per sequence on the CPU,
    :func:`per_stream_flash_attn`; on with one unified buffer on the CPU, llama.cpp's own
    choice (``None``) with layers on a GPU.

    In one unified buffer its tiled prompt kernel skips a 64 x 64 tile of (token, cell) pairs
    that is wholly masked; without it, a prompt chunk multiplies against every cell in use,
    which there is every sequence's: mixed arrivals took 1.9x as long. A quantized V cache
    needs flash attention (V is kept transposed without it), so ``type_v`` other than
    f16/bf16/f32 turns it on."""
    if config.flash_attn is True or config.flash_attn is False:
        return config.flash_attn
    if config.type_v not in ("f16", "bf16", "f32"):
        return True
    if config.n_gpu_layers != 0:
        return None
    return True if config.kv_unified else per_stream_flash_attn()


def log_plan(plan: KVPlan, n_ctx: int, n_ctx_seq: int, n_seq_max: int) -> None:
    """The one log line at load: the size, the layout, the KV bytes, the cap and the reasons."""
    mib = 2**20
    layout = "unified" if plan.kv_unified else f"{n_seq_max} streams"
    budget = "none" if plan.budget_bytes is None else f"{plan.budget_bytes / mib:.0f} MiB"
    logger.info(
        "llamabatch: n_ctx=%d (%s; %d per request), n_parallel=%d (%s), %s KV (%s), flash attention %s, "
        "KV cache %s/%s %.1f MiB (f16: %.1f MiB), budget %s",
        n_ctx,
        plan.reason,
        n_ctx_seq,
        plan.n_parallel,
        plan.slots_reason,
        layout,
        plan.layout_reason,
        {True: "on", False: "off", None: "auto"}[plan.flash_attn],
        plan.type_k,
        plan.type_v,
        plan.kv_bytes(n_ctx) / mib,
        plan.kv_bytes_f16(n_ctx) / mib,
        budget,
    )


def ubatch_cost_cells(model: Model) -> float:
    """What one more ubatch costs, in KV cells attended by one token (one stream per
    sequence: ``SlotTable.batch_order`` weighs its runs of streams with it).

    A ubatch multiplies every weight once (``n_params`` multiply-adds); a token attending
    one cell costs ``n_layer x n_head x (head_k + head_v)``. The ratio, 4,140 cells for the
    135M test model, errs on the side of fewer cuts: on a 2-core CPU without flash attention
    a ubatch measured 7.7 ms and a cell 3.7 us, about 2,100 cells."""
    head_k, head_v = head_dims(model)
    per_cell = model.n_layer * model.n_head * (head_k + head_v)
    return float(model.n_params) / per_cell if per_cell > 0 and model.n_params > 0 else 0.0


def draft_rows_below(config: EngineConfig, context: Context) -> int:
    """The bound on a tick's query rows per KV stream that drafts keep to
    (``SlotTable.draft_rows_below``; 0: none), so that a run with drafts computes each token's
    row as a run without them does, and near-tie greedy tokens do not flip.

    On the CPU, flash attention over an f16 or f32 cache computes a stream's rows one by one
    (the kernel of a decode) below :data:`CPU_FA_TILE_ROWS` rows in a ubatch and in 64 x 64
    tiles from there, which round otherwise: SmolLM2's answer asked again with ``suffix``
    (64-token drafts) parted from the first at its 31st token. Other caches (``q8_0``,
    ``bf16``) always take the one-row kernel; without flash attention, attention of two rows
    and more goes through another product than one row's whatever the drafts' length; a GPU's
    kernels were not checked."""
    cpu_tiles = config.flash_attn is True and config.n_gpu_layers == 0
    if cpu_tiles and context.type_k == context.type_v and context.type_k in ("f16", "f32"):
        return CPU_FA_TILE_ROWS
    return 0
