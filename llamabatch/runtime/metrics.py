"""Prometheus metrics for an ``LLM`` and an ``Embedder``, with vLLM's metric names.

:class:`PrometheusListener` is both a telemetry listener (it counts ``RequestEvent``,
``TickEvent`` and ``EmbedPackEvent`` as they happen) and a ``prometheus_client`` collector
that reads ``stats()`` of the engines it watches at scrape time for the gauges. It registers
itself in its own ``CollectorRegistry`` by default (pass ``registry=prometheus_client.REGISTRY``
to join the process-wide one an app already exports)::

    from llamabatch.runtime.metrics import PrometheusListener

    metrics = PrometheusListener()
    metrics.attach(llm)                  # listener + gauges; also metrics.attach(embedder)
    text = metrics.generate_latest()     # the exposition text a /metrics endpoint returns

Names follow vLLM's ``vllm:`` metrics with a ``llamabatch:`` prefix and a ``model_name``
label (the GGUF's file stem unless given):

========================================================  ===========================================
``llamabatch:num_requests_running`` / ``_waiting``        gauges: completions in slots / queued
``llamabatch:kv_cache_usage_perc``                        gauge: KV cells in use / all (0..1)
``llamabatch:num_preemptions_total``                      counter: requests preempted and recomputed
``llamabatch:prompt_tokens_total``                        counter: prompt tokens of finished requests
``llamabatch:generation_tokens_total``                    counter: generated tokens
``llamabatch:request_success_total{finished_reason}``     counter: finished requests by finish reason
``llamabatch:time_to_first_token_seconds``                histogram (submit to first token)
``llamabatch:inter_token_latency_seconds``                histogram, one observation per token gap
``llamabatch:e2e_request_latency_seconds``                histogram (submit to finish)
``llamabatch:request_queue_time_seconds``                 histogram (submit to slot)
``llamabatch:request_prompt_tokens`` / ``_generation_``   histograms of tokens per request
``llamabatch:prefix_cache_queries_total`` / ``_hits_``    counters: prompt tokens / of them reused
``llamabatch:iteration_tokens_total``                     counter: tokens decoded by forward passes
``llamabatch:embedding_*``                                packs, sequences, tokens, pack utilisation
``llamabatch:spec_decode_num_drafts_total``               counter: drafts verified (speculative decoding)
``llamabatch:spec_decode_num_draft_tokens_total``         counter: draft tokens verified
``llamabatch:spec_decode_num_accepted_tokens_total``      counter: draft tokens accepted
``llamabatch:spec_decode_num_accepted_tokens_per_pos``    counter{position}: accepted, by draft position
``llamabatch:slo_requests_total`` / ``slo_met_total``     counters: requests with an SLO / that met it
========================================================  ===========================================

The ``spec_decode_*`` counters are llama-server's (``llamacpp:spec_decode_*``) and vLLM's names.

A request with ``n > 1`` counts as ``n`` completions (each finishes on its own).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from llamabatch.runtime.telemetry import EmbedPackEvent, RequestEvent, TickEvent

__all__ = ["PrometheusListener"]

PREFIX = "llamabatch:"

# Buckets (seconds / tokens) in the spirit of vLLM's, extended down for small local models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
UTILISATION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _Histogram:
    """A histogram that takes weighted observations (``count`` equal values in one step)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # le: value <= bound
        self.total += value * count

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


_HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time to first token (from submission).", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between consecutive generated tokens.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Request latency from submission to finish.", E2E_BUCKETS),
    "request_queue_time_seconds": ("Time a request waited in the queue for a slot.", E2E_BUCKETS),
    "request_prompt_tokens": ("Prompt tokens per finished request.", TOKEN_BUCKETS),
    "request_generation_tokens": ("Generated tokens per finished request.", TOKEN_BUCKETS),
    "embedding_pack_utilisation": ("Tokens of an embedding pack / its capacity.", UTILISATION_BUCKETS),
}

