"""The request lifecycle (``RequestStatus`` and its edges), typed step outputs, and the one
engine configuration (``EngineConfig``: defaults, checks, command-line flags)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_llama import make_core, patch_llamabatch

import llamabatch
from llamabatch import EngineConfig, LLMEngine, RequestStatus, SamplingParams
from llamabatch.cli import build_parser
from llamabatch.generate.core import CoreOutput
from llamabatch.generate.request import STATUS_EDGES, InvalidTransition, Request, RequestKind

S = RequestStatus
ENDS = [S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_CANCELLED, S.FINISHED_ERROR]
ALLOWED = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.FINISHED_CANCELLED),
    (S.WAITING, S.FINISHED_ERROR),
    (S.RUNNING, S.PREEMPTED),
    *((S.RUNNING, end) for end in ENDS),
    (S.PREEMPTED, S.RUNNING),
    (S.PREEMPTED, S.FINISHED_CANCELLED),
    (S.PREEMPTED, S.FINISHED_ERROR),
}


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _at(status: RequestStatus) -> Request:
    """A request brought to ``status`` along allowed edges."""
    request = Request([1, 2, 3], greedy(4))
    path = {
        S.WAITING: [],
        S.RUNNING: [S.RUNNING],
        S.PREEMPTED: [S.RUNNING, S.PREEMPTED],
        S.FINISHED_TOOL_CALLS: None,
    }.get(status, [S.RUNNING, status])
    if path is None:
        request.status = status  # no edge leads here: the chat layer labels outputs with it
    else:
        for step in path:
            request.transition(step)
    return request


# -- RequestStatus -----------------------------------------------------------------------------


def test_status_is_public_and_names_its_finish_reasons():
    assert llamabatch.RequestStatus is RequestStatus
    assert [s.finish_reason for s in ENDS] == ["stop", "length", "cancelled", "error"]
    assert S.FINISHED_TOOL_CALLS.finish_reason == "tool_calls"
    for status in (S.WAITING, S.RUNNING, S.PREEMPTED):
        assert not status.finished and status.finish_reason is None
    assert all(s.finished for s in [*ENDS, S.FINISHED_TOOL_CALLS])
    assert RequestStatus.finished_with("length") is S.FINISHED_LENGTH
    with pytest.raises(ValueError):
        RequestStatus.finished_with("running")  # type: ignore[arg-type]


@pytest.mark.parametrize("old", list(RequestStatus))
@pytest.mark.parametrize("new", list(RequestStatus))
def test_transitions_follow_exactly_the_allowed_edges(old, new):
    assert ((old, new) in ALLOWED) == (new in STATUS_EDGES[old])
    request = _at(old)
    if (old, new) in ALLOWED:
        request.transition(new)
        assert request.status is new
    else:
        with pytest.raises(InvalidTransition, match=f"{old.name} -> {new.name}"):
            request.transition(new)
        assert request.status is old  # a refused edge changes nothing


def test_a_request_ends_once_and_its_end_names_its_status():
    request = _at(S.RUNNING)
    assert request.finish("length") == ""
    assert request.status is S.FINISHED_LENGTH and request.done
    assert request.output is not None and request.output.finish_reason == "length"
    assert request.finish("error") is None  # the second end is ignored
    assert request.status is S.FINISHED_LENGTH


def test_kinds_are_explicit():
    leader = Request([1, 2], greedy(2))
    follower = Request([1, 2], greedy(2), index=1, leader=leader)
    pinner = Request([1, 2], greedy(1), pin=object())
    assert (leader.kind, follower.kind, pinner.kind) == (
        RequestKind.COMPLETION,
        RequestKind.FOLLOWER,
        RequestKind.PIN,
    )


# -- the engine's typed outputs ----------------------------------------------------------------


def test_core_step_returns_typed_outputs_carrying_the_status():
    core, _, _ = make_core(n_parallel=2)
    a = Request([1, 2, 3], greedy(3))
    b = Request([4, 5, 6], greedy(8))
    core.add([a, b])
    assert core.requests == {a.arrival: a, b.arrival: b}
    assert a.status is S.WAITING
    seen: list[CoreOutput] = []
    while core.has_unfinished():
        outs = core.step()
        assert all(isinstance(o, CoreOutput) for o in outs)
        seen += outs
        if b.status is S.RUNNING and a.done:
            core.abort(b)
    assert {o.status for o in seen if o.finish_reason is None} == {S.RUNNING}
    ends = {o.request.request_id: o for o in seen if o.finish_reason is not None}
    assert ends[a.request_id].status is S.FINISHED_LENGTH
    assert ends[b.request_id].status is S.FINISHED_CANCELLED
    assert core.requests == {}  # finished requests are forgotten
    assert core.slots.slot_of(a) == -1 and core.running == [None, None]


def test_llm_engine_step_outputs_carry_the_status(monkeypatch):
    patch_llamabatch(monkeypatch)
    engine = LLMEngine("fake.gguf", config=EngineConfig(n_ctx=256, n_parallel=2, n_batch=16))
    engine.context.batch = engine.core.batch
    assert engine.config.n_parallel == 2
    rid = engine.add_request([1, 2, 3], greedy(4))
    statuses = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            statuses.append(out.status)
            assert out.status.finish_reason == out.finish_reason
    assert statuses[-1] is S.FINISHED_LENGTH and set(statuses[:-1]) == {S.RUNNING}
    engine.close()


# -- EngineConfig ------------------------------------------------------------------------------

DEFAULTS = {
    "n_ctx": None,  # the model's trained context, under the KV budget (generate/kv_memory.py)
    "n_parallel": None,  # chosen at load by the KV memory and the tick's cost (generate/slot_count.py)
    "n_batch": 2048,
    "n_ubatch": None,
    "chunk_size": 2048,
    "strategy": "decode_maximal",
    "max_queue": 1024,
    "n_threads": None,
    "n_threads_batch": None,
    "n_gpu_layers": 0,
    "flash_attn": None,
    "load_mode": "mmap",
    "prefix_cache": True,
    "max_prefixes": None,
    "kv_unified": None,  # chosen at load (generate/kv_memory.py: choose_layout)
    "type_k": "f16",
    "type_v": "f16",
    "validate": True,
    "prefix_cache_dir_max_mb": 4096,  # the prefix directory's size cap (generate/prefix_store.py)
    "priority_aging": 8,  # a waiting request gains a level per 8 admissions (generate/priority.py)
    "target_itl_ms": None,
    "slo_ttft_ms": None,  # no SLO: scheduling as without (generate/slo.py)
    "slo_itl_ms": None,
    "slo_reject": False,  # a request predicted late still waits (generate/slo.py: check_slo)
    "cache_ram": 8192,  # MiB, as llama-server's --cache-ram (capped at a quarter of physical memory)
    "grammar_cache_mb": 32,  # MiB of grammar masks kept across requests (_ffi/sampler.py)
    "prefix_cache_dir": None,
    "max_request_memory_mb": 1024,  # a request's estimated memory (generate/request_memory.py)
    "speculative_config": None,  # off; {"method": "ngram" | "draft_model", ...} (generate/spec_config.py)
    "batch_invariant": False,  # outputs may depend on the batch (generate/batch_invariant.py)
    "mmproj": None,  # no image encoder (generate/vision.py)
    "allow_remote_images": False,  # data URLs only (prompts/images.py)
    "max_image_bytes": 20 << 20,
    "max_image_pixels": 16 << 20,
    "max_images_per_request": 8,
    "lora_adapters": (),  # no LoRA adapter (generate/lora_schedule.py)
    "max_loras": None,
    "merge_lora": False,  # adapters applied per tick, not merged at load (generate/lora_merge.py)
}


def test_config_defaults_and_frozen():
    config = EngineConfig()
    assert dataclasses.asdict(config) == DEFAULTS
    assert config.n_prefixes == 4 and config.n_seq_max == 5  # n_parallel=None counts 1 until the load
    assert EngineConfig(kv_unified=False).n_prefixes == 0
    assert EngineConfig(kv_unified=True, prefix_cache=False).n_prefixes == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_ctx = 8  # type: ignore[misc]
    assert config.replace(n_parallel=2).n_parallel == 2
    # llama.cpp's batch sizes: a 2,048-token tick in 512-token micro-batches
    assert (config.n_batch, config.n_ubatch_resolved) == (2048, 512)
    assert EngineConfig(n_batch=256).n_ubatch_resolved == 256
    assert EngineConfig(n_ubatch=1024).n_ubatch_resolved == 1024


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_ctx": 0}, "n_ctx"),
        ({"n_parallel": -1}, "n_parallel"),
        ({"n_batch": 1.5}, "n_batch"),
        ({"chunk_size": True}, "chunk_size"),
        ({"max_queue": 0}, "max_queue"),
        ({"max_request_memory_mb": 0}, "max_request_memory_mb"),
        ({"kv_unified": 1}, r"kv_unified must be True, False or None \(chosen at load\)"),
        ({"prefix_cache": "no"}, "prefix_cache must be True or False"),
        ({"validate": None}, "validate must be True or False"),
        ({"max_prefixes": 65}, r"max_prefixes must be an int in \[0, 64\]"),
        ({"strategy": "fastest"}, "strategy"),
        ({"n_ctx": 8, "n_parallel": 9}, r"n_parallel \+ max_prefixes \(13\) must be <= n_ctx \(8\)"),
        ({"n_batch": 4, "n_parallel": 8}, r"n_batch \(4\) must be >= n_parallel \+ max_prefixes \(12\)"),
        ({"type_k": "q3"}, "type_k must be one of"),
        ({"type_v": "q4_0", "flash_attn": False}, "needs flash attention"),
        ({"cache_ram": -1}, "cache_ram must be an int >= 0"),
        ({"grammar_cache_mb": -1}, "grammar_cache_mb must be an int >= 0"),
        ({"grammar_cache_mb": True}, "grammar_cache_mb must be an int >= 0"),
        ({"prefix_cache_dir_max_mb": 0}, "prefix_cache_dir_max_mb"),
        ({"prefix_cache_dir": 3}, "prefix_cache_dir must be a directory path"),
        ({"speculative_config": {"method": "ngram", "k": 3}}, r"speculative_config: unknown keys \['k'\]"),
    ],
)
def test_config_checks_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    with pytest.raises(ValueError, match=message):  # replace() checks again
        EngineConfig().replace(**options)


def test_config_and_keywords_combine_keywords_winning():
    base = EngineConfig(n_parallel=2, n_ctx=512)
    assert EngineConfig.from_options(base) is base
    assert EngineConfig.from_options(base, n_ctx=1024) == EngineConfig(n_parallel=2, n_ctx=1024)
    assert EngineConfig.from_options(None, n_ctx=1024) == EngineConfig(n_ctx=1024)
    with pytest.raises(TypeError, match=r"unknown engine option.*n_slots"):
        EngineConfig.from_options(base, n_slots=3)
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        EngineConfig.from_options({"n_ctx": 8})  # type: ignore[arg-type]


def test_llm_engine_takes_a_config_and_keywords(monkeypatch):
    patch_llamabatch(monkeypatch)
    config = EngineConfig(n_ctx=256, n_parallel=2, n_batch=16, kv_unified=True)
    engine = LLMEngine("fake.gguf", config=config, n_parallel=4)
    # the config as resolved at load: one unified buffer, so flash attention on
    resolved = config.replace(n_parallel=4, flash_attn=True)
    assert engine.config == resolved and engine.n_parallel == 4
    engine.close()
    with pytest.raises(TypeError, match="n_slots"):
        LLMEngine("fake.gguf", n_slots=4)


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return {a.dest: a for a in parser._actions}["command"].choices[name]


def _flags(parser: argparse.ArgumentParser) -> dict[str, tuple[tuple[str, ...], object]]:
    return {a.dest: (tuple(a.option_strings), a.default) for a in parser._actions if a.option_strings}


# The flags every command had before EngineConfig generated them: names, aliases, defaults.
SERVE_FLAGS = {
    "n_parallel": (("-np", "--n-parallel", "--parallel"), None),  # chosen at load (slot_count.py)
    "n_ctx": (("-c", "--n-ctx", "--ctx-size"), None),
    "kv_unified": (("--kv-unified",), None),
    "type_k": (("-ctk", "--cache-type-k"), "f16"),
    "type_v": (("-ctv", "--cache-type-v"), "f16"),
    "n_batch": (("-b", "--n-batch", "--batch-size"), 2048),
    "n_ubatch": (("-ub", "--n-ubatch", "--ubatch-size"), None),
    "n_threads": (("-t", "--threads"), None),
    "n_threads_batch": (("-tb", "--threads-batch"), None),
    "n_gpu_layers": (("-ngl", "--n-gpu-layers"), 0),
    "max_queue": (("--max-queue",), 1024),
    "chunk_size": (("--chunk-size",), 2048),
    "strategy": (("--strategy",), "decode_maximal"),
}
GENERATE_FLAGS = {
    "n_ctx": (("-c", "--n-ctx"), None),
    "n_parallel": (("--n-parallel",), None),
    "n_batch": (("-b", "--n-batch"), 2048),
    "n_threads": (("-t", "--threads"), None),
    "strategy": (("--strategy",), "decode_maximal"),
}
BENCH_FLAGS = {
    "n_threads": (("-t", "--threads"), None),
    "n_ctx": (("-c", "--n-ctx"), None),
    "n_batch": (("-b", "--n-batch"), 512),
    "n_ubatch": (("-ub", "--n-ubatch"), None),
    "chunk_size": (("--chunk-size",), 512),
    "n_parallel": (("--n-parallel",), None),
    "strategy": (("--strategy",), "decode_maximal"),
    "flash_attn": (("-fa", "--flash-attn"), None),  # LLM's choice for the layout (off with --kv-unified off)
    "kv_unified": (("--kv-unified",), False),
    "prefix_cache": (("--prefix-cache",), False),
}


def test_bench_flash_attn_defaults_to_llms_choice_for_the_layout():
    from llamabatch.bench.options import config_from_args
    from llamabatch.cli import build_parser

    def flash(*argv: str) -> bool:
        return config_from_args(build_parser().parse_args(["bench", "-m", "tiny", *argv])).flash_attn

    from llamabatch.generate.kv_memory import per_stream_flash_attn

    assert flash() is per_stream_flash_attn() and flash("--kv-unified", "on") is True
    assert flash("-fa", "on") is True and flash("--kv-unified", "on", "-fa", "off") is False


@pytest.mark.parametrize(
    ("command", "expected"), [("serve", SERVE_FLAGS), ("generate", GENERATE_FLAGS), ("bench", BENCH_FLAGS)]
)
def test_cli_flags_keep_their_names_aliases_and_defaults(command, expected):
    flags = _flags(_subparser(command))
    for dest, (names, default) in expected.items():
        assert dest in flags, f"{command}: no flag for {dest}"
        got_names, got_default = flags[dest]
        assert set(names) <= set(got_names), f"{command} {dest}: {got_names}"
        assert got_default == default, f"{command} {dest}: default {got_default!r}"
    help_text = _subparser(command).format_help()
    for names, _ in expected.values():
        assert all(name in help_text for name in names)


def test_serve_keeps_its_boolean_flags():
    parser = _subparser("serve")
    assert EngineConfig.from_cli_args(parser.parse_args(["-m", "x.gguf"])) == EngineConfig()
    args = parser.parse_args(["-m", "x", "--kv-unified", "--no-prefix-cache", "-fa", "off", "-np", "2"])
    assert EngineConfig.from_cli_args(args) == EngineConfig(
        kv_unified=True, prefix_cache=False, flash_attn=False, n_parallel=2
    )
    assert parser.parse_args(["-m", "x", "-fa", "on"]).flash_attn is True
    assert parser.parse_args(["-m", "x", "--parallel", "3", "--ctx-size", "64"]).n_parallel == 3


def test_bench_keeps_its_on_off_flags():
    parser = _subparser("bench")
    args = parser.parse_args(["--kv-unified", "on", "-fa", "off", "--prefix-cache"])
    assert (args.kv_unified, args.flash_attn, args.prefix_cache) == (True, False, True)


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(),
        EngineConfig(n_ctx=1024, n_parallel=2, n_batch=64, n_ubatch=32, chunk_size=16, max_queue=7),
        EngineConfig(strategy="balanced", n_threads=2, n_threads_batch=3, n_gpu_layers=-1, flash_attn=True),
        EngineConfig(kv_unified=True, prefix_cache=False, flash_attn=False),
        EngineConfig(lora_adapters={"a": "/x/a.gguf", "b": "/x/b.gguf"}, max_loras=1, mmproj="/x/mm.gguf"),
    ],
)
def test_from_cli_args_round_trips(config):
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(config.to_cli_args())) == config


def test_generate_reads_its_config_from_the_flags():
    parser = _subparser("generate")
    args = parser.parse_args(["-c", "512", "--n-parallel", "2", "-t", "3", "--max-queue", "9", "hi"])
    assert EngineConfig.from_cli_args(args) == EngineConfig(n_ctx=512, n_parallel=2, n_threads=3, max_queue=9)
