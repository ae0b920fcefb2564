"""Telemetry: per-tick and per-request events, listeners, and the ``stats()`` aggregate.

Listeners are callables taking one event (``TickEvent``, ``RequestEvent`` or
``EmbedPackEvent``); they run on the worker thread, so they should be quick. An
exception in a listener is logged and never stops the worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("llamabatch")


@dataclass(frozen=True)
class TickEvent:
    """One forward pass of the generation engine."""

    tick: int
    batch_tokens: int
    decode_tokens: int
    prefill_tokens: int
    busy_slots: int
    queue_depth: int
    decode_time: float
    tick_time: float
    decode_retries: int = 0
    #: running requests preempted (recomputed later) to make room in this tick
    preemptions: int = 0
    #: KV cells in use after the tick (shared cells counted once), and in all
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    #: the tick's token budget (``n_batch``, or less under ``target_itl_ms``)
    token_budget: int = 0
    #: the decode time the cost model predicted for the tick's batch (seconds; None: no target)
    predicted_time: float | None = None


@dataclass(frozen=True)
class RequestEvent:
    """One request ended."""

    request_id: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    queue_wait: float
    time_to_first_token: float | None
    total: float
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    #: times the request was preempted under KV pressure and recomputed
    preemptions: int = 0
    #: which of the prompt's ``n`` completions this is (``SamplingParams(n=...)``)
    index: int = 0
    n: int = 1
    #: the request's inter-token latencies: p50, p99, max (seconds; None under 2 tokens)
    itl_p50: float | None = None
    itl_p99: float | None = None
    itl_max: float | None = None
    #: every gap between the request's tokens (seconds), in order
    inter_token_latencies: tuple[float, ...] = ()
    #: whether it met its SLOs (``Timings.slo_met``; None: it had none)
    slo_met: bool | None = None
    #: of ``reused_tokens``, the prefix another sequence held too when it was admitted (a
    #: prefix shared among requests, not one request's own cache reused)
    shared_tokens: int = 0


@dataclass(frozen=True)
class EmbedPackEvent:
    """One packed decode of the embedder."""

    pack: int
    sequences: int
    tokens: int
    capacity: int
    utilisation: float
    queue_wait: float
    decode_time: float
    decode_retries: int
    #: distinct calls (``embed``/``aembed``) whose texts share the pack
    callers: int = 1
    #: ``llama_decode`` calls the pack took (1 + retries after failures)
    decodes: int = 1
    #: texts of the pack that failed (could not be decoded even alone)
    failed_sequences: int = 0
    #: tokens still queued when the pack was taken
    pending_tokens: int = 0


@dataclass
class GenerationCounters:
    """Running totals of the generation engine, written by its thread only."""

    ticks: int = 0
    batch_tokens: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    #: busy slots summed over ticks (divided by ``ticks``: the mean batch occupancy)
    busy_slot_ticks: int = 0
    decode_time: float = 0.0
    tick_time: float = 0.0
    decode_retries: int = 0
    requests: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    preemptions: int = 0
    #: prompt and generated tokens computed again after a preemption
    recomputed_tokens: int = 0
    evictions: int = 0
    #: decoding sequences moved into a gap among busy KV streams (``generate/compaction.py``)
    slot_moves: int = 0
    #: speculative decoding: drafts verified, their tokens, those accepted (and by position)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    #: finished requests with an SLO (``slo_ttft_ms`` / ``slo_itl_ms``), and those that met it
    slo_requests: int = 0
    slo_met: int = 0


@dataclass(frozen=True, kw_only=True)
class EncoderStats:
    """The image encoder's figures in ``GenerationStats`` and ``EmbedderStats`` (``mmproj``:
    ``generate/vision.py``, ``embed/images.py``; all 0 without one): images in admitted
    prompts, those encoded and those the encoder cache served, images the cache dropped for
    room, its bytes now, image-prompt positions computed, the ticks that computed some (the
    generation engine's slices), and the seconds spent encoding and decoding them."""

    encoder_images: int = 0
    encoder_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_evictions: int = 0
    encoder_cache_bytes: int = 0
    encoder_image_positions: int = 0
    encoder_image_slices: int = 0
    encoder_encode_time_s: float = 0.0
    encoder_image_decode_time_s: float = 0.0


@dataclass(frozen=True)
class GenerationStats(EncoderStats):
    """``LLM.stats()`` / ``LLMEngine.stats()``: a snapshot of the engine and its totals.

    Rates are over the time spent in ticks. ``reused_tokens`` of the ``prompt_tokens`` came
    from the prefix cache; ``prefill_tokens`` is what was computed (including recomputation
    after preemptions, ``recomputed_tokens``)."""

    n_parallel: int
    busy_slots: int
    queue_depth: int
    ticks: int
    requests: int
    finish_reasons: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    batch_tokens: int
    decode_tokens: int
    prefill_tokens: int
    mean_busy_slots: float
    decode_time_s: float
    tick_time_s: float
    tokens_per_s: float
    generated_tokens_per_s: float
    decode_retries: int
    preemptions: int
    recomputed_tokens: int
    evictions: int
    prefix_cache: bool
    cached_prefix_tokens: int
    pinned_prefixes: int
    kv_cells_used: int
    kv_cells_total: int
    # -- the KV cache's size and cost (``generate/kv_memory.py``) --
    #: KV cells, all sequences together, and why that many (the model's trained context,
    #: the KV budget's cap, or ``n_ctx`` given)
    n_ctx: int = 0
    n_ctx_reason: str = ""
    #: the KV layout (one buffer for all sequences, or a stream per sequence), and why: given,
    #: or chosen at load by ``kv_unified=None`` (``generate/kv_memory.py``: ``choose_layout``)
    kv_unified: bool = True
    kv_layout_reason: str = ""
    #: why ``n_parallel`` slots: given, or chosen at load (``generate/slot_count.py``)
    n_parallel_reason: str = ""
    #: flash attention: on, off, or None (llama.cpp's choice, with layers on a GPU); with
    #: ``flash_attn=None`` chosen at load by the layout (``choose_flash_attn``)
    flash_attn: bool | None = None
    #: the KV cache element types (llama.cpp's names)
    kv_type_k: str = "f16"
    kv_type_v: str = "f16"
    #: ``batch_invariant=True``: each request's tokens and log-probs do not depend on what
    #: else runs (``generate/batch_invariant.py``)
    batch_invariant: bool = False
    #: the KV cache's bytes, and what it would take at f16
    kv_bytes: int = 0
    kv_bytes_f16: int = 0
    #: the byte budget the default ``n_ctx`` obeys (None: ``n_ctx`` given, or memory unknown)
    kv_budget_bytes: int | None = None
    # -- the host-RAM prompt cache (``cache_ram``, ``generate/ram_cache.py``) --
    #: its budget (0: off), the bytes and saved prefixes it holds
    ram_cache_budget_bytes: int = 0
    ram_cache_bytes: int = 0
    ram_cache_entries: int = 0
    #: admissions whose prompt matched a saved prefix better than the KV cache (hits) or not
    ram_cache_hits: int = 0
    ram_cache_misses: int = 0
    #: states saved, loaded back, dropped for room; loads llama.cpp refused
    ram_cache_saves: int = 0
    ram_cache_restores: int = 0
    ram_cache_evictions: int = 0
    ram_cache_restore_failures: int = 0
    #: prompt tokens restored from host RAM instead of computed
    ram_cache_restored_tokens: int = 0
    #: of those, tokens then shared with another sequence's cells instead of kept as a copy
    ram_cache_shared_tokens: int = 0
    #: hits not loaded (their prompts computed), by reason: ``"room_held_by_running"`` (running
    #: requests hold the cells the state needs), ``"state_dropped"`` (it left the RAM budget),
    #: ``"sliding_window"`` (a sliding-window model's state continues only from its end)
    ram_cache_restore_skipped: dict[str, int] = field(default_factory=dict)
    #: prompts that waited for running requests to free the room of their restore
    ram_cache_restore_waits: int = 0
    #: clients holding saved states now (``client=``; the server's peer addresses; the caller
    #: counts as one), and the bytes the biggest holds (over budget, it gives up states first)
    ram_cache_clients: int = 0
    ram_cache_largest_client_bytes: int = 0
    #: admissions on a sliding-window model whose longest cached prefix was computed again:
    #: its sliding cache no longer held the window there (``generate/swa.py``)
    swa_prefix_recomputed: int = 0
    # -- the KV layout following the workload (``generate/layout_switch.py``) --
    #: context rebuilds with another layout, by reason (``"shared_prefix"``, ``"long_prompt"``,
    #: ``"independent"``), their total time, and the cached tokens carried over or lost
    layout_switches: int = 0
    layout_switch_reasons: dict[str, int] = field(default_factory=dict)
    layout_switch_time_s: float = 0.0
    layout_carried_tokens: int = 0
    layout_lost_tokens: int = 0
    #: decoding sequences moved into a gap among busy KV streams, so that a tick decodes
    #: fewer runs of consecutive streams (``generate/compaction.py``)
    slot_moves: int = 0
    # -- persistent prefixes (``prefix_cache_dir``, ``generate/prefix_store.py``) --
    #: prefix files whose state llama.cpp loaded, files written, files refused (not a
    #: regular file, corrupt, over a limit, another model or layout, or refused by llama.cpp)
    prefix_files_loaded: int = 0
    prefix_files_saved: int = 0
    prefix_files_refused: int = 0
    # -- speculative decoding (``speculative_config``, ``generate/speculative.py``) --
    #: drafts verified (one per speculating sequence and tick), their tokens, and those
    #: accepted (acceptance = accepted / draft tokens); accepted tokens by draft position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    #: the text the n-gram and suffix methods draft from: tokens and approximate bytes held
    #: (the running requests' own histories and, for ``suffix``, the shared one, bounded by
    #: ``suffix_cache_tokens``)
    spec_history_tokens: int = 0
    spec_history_bytes: int = 0
    #: drafts of the text a grammar request's grammar forces (``grammar_drafts``,
    #: ``generate/spec_grammar.py``): drafts verified, their tokens, and those accepted (also
    #: counted in ``spec_drafts`` and the totals above)
    spec_grammar_drafts: int = 0
    spec_grammar_draft_tokens: int = 0
    spec_grammar_accepted_tokens: int = 0
    # -- service-level objectives (``slo_ttft_ms``, ``slo_itl_ms``, ``generate/slo.py``) --
    #: finished requests that had an SLO, and those that met it (goodput: their ratio)
    slo_requests: int = 0
    slo_met: int = 0
    # -- grammar masks kept across requests (``grammar_cache_mb``, ``_ffi/sampler.py``) --
    #: masks found instead of a pass of the grammar over the vocabulary, masks made by such a
    #: pass, and the masks and bytes held
    grammar_cache_hits: int = 0
    grammar_cache_passes: int = 0
    grammar_cache_entries: int = 0
    grammar_cache_bytes: int = 0
    # -- LoRA adapters (``lora_adapters``, ``generate/lora_schedule.py``) --
    #: changes of the context's adapter set, the fitted extra seconds of a tick after one (a
    #: prior until ``lora_switches_measured`` > 0), adapters loaded into llama.cpp now (least
    #: recently used first), loads and unloads, and admissions by adapter set (``"a"``,
    #: ``"a*0.5+b"``; ``"(base)"``: none; past 64 sets, ``"(other)"``)
    lora_switches: int = 0
    lora_switch_seconds: float = 0.0
    lora_switches_measured: int = 0
    lora_loaded: tuple[str, ...] = ()
    lora_loads: int = 0
    lora_unloads: int = 0
    lora_requests: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        """Share of the KV cells in use (0..1)."""
        return self.kv_cells_used / self.kv_cells_total if self.kv_cells_total else 0.0

    @property
    def kv_bytes_saved(self) -> int:
        """KV bytes saved by ``type_k`` / ``type_v`` against an f16 cache."""
        return self.kv_bytes_f16 - self.kv_bytes


@dataclass
class EmbedderCounters:
    """Running totals of the embedder's packs, written by its worker thread only (under the
    embedder's lock, so that ``stats()`` copies a consistent set)."""

    packs: int = 0
    decodes: int = 0
    #: texts taken into packs (``failed_sequences`` of them could not be embedded)
    sequences: int = 0
    failed_sequences: int = 0
    tokens: int = 0
    decode_retries: int = 0
    #: seconds from a text's call to its pack's start, summed over texts; the longest
    queue_wait: float = 0.0
    queue_wait_max: float = 0.0
    decode_time: float = 0.0
    pack_time: float = 0.0


@dataclass(frozen=True)
class EmbedderStats(EncoderStats):
    """``Embedder.stats()``: the embedder's settings, its totals and what is queued.

    ``texts`` counts the texts of all calls; ``sequences`` those taken into packs (texts
    without any token need no decode), ``failed_sequences`` of which could not be embedded.
    Rates are over the time spent in packs."""

    pooling: str
    #: the most tokens one pack holds (``n_seq_max``: the most texts)
    capacity: int
    n_seq_max: int
    calls: int
    texts: int
    packs: int
    decodes: int
    sequences: int
    failed_sequences: int
    tokens: int
    decode_retries: int
    tokens_per_pack: float
    sequences_per_pack: float
    #: tokens / (packs * capacity), 0..1
    utilisation: float
    queue_wait_mean_s: float
    queue_wait_max_s: float
    decode_time_s: float
    pack_time_s: float
    texts_per_s: float
    tokens_per_s: float
    #: tokens and texts queued, not yet in a pack
    pending_tokens: int
    queue_depth: int


Listener = Callable[[Any], None]


class Telemetry:
    """The listeners of one engine; ``emit`` calls them (on the worker thread).

    Running totals are typed dataclasses of their own (``GenerationCounters``,
    ``EmbedderCounters``), kept by the engines."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def add_listener(self, listener: Listener) -> None:
        if not callable(listener):
            raise TypeError("a listener must be callable")
        with self._lock:
            self._listeners = [*self._listeners, listener]

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = [x for x in self._listeners if x is not listener]

    @property
    def has_listeners(self) -> bool:
        return bool(self._listeners)

    def emit(self, event: Any) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("llamabatch telemetry listener %r raised; ignored", listener)