_COUNTERS = {
    "prompt_tokens": "Prompt tokens of finished requests.",
    "generation_tokens": "Generated tokens of finished requests.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens reused from the prefix cache (not recomputed).",
    "iteration_tokens": "Tokens computed by forward passes (prompt and generated).",
    "forward_passes": "Forward passes (ticks) of the generation engine.",
    "decode_retries": "Forward passes retried with a smaller batch (no KV room).",
    "num_preemptions": "Running requests preempted under KV pressure (recomputed later).",
    "embedding_packs": "Packed decodes of the embedder.",
    "embedding_sequences": "Texts embedded.",
    "embedding_tokens": "Tokens of embedded texts.",
    "embedding_failed": "Texts that could not be embedded.",
    "slo_requests": "Finished requests that had an SLO (slo_ttft_ms / slo_itl_ms).",
    "slo_met": "Finished requests that met their SLO (goodput: slo_met / slo_requests).",
}


class _ModelMetrics:
    """What one model_name label accumulates from events."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self.finish: dict[str, int] = {}
        self.histograms = {name: _Histogram(bounds) for name, (_, bounds) in _HISTOGRAMS.items()}


class PrometheusListener:
    """A telemetry listener and Prometheus collector for llamabatch engines.

    Args:
        registry: where to register (default: a new ``CollectorRegistry``, kept in
            ``self.registry``); ``None`` registers nowhere (add it yourself).
        model_name: the ``model_name`` label of events this object receives directly
            (``llm.add_listener(listener)``); ``attach`` picks one per engine.

    Call ``attach(llm_or_embedder)`` to count its events and report its ``stats()`` gauges;
    ``detach`` undoes it. Listener calls are cheap (a lock, a few additions): they run on the
    engine's worker thread.
    """

    def __init__(self, registry: Any = "new", *, model_name: str = "llamabatch") -> None:
        from prometheus_client import CollectorRegistry

        self.model_name = model_name
        self._lock = threading.Lock()
        self._models: dict[str, _ModelMetrics] = {}
        # weak: a closed and dropped engine disappears from the scrape on its own
        self._sources: weakref.WeakKeyDictionary[Any, tuple[str, Any]] = weakref.WeakKeyDictionary()
        self.registry = CollectorRegistry(auto_describe=True) if registry == "new" else registry
        if self.registry is not None:
            self.registry.register(self)

    # -- wiring ----------------------------------------------------------------------------

    def attach(self, source: Any, model_name: str | None = None) -> None:
        """Count ``source``'s events (an ``LLM`` or an ``Embedder``) and read its ``stats()``
        at scrape time, under ``model_name`` (default: the GGUF file's stem)."""
        if source in self._sources:
            raise ValueError(f"{source!r} is already attached")
        name = model_name or _default_name(source)

        def listener(event: Any) -> None:
            self.observe(event, name)

        source.add_listener(listener)
        with self._lock:
            self._sources[source] = (name, listener)
            self._models.setdefault(name, _ModelMetrics())

    def detach(self, source: Any) -> None:
        """Stop counting ``source``'s events and reporting its gauges (its counts stay)."""
        with self._lock:
            entry = self._sources.pop(source, None)
        if entry is not None:
            source.remove_listener(entry[1])

    def __call__(self, event: Any) -> None:
        """The listener protocol: ``llm.add_listener(metrics)`` (labelled ``self.model_name``)."""
        self.observe(event, self.model_name)

    def generate_latest(self) -> bytes:
        """The registry's metrics in Prometheus' text format."""
        from prometheus_client import generate_latest

        if self.registry is None:
            raise ValueError("this PrometheusListener was made with registry=None")
        return generate_latest(self.registry)

    # -- events ----------------------------------------------------------------------------

    def observe(self, event: Any, model_name: str) -> None:
        """Account one telemetry event under ``model_name``."""
        with self._lock:
            m = self._models.get(model_name)
            if m is None:
                m = self._models[model_name] = _ModelMetrics()
            if isinstance(event, RequestEvent):
                _on_request(m, event)
            elif isinstance(event, TickEvent):
                c = m.counters
                c["iteration_tokens"] += event.batch_tokens
                c["forward_passes"] += 1
                c["decode_retries"] += event.decode_retries
                c["num_preemptions"] += event.preemptions
            elif isinstance(event, EmbedPackEvent):
                c = m.counters
                c["embedding_packs"] += 1
                c["embedding_sequences"] += event.sequences
                c["embedding_tokens"] += event.tokens
                c["embedding_failed"] += event.failed_sequences
                m.histograms["embedding_pack_utilisation"].observe(event.utilisation)

    # -- the collector -----------------------------------------------------------------------

    def describe(self) -> Iterable[Any]:
        return list(self.collect())

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            models = {
                name: (
                    dict(m.counters),
                    dict(m.finish),
                    {k: (h.buckets(), h.total) for k, h in m.histograms.items()},
                )
                for name, m in self._models.items()
            }
            sources = [(source, name) for source, (name, _) in self._sources.items()]
        label = ["model_name"]

        for key, doc in _COUNTERS.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=label)
            for name, (counters, _, _) in models.items():
                family.add_metric([name], counters[key])
            yield family
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for name, (_, finish, _) in models.items():
            for reason, n in sorted(finish.items()):
                success.add_metric([name, reason], n)
        yield success
        for key, (doc, _) in _HISTOGRAMS.items():
            histogram = HistogramMetricFamily(PREFIX + key, doc, labels=label)
            for name, (_, _, histograms) in models.items():
                buckets, total = histograms[key]
                histogram.add_metric([name], buckets, total)
            yield histogram

        yield from self._gauges(sources, GaugeMetricFamily)
        yield from _spec_counters(sources, CounterMetricFamily)
        yield from _by_reason(
            sources,
            CounterMetricFamily,
            "ram_cache_restore_skipped",
            "Host-RAM prompt states matched but not loaded (the prompt computed), by reason.",
            "ram_cache_restore_skipped",
        )
        yield from _by_reason(
            sources,
            CounterMetricFamily,
            "layout_switches",
            "Context rebuilds with another KV layout / flash attention, by reason.",
            "layout_switch_reasons",
        )
        yield from _lora(sources, CounterMetricFamily, GaugeMetricFamily)

    def _gauges(self, sources: list[tuple[Any, str]], gauge: Any) -> Iterator[Any]:
        def family(kind: Any, key: str, doc: str) -> Any:
            return kind(PREFIX + key, doc, labels=["model_name"])

        running = family(gauge, "num_requests_running", "Completions in slots (prefill or decode).")
        waiting = family(gauge, "num_requests_waiting", "Completions queued for a slot.")
        slots = family(gauge, "num_slots", "Sequence slots (n_parallel).")
        kv = family(gauge, "kv_cache_usage_perc", "KV cache cells in use / all cells (0..1).")
        cached = family(gauge, "prefix_cache_tokens", "Prompt tokens kept in the KV cache for reuse.")
        emb_waiting = family(gauge, "embedding_queue_texts", "Texts waiting to be embedded.")
        invariant = family(gauge, "batch_invariant", "1: outputs do not depend on the batch.")
        tier = {key: family(gauge, key, doc) for key, doc in _TIER_GAUGES.items()}
        for source, name in sources:
            try:
                stats = source.stats()
            except Exception:  # a closed engine: nothing to report
                continue
            if _get(stats, "n_parallel") is None:  # an Embedder
                _add(emb_waiting, name, _get(stats, "queue_depth"))
                continue
            _add(running, name, _get(stats, "num_requests_running", "running", "busy_slots"))
            _add(waiting, name, _get(stats, "num_requests_waiting", "waiting", "queue_depth"))
            _add(slots, name, _get(stats, "n_parallel"))
            _add(cached, name, _get(stats, "cached_prefix_tokens"))
            mode = _get(stats, "batch_invariant")
            _add(invariant, name, None if mode is None else int(bool(mode)))
            used, total = _get(stats, "kv_cells_used"), _get(stats, "kv_cells_total")
            usage = _get(stats, "kv_cache_usage")
            if usage is None and used is not None and total:
                usage = used / total
            _add(kv, name, usage)
            for key, tier_family in tier.items():
                _add(tier_family, name, _get(stats, key))
        yield from (running, waiting, slots, kv, cached, invariant, emb_waiting)
        yield from tier.values()


