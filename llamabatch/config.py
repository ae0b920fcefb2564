"""``EngineConfig``: every option of the generation engine, its default and its check, once.

``LLM``, ``LLMEngine``, ``llamabatch generate``, ``serve``, ``bench`` and ``bench-soak`` take
their engine options from here (as vLLM's ``EngineArgs``):

>>> config = EngineConfig(n_parallel=4, kv_unified=True)
>>> config.n_prefixes  # max_prefixes=None: 4 with a unified KV cache and the prefix cache
4

The command-line flags are generated from the fields' metadata by :meth:`EngineConfig.add_cli_args`
(names and aliases follow llama.cpp's ``llama-server``), and :meth:`EngineConfig.from_cli_args`
reads them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from llamabatch.config_checks import (
    SLO_REJECT,
    batch_invariant_conflict,
    check_count,
    check_merge_lora,
    check_milliseconds,
    lora_adapter_pairs,
    on_off,
    parse_flash_attn,
    positive_float,
    positive_int,
)
from llamabatch.generate.spec_config import (
    add_spec_cli_args,
    spec_cli_argv,
    spec_config_from_cli,
    validate_speculative_config,
)
from llamabatch.params import check_positive_int
from llamabatch.prompts.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    check_image_options,
)

if TYPE_CHECKING:
    from llamabatch.strategies import Strategy

__all__ = [
    "KV_TYPE_NAMES",
    "STRATEGY_NAMES",
    "EngineConfig",
    "on_off",
    "parse_flash_attn",
    "positive_float",
    "positive_int",
]

#: the built-in batching strategies, by name
STRATEGY_NAMES = ("decode_maximal", "prefill_priority", "balanced")
#: ``--spec-type`` values (llama-server's names), see ``generate/spec_config.py``
SPEC_TYPES = ("ngram", "suffix", "draft")
#: the host-RAM prompt cache's default budget in MiB (``cache_ram``; llama-server's ``--cache-ram``)
CACHE_RAM_DEFAULT_MIB = 8192
#: the grammar masks' default budget in MiB (``grammar_cache_mb``, ``_ffi/sampler.py``: ``GrammarMasks``)
GRAMMAR_CACHE_DEFAULT_MIB = 32
#: the prefix directory's default size cap in MiB (``prefix_cache_dir_max_mb``)
PREFIX_CACHE_DIR_MAX_MB = 4096
#: the KV cache types (``type_k`` / ``type_v``), llama.cpp's names (``llamabatch/_ffi/kv_types.py``)
KV_TYPE_NAMES = ("f16", "bf16", "f32", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def flag(*flags: str, **kwargs: Any) -> dict[str, Any]:
    """A field's command-line flag: its names (the first long one is the main one) and the
    ``add_argument`` keywords (``type``, ``help``, ``action``, ``metavar``, ``choices``)."""
    return {"cli": (flags, kwargs)}


class OptionsConfig:
    """What ``EngineConfig`` and ``EmbedderConfig`` share: copies, keyword options over a
    config, and reading their flags back from parsed arguments. Subclasses are frozen
    dataclasses whose flagged fields carry ``flag(...)`` metadata."""

    #: how an unknown-option error names the options ("engine", "Embedder")
    _options_of = "engine"

    def replace(self: _Config, **changes: Any) -> _Config:
        """A copy with ``changes`` applied (checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def cli_fields(cls) -> list[str]:
        """The fields that have a command-line flag, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if "cli" in f.metadata]  # type: ignore[arg-type]

    @classmethod
    def from_cli_args(cls: type[_Config], args: argparse.Namespace, **options: Any) -> _Config:
        """The config of parsed arguments (fields whose flags were not added keep their
        defaults); ``options`` override them."""
        values = {name: getattr(args, name) for name in cls.cli_fields() if hasattr(args, name)}
        return cls(**{**values, **options})

    @classmethod
    def from_options(cls: type[_Config], config: _Config | None = None, **options: Any) -> _Config:
        """``config`` (default: the defaults) with the keyword ``options`` applied over it:
        keywords win. ``TypeError`` names an unknown option."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
        if unknown:
            raise TypeError(f"unknown {cls._options_of} option(s): {', '.join(unknown)}")
        if config is None:
            return cls(**options)
        if not isinstance(config, cls):
            raise TypeError(f"config must be an {cls.__name__}, got {type(config).__name__}")
        return dataclasses.replace(config, **options) if options else config  # type: ignore[type-var]

    @classmethod
    def signature_of(cls, init: Callable[..., None]) -> Callable[..., None]:
        """Decorate ``init(self, model_path, *, config=None, ..., **options)`` so that ``help()``
        and ``inspect.signature`` show the config's fields as keyword parameters."""
        signature = inspect.signature(init)
        params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        params += [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        ]
        init.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return init


_Config = TypeVar("_Config", bound=OptionsConfig)


@dataclass(frozen=True)
class EngineConfig(OptionsConfig):
    """Every option of the generation engine (``LLM``, ``LLMEngine``), checked at construction.

    Args:
        n_ctx: the context of one request, in tokens: one unified buffer's size, or every
            stream's with one stream per sequence (``kv_unified=False`` given divides it among
            the streams instead, as llama.cpp does). ``None`` (default): the model's trained
            context (``n_ctx_train``), capped by the KV memory budget (a quarter of the
            machine's physical memory, ``generate/kv_memory.py``); ``stats()`` and a log line
            at load report the size, the KV bytes and the reason.
        n_parallel: sequences decoded together (slots), a cap. ``None`` (default): chosen at load
            by the KV memory and the tick's cost, at most 32 (``generate/slot_count.py``).
        n_batch: the most tokens in one forward pass, the per-tick budget (default 2048, llama.cpp's).
        n_ubatch: the physical micro-batch llama.cpp computes at once (default ``min(n_batch, 512)``).
        chunk_size: the most prompt tokens one sequence prefills per tick (default 2048: whole, as in
            llama-server; ``slo_itl_ms`` or ``target_itl_ms`` slice it where a stream's gap needs).
        strategy: ``"decode_maximal"`` (default), ``"prefill_priority"``, ``"balanced"``,
            or a strategy object (see ``llamabatch.strategies``).
        max_queue: requests allowed to wait for a slot; beyond it ``submit`` raises
            ``QueueFull``.
        max_request_memory_mb: the most memory one request may be estimated to take, in MiB
            (default 1024): a grammar parser per running completion, and every completion's
            ``max_tokens`` tokens with their log-probabilities
            (``generate/request_memory.py``); beyond it ``submit`` raises ``RequestTooLarge``.
        n_threads, n_threads_batch: CPU threads for llama.cpp (default: all cores).
        n_gpu_layers: layers to offload to a GPU (-1: all; needs a GPU build).
        flash_attn: ``True``, ``False`` or ``None``/``"auto"`` (default: chosen at load with
            the layout: off with one KV stream per sequence on the CPU, where decoding through
            matrix products is 1.2-2.6x faster than ggml's flash-attention kernel; on with one
            unified buffer, whose prompt chunks it keeps from multiplying against every other
            sequence's cells; on for a quantized ``type_v``; llama.cpp's choice on a GPU).
        load_mode: how the weights are loaded (``"mmap"``, ``"none"``, ...).
        prefix_cache: reuse the KV of a matching prompt prefix from any slot (busy or
            idle) or pinned prefix, copied with ``llama_memory_seq_cp`` (default on).
        max_prefixes: how many prefixes ``register_prefix`` may pin at once (default 4 with
            a unified KV cache, 0 with one stream per sequence, the layout chosen by default
            on the CPU where it fits, where each pinned prefix takes a stream of its own:
            ``n_ctx / (n_parallel + max_prefixes)`` cells); :attr:`n_prefixes` is the
            resolved number.
        kv_unified: ``True``: one buffer shared by all sequences (llama-server's automatic
            slots), any request may use up to ``n_ctx`` cells; requests are admitted while
            their prompts fit and preempted (recomputed later) when the cache fills.
            ``False``: one KV stream per sequence, ``n_ctx / (n_parallel + max_prefixes)``
            cells each, attention over a sequence's own cells only (the faster layout on
            the CPU for distinct prompts: README, "Memory"); with ``n_ctx=None`` every stream
            holds the model's whole trained context, under the same memory budget. ``None``
            (default): chosen at load (``generate/kv_memory.py``): one stream per sequence when
            the model runs on the CPU and a stream of the whole trained context (or of the
            given ``n_ctx``) for every sequence fits the per-stream budget (an eighth of
            physical memory); else unified. ``stats().kv_unified`` and ``kv_layout_reason``
            say which, and why.
        type_k, type_v: the KV cache element types, llama.cpp's names (``-ctk`` / ``-ctv``):
            ``"f16"`` (default), ``"bf16"``, ``"f32"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``,
            ``"iq4_nl"``, ``"q5_0"``, ``"q5_1"``. A quantized ``type_v`` needs flash attention
            (``flash_attn=False`` with one is refused).
        validate: check the GGUF file before llama.cpp reads it (see ``gguf_check``).
        cache_ram: the host-RAM prompt cache in MiB (``--cache-ram``, as llama-server):
            prompt prefixes leaving the KV cache are saved in host memory, least recently
            used out first, and loaded back when a new prompt matches them better than the
            KV cache does. Default 8192 (llama-server's), capped at a quarter of the physical
            memory; ``0`` or ``None``: off. See ``generate/ram_cache.py``.
        grammar_cache_mb: the grammar masks kept across requests, MiB (``--grammar-cache-mb``;
            default 32; 0: off): a grammar's matches against the whole vocabulary, found again
            by any request of that grammar in that state. See ``_ffi/sampler.py``.
        prefix_cache_dir: a directory for pinned prefixes' states (``None``: none). A pinned
            prefix is saved there once computed, and loaded instead of computed when the same
            model pins the same tokens again, after a restart too. Files are checked (model,
            layout, tokens, size, checksum) before loading; a bad one is refused and the
            prefix computed. See ``generate/prefix_store.py``.
        prefix_cache_dir_max_mb: the size cap of ``prefix_cache_dir`` in MiB (default 4096):
            before a file is written there, the least recently used prefix files are deleted
            until it fits.
        target_itl_ms: a target inter-token latency in milliseconds (default ``None``: no
            target). Each tick's token budget is then chosen so that the tick's expected
            decode time (a cost model fitted online, ``generate/cost_model.py``) stays under
            it: running streams always get their token, prompt chunks shrink (to one token
            a tick at least while a prompt is computed), and a request waits in the queue
            while one more decoding stream would push the ticks over it. Trades some prompt
            throughput and time to first token for a bounded inter-token latency.
        slo_ttft_ms, slo_itl_ms: service-level objectives in ms, on the time to first token
            and on every inter-token gap (default ``None``: none; per request: ``SamplingParams``):
            the engine then schedules for goodput, see ``generate/slo.py``. ``slo_reject``: refuse
            (``SLOUnmet``, the server's 503) a request the queue predicts late (default ``False``).
        priority_aging: how many admissions make a waiting request gain one priority level
            on the requests queued after it (default 8; 0: no aging, strict priorities as
            vLLM). A request ``d`` levels behind the best priority arriving is overtaken
            only by requests arriving within ``(d + 1) * priority_aging`` admissions after
            it, so none waits forever behind a stream of better priorities, and one that
            aged its way in is not preempted by them (``generate/priority.py``).
        speculative_config: speculative decoding (default ``None``: off), vLLM's keys:
            ``{"method": "ngram"}`` (drafts from the longest match in the request's own text,
            as long as they pay, up to ``num_speculative_tokens``, default 64),
            ``{"method": "suffix"}`` (the same, and from recent requests' prompts and outputs)
            or ``{"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": k}``;
            checked by ``generate/spec_config.py``, run by ``generate/speculative.py``. CLI:
            ``--spec-type ngram|suffix|draft``, ``--model-draft FILE``, ``--draft-max N``.
            With ``mmproj`` the lookups draft text only; a draft model is refused there.
        batch_invariant: ``True``: a request's tokens and log-probs are bit-identical
            whatever else runs (alone or with others, any arrival order, chunked prefill,
            prefix reuse, preemption, speculation). It decides one KV stream per sequence,
            flash attention on and a ``q8_0`` KV cache in place of the default ``f16``
            (``generate/batch_invariant.py``); ``kv_unified=True``, ``flash_attn=False``, an
            ``f32`` cache or ``n_gpu_layers != 0`` with it are refused, and so, at load, is a
            model whose matrices are F32/F16/BF16. Default ``False``.
        lora_adapters: LoRA adapters by name, ``{name: path}`` (or ``name=path`` / ``path``
            strings, as ``--lora``); a request picks them with ``SamplingParams(lora=...)``.
            Each file is checked against the model at load (``gguf/check_lora.py``).
        max_loras: the most adapters loaded in llama.cpp at once (least recently used ones
            are unloaded; never one a running request uses). Default: as many as
            ``lora_adapters`` names, 0 (LoRA off) when none; give it to load adapters at run
            time (``LLM.load_lora``) without any at start.
        merge_lora: merge the one adapter of ``lora_adapters`` into the model's weights at
            load (``gguf/merge_lora.py``: a merged GGUF, adapted tensors as F16, cached under
            ``$XDG_CACHE_HOME/llamabatch/merged``) and serve that: no per-token adapter cost and
            no switches; a request naming the adapter or none runs the merged weights, one asking
            for another adapter or scale is refused. Needs exactly one adapter. Default ``False``.

    Raises:
        ValueError: an option out of range, of the wrong type, or options that do not fit
            together (``n_parallel + max_prefixes`` over ``n_ctx`` or ``n_batch``).
    """

    n_ctx: int | None = field(
        default=None,
        metadata=flag(
            "-c",
            "--n-ctx",
            "--ctx-size",
            type=positive_int,
            help="one request's context in tokens, each stream's or the unified buffer's "
            "(default: the model's trained context, under the KV budget)",
        ),
    )
    n_parallel: int | None = field(
        default=None,
        metadata=flag(
            "-np", "--n-parallel", "--parallel", type=positive_int, help="sequences decoded together"
        ),
    )
    n_batch: int = field(
        default=2048,
        metadata=flag(
            "-b", "--n-batch", "--batch-size", type=positive_int, help="most tokens per forward pass"
        ),
    )
    n_ubatch: int | None = field(
        default=None,
        metadata=flag("-ub", "--n-ubatch", "--ubatch-size", type=positive_int, help="physical micro-batch"),
    )
    chunk_size: int = field(
        default=2048,
        metadata=flag("--chunk-size", type=positive_int, help="most prompt tokens per sequence per tick"),
    )
    strategy: str | Strategy = field(
        default="decode_maximal",
        metadata=flag("--strategy", choices=STRATEGY_NAMES, help="how each tick's token budget is shared"),
    )
    max_queue: int = field(
        default=1024,
        metadata=flag("--max-queue", type=positive_int, help="requests waiting for a slot (then QueueFull)"),
    )
    max_request_memory_mb: int = field(
        default=1024,
        metadata=flag(
            "--max-request-memory-mb",
            type=positive_int,
            metavar="MiB",
            help="the most memory one request may be estimated to take: grammar parsers x running "
            "completions, n x max_tokens tokens x logprobs (then a 400; default 1024)",
        ),
    )
    n_threads: int | None = field(
        default=None,
        metadata=flag("-t", "--threads", type=positive_int, help="CPU threads (default: all cores)"),
    )
    n_threads_batch: int | None = field(
        default=None,
        metadata=flag("-tb", "--threads-batch", type=positive_int, help="CPU threads for prompt batches"),
    )
    n_gpu_layers: int = field(
        default=0,
        metadata=flag("-ngl", "--n-gpu-layers", type=int, help="layers offloaded to a GPU (-1: all)"),
    )
    flash_attn: bool | str | None = field(
        default=None,
        metadata=flag(
            "-fa",
            "--flash-attn",
            type=parse_flash_attn,
            metavar="{on,off,auto}",
            help="flash attention (default: auto: off with a KV stream per sequence on the CPU, on with "
            "one unified buffer or a quantized V cache)",
        ),
    )
    load_mode: str = "mmap"
    prefix_cache: bool = field(
        default=True,
        metadata=flag(
            "--prefix-cache",
            action=argparse.BooleanOptionalAction,
            help="reuse cached prompt prefixes (--no-prefix-cache: do not)",
        ),
    )
    max_prefixes: int | None = None
    kv_unified: bool | None = field(
        default=None,
        metadata=flag(
            "--kv-unified",
            action=argparse.BooleanOptionalAction,
            help="one KV buffer shared by all sequences (--no-kv-unified: one stream per sequence, each "
            "the whole trained context unless -c is given; default: per-stream when -c is not given and "
            "the streams fit an eighth of physical memory on CPU, else unified)",
        ),
    )
    type_k: str = field(
        default="f16",
        metadata=flag("-ctk", "--cache-type-k", choices=KV_TYPE_NAMES, help="KV cache type for K"),
    )
    type_v: str = field(
        default="f16",
        metadata=flag("-ctv", "--cache-type-v", choices=KV_TYPE_NAMES, help="KV cache type for V"),
    )
    validate: bool = True
    target_itl_ms: float | None = field(
        default=None,
        metadata=flag(
            "--target-itl-ms",
            type=positive_float,
            help=(
                "target inter-token latency in ms: prompt chunks shrink, and requests wait for room, "
                "to keep each tick under it"
            ),
        ),
    )
    slo_ttft_ms: float | None = field(
        default=None,
        metadata=flag("--slo-ttft-ms", type=positive_float, help="SLO on the time to first token (ms)"),
    )
    slo_itl_ms: float | None = field(
        default=None,
        metadata=flag("--slo-itl-ms", type=positive_float, help="SLO on every inter-token gap (ms)"),
    )
    slo_reject: bool = field(default=False, metadata=SLO_REJECT)
    cache_ram: int | None = field(
        default=CACHE_RAM_DEFAULT_MIB,
        metadata=flag(
            "--cache-ram",
            type=int,
            metavar="MiB",
            help="host-RAM prompt cache in MiB: evicted prompt prefixes are kept there and restored "
            f"on a match (0: off; default {CACHE_RAM_DEFAULT_MIB}, as llama-server, capped at a quarter "
            "of physical memory)",
        ),
    )
    grammar_cache_mb: int = field(
        default=GRAMMAR_CACHE_DEFAULT_MIB,
        metadata=flag(
            "--grammar-cache-mb",
            type=int,
            metavar="MiB",
            help=f"grammar masks kept across requests, MiB (0: off; default {GRAMMAR_CACHE_DEFAULT_MIB})",
        ),
    )
    prefix_cache_dir_max_mb: int = field(
        default=PREFIX_CACHE_DIR_MAX_MB,
        metadata=flag(
            "--prefix-cache-dir-max-mb",
            type=positive_int,
            metavar="MiB",
            help="size cap of --prefix-cache-dir in MiB: the least recently used files are deleted "
            f"to make room (default {PREFIX_CACHE_DIR_MAX_MB})",
        ),
    )
    prefix_cache_dir: str | None = field(
        default=None,
        metadata=flag(
            "--prefix-cache-dir",
            metavar="PATH",
            help="a directory where pinned prefixes are saved, and loaded again after a restart",
        ),
    )
    priority_aging: int = field(
        default=8,
        metadata=flag(
            "--priority-aging",
            type=int,
            metavar="N",
            help="a waiting request gains one priority level per N admissions after it (0: no aging; "
            "default 8)",
        ),
    )

    batch_invariant: bool = field(
        default=False,
        metadata=flag(
            "--batch-invariant",
            action=argparse.BooleanOptionalAction,
            help="a request's tokens and log-probs are bit-identical whatever else runs (one KV stream "
            "per sequence, flash attention on, a q8_0 KV cache for the default f16)",
        ),
    )
    speculative_config: dict[str, Any] | None = field(
        default=None,
        hash=False,
        metadata=flag(
            "--spec-type",
            choices=SPEC_TYPES,
            help="speculative decoding: ngram (prompt lookup), suffix (ngram and recent requests' text) "
            "or draft (a draft model: --model-draft); --draft-max N drafts per step at most",
        ),
    )
    mmproj: str | None = field(
        default=None,
        metadata=flag("--mmproj", metavar="PATH", help="image encoder + projector GGUF (vision)"),
    )
    allow_remote_images: bool = field(
        default=False,
        metadata=flag(
            "--allow-remote-images",
            action=argparse.BooleanOptionalAction,
            help="fetch http(s) image URLs (public addresses only; default: data URLs)",
        ),
    )
    max_image_bytes: int = field(
        default=DEFAULT_MAX_IMAGE_BYTES,
        metadata=flag("--max-image-bytes", type=positive_int, metavar="N", help="most bytes of one image"),
    )
    max_image_pixels: int = field(
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metadata=flag("--max-image-pixels", type=positive_int, metavar="N", help="most pixels of one image"),
    )
    max_images_per_request: int = field(
        default=DEFAULT_MAX_IMAGES_PER_REQUEST,
        metadata=flag(
            "--max-images-per-request", type=positive_int, metavar="N", help="most images of one request"
        ),
    )

    lora_adapters: Any = field(
        default=None,
        hash=False,
        metadata=flag(
            "--lora",
            action="append",
            metavar="NAME=FILE",
            help="a LoRA adapter: name=file (vLLM), or a file (llama-server; named by its stem); repeatable",
        ),
    )
    max_loras: int | None = field(
        default=None,
        metadata=flag(
            "--max-loras",
            type=int,
            metavar="N",
            help="the most LoRA adapters loaded at once (default: as many as --lora names)",
        ),
    )
    merge_lora: bool = field(
        default=False,
        metadata=flag(
            "--merge-lora",
            action=argparse.BooleanOptionalAction,
            help="merge the one --lora adapter into the weights at load and serve the merged model",
        ),
    )

    def __post_init__(self) -> None:
        from llamabatch.strategies import get_strategy

        object.__setattr__(self, "speculative_config", validate_speculative_config(self.speculative_config))
        check_image_options(self)
        object.__setattr__(self, "lora_adapters", lora_adapter_pairs(self.lora_adapters))
        max_loras = self.max_loras
        check_count("max_loras", max_loras, " or None", none_ok=True)
        if max_loras == 0 and self.lora_adapters:
            raise ValueError("max_loras=0 switches LoRA off, but lora_adapters names adapters")
        check_merge_lora(self.merge_lora, self.lora_adapters, max_loras, self.batch_invariant)

        for name in ("n_batch", "chunk_size", "max_queue", "max_request_memory_mb"):
            check_positive_int(name, getattr(self, name))
        for name in ("n_ctx", "n_parallel"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPE_NAMES:
                choices = ", ".join(KV_TYPE_NAMES)
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.type_v not in ("f16", "bf16", "f32") and self.flash_attn is False:
            raise ValueError(
                f"type_v={self.type_v}: a quantized V cache needs flash attention (flash_attn=False was "
                "given; use flash_attn=None/'auto' or True, or a type_v of f16, bf16 or f32)"
            )
        for name in ("prefix_cache", "kv_unified", "validate", "batch_invariant", "slo_reject"):
            flag = getattr(self, name)
            if not isinstance(flag, bool) and not (name == "kv_unified" and flag is None):
                choices = "True, False or None (chosen at load)" if name == "kv_unified" else "True or False"
                raise ValueError(f"{name} must be {choices}, got {flag!r}")
        if self.batch_invariant:
            conflict = batch_invariant_conflict(self)
            if conflict:
                raise ValueError(conflict)
        for name in ("target_itl_ms", "slo_ttft_ms", "slo_itl_ms"):
            check_milliseconds(name, getattr(self, name))
        check_count("priority_aging", self.priority_aging, " (0: no aging)")
        check_count("cache_ram", self.cache_ram, " (MiB; 0 or None: off)", none_ok=True)
        check_count("grammar_cache_mb", self.grammar_cache_mb, " (MiB; 0: off)")
        cache_dir = self.prefix_cache_dir
        if cache_dir is not None and (not isinstance(cache_dir, (str, os.PathLike)) or not str(cache_dir)):
            raise ValueError(f"prefix_cache_dir must be a directory path or None, got {cache_dir!r}")
        check_positive_int("prefix_cache_dir_max_mb", self.prefix_cache_dir_max_mb)
        max_prefixes = self.max_prefixes
        if max_prefixes is not None and (
            not isinstance(max_prefixes, int) or isinstance(max_prefixes, bool) or not 0 <= max_prefixes <= 64
        ):
            raise ValueError(f"max_prefixes must be an int in [0, 64], got {max_prefixes!r}")
        try:
            get_strategy(self.strategy)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"strategy: {exc}") from None
        n_seq_max = self.n_seq_max
        if self.n_ctx is not None and n_seq_max > self.n_ctx:
            raise ValueError(f"n_parallel + max_prefixes ({n_seq_max}) must be <= n_ctx ({self.n_ctx})")
        if self.n_batch < n_seq_max:
            # llama.cpp sizes its output buffer by n_batch and aborts when a batch has more
            # outputs (one per decoding sequence) than that
            raise ValueError(f"n_batch ({self.n_batch}) must be >= n_parallel + max_prefixes ({n_seq_max})")

    @property
    def n_prefixes(self) -> int:
        """``max_prefixes`` resolved: 4 with a unified KV cache and the prefix cache, else 0
        (with ``kv_unified=None``, 4 until the layout is chosen at load, so that the checks
        above hold for either layout)."""
        if self.max_prefixes is not None:
            return self.max_prefixes
        return 4 if self.kv_unified is not False and self.prefix_cache else 0

    @property
    def n_ubatch_resolved(self) -> int:
        """``n_ubatch`` resolved: as given, else ``min(n_batch, 512)`` (llama.cpp's default)."""
        return self.n_ubatch if self.n_ubatch is not None else min(self.n_batch, 512)

    @property
    def n_loras(self) -> int:
        """``max_loras`` resolved: as many as ``lora_adapters`` names when not given (0: off;
        0 with ``merge_lora``, whose adapter is in the weights)."""
        if self.merge_lora:
            return 0
        return self.max_loras if self.max_loras is not None else len(self.lora_adapters)

    @property
    def n_seq_max(self) -> int:
        """llama.cpp sequences: the slots (``None``: one until the load), plus one per pinned prefix."""
        return (self.n_parallel or 1) + self.n_prefixes

    # -- the command line -----------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser | Any,
        *,
        only: Iterable[str] | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Add the engine's flags to ``parser`` (or an argument group), each with its field's
        name as ``dest`` and its default (shown in ``--help``).

        ``only`` picks fields (default: every field that has a flag); ``overrides`` replaces
        ``add_argument`` keywords per field (a benchmark's own default, say), and ``"flags"``
        the option strings (a subcommand that always spelled a flag its own way)."""
        names = list(only) if only is not None else cls.cli_fields()
        overrides = overrides or {}
        defaults = {f.name: f for f in dataclasses.fields(cls)}
        for name in names:
            spec = defaults[name]
            if "cli" not in spec.metadata:
                raise ValueError(f"EngineConfig.{name} has no command-line flag")
            flags, kwargs = spec.metadata["cli"]
            kwargs = {"default": spec.default, **kwargs, **overrides.get(name, {})}
            flags = kwargs.pop("flags", flags)
            if kwargs.get("action") is not None:
                kwargs.pop("type", None)
                kwargs.pop("metavar", None)
            else:
                kwargs.pop("action", None)
                if "metavar" not in kwargs and "choices" not in kwargs:  # as argparse names the flag
                    main = next(f for f in flags if f.startswith("--"))
                    kwargs["metavar"] = main[2:].upper().replace("-", "_")
            help_text = kwargs.get("help")
            if help_text is not None and "default" not in help_text:
                kwargs["help"] = f"{help_text} (default: {_shown(name, kwargs['default'])})"
            parser.add_argument(*flags, dest=name, **kwargs)
        if "speculative_config" in names:
            add_spec_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **options: Any) -> EngineConfig:  # type: ignore[override]
        """The config of parsed arguments (``--spec-type``/``--model-draft``/``--draft-max``
        make ``speculative_config``); ``options`` override them."""
        if "speculative_config" not in options and hasattr(args, "spec_model_draft"):
            options["speculative_config"] = spec_config_from_cli(args)
        return super().from_cli_args(args, **options)

    def to_cli_args(self, only: Iterable[str] | None = None) -> list[str]:
        """The command line that :meth:`from_cli_args` reads back as this config (the fields
        with a flag; a strategy object has none)."""
        argv: list[str] = []
        for name in only if only is not None else self.cli_fields():
            flags, kwargs = _field(name).metadata["cli"]
            main = next(f for f in flags if f.startswith("--"))
            value = getattr(self, name)
            if value is None:  # the default: "auto" or "none"
                continue
            if kwargs.get("action") is argparse.BooleanOptionalAction:
                argv.append(main if value else "--no-" + main[2:])
            elif name == "speculative_config":
                argv += spec_cli_argv(value)
            elif name == "flash_attn":
                argv += [main, "on" if value is True else "off" if value is False else "auto"]
            elif name == "lora_adapters":
                argv += [item for adapter, path in value for item in (main, f"{adapter}={path}")]
            elif name == "strategy" and not isinstance(value, str):
                raise ValueError("a strategy object has no command-line form")
            else:
                argv += [main, str(value)]
        return argv


def options_signature(init: Callable[..., None]) -> Callable[..., None]:
    """Show ``init(self, model_path, *, config=None, ..., **options)`` with ``EngineConfig``'s
    fields as keyword parameters (``help()``, ``inspect.signature``): the options spelt out."""
    return EngineConfig.signature_of(init)


def _shown(name: str, default: Any) -> str:
    """A default as ``--help`` shows it."""
    if default is None:
        return "auto" if name in ("flash_attn", "n_ctx", "kv_unified", "n_parallel") else "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _field(name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