#: the host-RAM prompt cache and prefix files (``GenerationStats`` fields of the same names);
#: the counts are totals since the engine started
_TIER_GAUGES = {
    "ram_cache_bytes": "Bytes of prompt states held in the host-RAM prompt cache.",
    "ram_cache_entries": "Prompt states held in the host-RAM prompt cache.",
    "ram_cache_hits": "Admissions whose prompt matched a host-RAM state better than the KV cache.",
    "ram_cache_misses": "Admissions whose prompt matched no better host-RAM state.",
    "ram_cache_saves": "Prompt states saved to the host-RAM cache.",
    "ram_cache_restores": "Prompt states loaded back from the host-RAM cache.",
    "ram_cache_evictions": "Host-RAM prompt states dropped for room (the biggest client's oldest).",
    "ram_cache_restore_failures": "Host-RAM prompt states llama.cpp refused to load.",
    "ram_cache_restored_tokens": "Prompt tokens restored from the host-RAM cache instead of computed.",
    "ram_cache_shared_tokens": "Restored tokens then shared with another sequence's KV cells (no copy).",
    "ram_cache_restore_waits": "Prompts that waited for running requests to free their restore's room.",
    "ram_cache_clients": "Clients holding prompt states in the host-RAM cache.",
    "ram_cache_largest_client_bytes": "Bytes of host-RAM prompt states the biggest client holds.",
    "layout_switch_time_s": "Seconds spent rebuilding the context for another KV layout.",
    "layout_carried_tokens": "Cached prompt tokens carried through KV layout switches.",
    "layout_lost_tokens": "Cached prompt tokens a KV layout switch could not carry.",
    "slot_moves": "Decoding sequences moved into a gap among busy KV streams (fewer passes a tick).",
    "prefix_files_loaded": "Prefix files from prefix_cache_dir whose state llama.cpp loaded.",
    "prefix_files_refused": "Prefix files refused (unsafe, corrupt, over a limit, or by llama.cpp).",
    "swa_prefix_recomputed": "Cached prefixes computed again: a sliding-window cache lost their window.",
    "spec_history_bytes": "Bytes of text the n-gram and suffix speculation methods draft from.",
    "grammar_cache_hits": "Grammar masks found in the grammar cache (no pass over the vocabulary).",
    "grammar_cache_passes": "Grammar masks made by a pass over the vocabulary, then kept.",
    "grammar_cache_bytes": "Bytes of grammar masks held in the grammar cache.",
    "encoder_images": "Images in admitted prompts (mmproj).",
    "encoder_encoded": "Images run through the image encoder.",
    "encoder_cache_hits": "Images whose embeddings the encoder cache served (no encode).",
    "encoder_cache_evictions": "Image embeddings the encoder cache dropped for room.",
    "encoder_cache_bytes": "Bytes of image embeddings held in the encoder cache.",
    "encoder_image_positions": "Prompt positions computed up to images' ends (image prompts).",
    "encoder_image_slices": "Ticks that computed a slice of image-prompt positions.",
    "encoder_encode_time_s": "Seconds spent in the image encoder.",
}


_SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("spec_drafts", "Speculative decoding: drafts verified."),
    "spec_decode_num_draft_tokens": ("spec_draft_tokens", "Speculative decoding: draft tokens verified."),
    "spec_decode_num_accepted_tokens": (
        "spec_accepted_tokens",
        "Speculative decoding: draft tokens accepted.",
    ),
    "spec_decode_num_grammar_draft_tokens": (
        "spec_grammar_draft_tokens",
        "Speculative decoding: draft tokens of text a grammar forced (among the draft tokens).",
    ),
    "spec_decode_num_grammar_accepted_tokens": (
        "spec_grammar_accepted_tokens",
        "Speculative decoding: draft tokens of text a grammar forced, accepted.",
    ),
}


def _spec_counters(sources: list[tuple[Any, str]], counter: Any) -> Iterator[Any]:
    """Speculative decoding's totals (``GenerationStats.spec_*``), as llama-server names them."""
    families = {
        key: counter(PREFIX + key, doc, labels=["model_name"]) for key, (_, doc) in _SPEC_COUNTERS.items()
    }
    per_pos = counter(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Speculative decoding: accepted draft tokens by draft position.",
        labels=["model_name", "position"],
    )
    for source, name in sources:
        try:
            stats = source.stats()
        except Exception:  # a closed engine: nothing to report
            continue
        if _get(stats, "spec_drafts") is None:  # an Embedder, or an engine without the fields
            continue
        for key, (field_name, _) in _SPEC_COUNTERS.items():
            families[key].add_metric([name], _get(stats, field_name))
        for position, n in enumerate(_get(stats, "spec_accepted_per_pos") or ()):
            per_pos.add_metric([name, str(position)], n)
    yield from families.values()
    yield per_pos


def _by_reason(
    sources: list[tuple[Any, str]], counter: Any, metric: str, doc: str, field_name: str
) -> Iterator[Any]:
    """A counter by reason, from a ``{reason: n}`` field of each source's ``stats()``."""
    family = counter(PREFIX + metric, doc, labels=["model_name", "reason"])
    for source, name in sources:
        try:
            stats = source.stats()
        except Exception:  # a closed engine: nothing to report
            continue
        for reason, n in sorted((_get(stats, field_name) or {}).items()):
            family.add_metric([name, reason], n)
    yield family


_LORA_COUNTERS = {
    "lora_switches": "Changes of the context's LoRA adapter set.",
    "lora_loads": "LoRA adapters loaded into llama.cpp.",
    "lora_unloads": "LoRA adapters unloaded (least recently used, or unregistered).",
}


def _lora(sources: list[tuple[Any, str]], counter: Any, gauge: Any) -> Iterator[Any]:
    """LoRA adapters (``GenerationStats.lora_*``): switches, the fitted switch cost, the
    adapters loaded, and admissions by adapter set; engines without LoRA report nothing."""
    label = ["model_name"]
    counters = {key: counter(PREFIX + key, doc, labels=label) for key, doc in _LORA_COUNTERS.items()}
    seconds = gauge(
        PREFIX + "lora_switch_seconds",
        "Fitted extra seconds of a tick after the LoRA adapter set changed.",
        labels=label,
    )
    loaded = gauge(PREFIX + "lora_loaded_adapters", "LoRA adapters loaded into llama.cpp now.", labels=label)
    requests = counter(
        PREFIX + "lora_requests",
        "Admitted requests by LoRA adapter set ((base): none).",
        labels=["model_name", "adapter_set"],
    )
    for source, name in sources:
        try:
            stats = source.stats()
        except Exception:  # a closed engine: nothing to report
            continue
        by_set = _get(stats, "lora_requests")
        if not by_set:  # no LoRA, or nothing admitted yet
            continue
        for key, family in counters.items():
            family.add_metric([name], _get(stats, key))
        seconds.add_metric([name], _get(stats, "lora_switch_seconds"))
        loaded.add_metric([name], len(_get(stats, "lora_loaded") or ()))
        for adapter_set, n in sorted(by_set.items()):
            requests.add_metric([name, adapter_set], n)
    yield from counters.values()
    yield from (seconds, loaded, requests)


def _on_request(m: _ModelMetrics, event: RequestEvent) -> None:
    c, h = m.counters, m.histograms
    c["prompt_tokens"] += event.prompt_tokens
    c["generation_tokens"] += event.completion_tokens
    c["prefix_cache_queries"] += event.prompt_tokens
    c["prefix_cache_hits"] += event.reused_tokens
    m.finish[event.finish_reason] = m.finish.get(event.finish_reason, 0) + 1
    if event.slo_met is not None:
        c["slo_requests"] += 1
        c["slo_met"] += event.slo_met
    h["e2e_request_latency_seconds"].observe(event.total)
    h["request_queue_time_seconds"].observe(event.queue_wait)
    h["request_prompt_tokens"].observe(event.prompt_tokens)
    h["request_generation_tokens"].observe(event.completion_tokens)
    ttft = event.time_to_first_token
    if ttft is not None:
        h["time_to_first_token_seconds"].observe(ttft)
        gaps = event.completion_tokens - 1
        if event.inter_token_latencies:  # every gap, as vLLM observes them
            itl = h["inter_token_latency_seconds"]
            for gap in event.inter_token_latencies:
                itl.observe(gap)
        elif gaps > 0:
            # The engine reports each request's mean gap; observing it once per gap keeps the
            # histogram's sum and count exact (vLLM observes every gap).
            h["inter_token_latency_seconds"].observe(max(0.0, event.total - ttft) / gaps, gaps)


def _get(stats: Any, *names: str) -> Any:
    for name in names:
        value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
        if value is not None:
            return value
    return None


def _add(family: Any, name: str, value: Any) -> None:
    if value is not None:
        family.add_metric([name], float(value))


def _default_name(source: Any) -> str:
    model = getattr(source, "model", None)
    path = getattr(model, "path", None)
    return getattr(path, "stem", None) or type(source).__name__
