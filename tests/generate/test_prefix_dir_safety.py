"""The prefix directory (``prefix_cache_dir``) is untrusted, at start too: the scan opens only
regular files, never blocks, reads bounded headers, and refuses (logs, counts) a bad file
instead of raising; the directory has a size cap with least-recently-used pruning; the
counters tell a file llama.cpp loaded from one it refused.

Whatever could hang or exhaust memory under the old code runs in a child process with a
timeout (and a memory limit), so a regression fails instead of stalling the suite."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from llamabatch import LLM, SamplingParams, testing
from llamabatch.config import EngineConfig
from llamabatch.generate.prefix_store import (
    SUFFIX,
    PrefixStore,
    encode_prefix_file,
    read_prefix_file,
)

LAYOUT = "type_k=f16;type_v=f16;kv_unified=True;flash_attn=False"


@pytest.fixture
def store(tmp_path: Path) -> PrefixStore:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF not really a model")
    directory = tmp_path / "prefixes"
    return PrefixStore(directory, model, LAYOUT)


def _huge_count_file(store: PrefixStore) -> bytes:
    """A file of this model and layout whose header claims 2^32 - 1 tokens (the file is small)."""
    good = bytearray(encode_prefix_file(store.model_id, LAYOUT, np.arange(1, 41), b"x" * 100))
    struct.pack_into("<I", good, 48 + len(LAYOUT), 2**32 - 1)
    return bytes(good)


_SCAN_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from llamabatch.generate.prefix_store import PrefixStore

    directory, model, layout, limit_gib = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    store = PrefixStore(directory, model, layout)
    if limit_gib:  # what this process maps now, plus some: 16 GiB cannot be reserved
        vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (limit_gib << 30), resource.RLIM_INFINITY))
    indexed = store.scan(32)
    print(json.dumps({"indexed": indexed, "refused": store.refused}))
    """
)


def _scan_in_child(store: PrefixStore, limit_gib: int = 0) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCAN_CHILD, str(store.directory), str(store.directory.parent / "model.gguf"),
         LAYOUT, str(limit_gib)],
        capture_output=True,
        text=True,
        timeout=30,  # the old scan blocked forever on a FIFO's open()
    )  # fmt: skip
    assert proc.returncode == 0, f"the scan died ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_a_huge_token_count_is_refused_without_reading(store: PrefixStore):
    (store.directory / f"huge{SUFFIX}").write_bytes(_huge_count_file(store))
    good = encode_prefix_file(store.model_id, LAYOUT, np.arange(1, 41), b"y" * 100)
    (store.directory / f"good{SUFFIX}").write_bytes(good)
    assert _scan_in_child(store, limit_gib=2) == {"indexed": 1, "refused": 1}


def test_a_header_that_does_not_add_up_is_refused_in_process(store: PrefixStore, caplog):
    (store.directory / f"huge{SUFFIX}").write_bytes(_huge_count_file(store))
    (store.directory / f"junk{SUFFIX}").write_bytes(b"\xff" * 7)
    assert store.scan(32) == 0
    assert store.refused == 2
    assert "size mismatch" in caplog.text


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_never_blocks_the_scan(store: PrefixStore):
    os.mkfifo(store.directory / f"fifo{SUFFIX}")
    assert _scan_in_child(store) == {"indexed": 0, "refused": 1}
    assert store.load(np.arange(1, 41), 1 << 20) is None  # a load opens it without blocking too


def test_links_and_directories_are_refused_not_followed(store: PrefixStore, tmp_path: Path):
    tokens = np.arange(1, 41, dtype=np.int32)
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(encode_prefix_file(store.model_id, LAYOUT, tokens, b"z" * 100))
    os.symlink(target, store.path_for(tokens))
    (store.directory / f"dir{SUFFIX}").mkdir()
    assert store.scan(32) == 0
    assert store.refused == 2
    assert store.load(tokens, 1 << 20) is None and store.refused == 3
    assert target.exists()  # never touched


def _save(store: PrefixStore, k: int, payload_bytes: int, when: int) -> Path:
    tokens = np.arange(k * 100, k * 100 + 40, dtype=np.int32)
    assert store.save(tokens, bytes([k]) * payload_bytes)
    path = store.path_for(tokens)
    os.utime(path, ns=(when, when))  # a clear LRU order, whatever the clock's resolution
    return path


def test_the_directory_stays_under_its_cap_oldest_pruned_first(store: PrefixStore):
    one = len(encode_prefix_file(store.model_id, LAYOUT, np.arange(40), b"x" * 10_000))
    store.max_bytes = 3 * one + one // 2  # room for three files
    base = 1_700_000_000 * 10**9
    paths = [_save(store, k, 10_000, base + k * 10**9) for k in range(3)]
    assert all(p.exists() for p in paths)
    store.load(np.arange(0, 40, dtype=np.int32), 1 << 20)  # the oldest is used: now the newest
    paths += [_save(store, k, 10_000, base + (10 + k) * 10**9) for k in range(3, 5)]
    total = sum(p.stat().st_size for p in store.directory.glob(f"*{SUFFIX}"))
    assert total <= store.max_bytes
    assert [p.exists() for p in paths] == [True, False, False, True, True]
    assert store.pruned == 2
    assert not store.save(np.arange(40, dtype=np.int32) + 7, b"x" * store.max_bytes)  # bigger than the cap
    assert not list(store.directory.glob(".tmp-*"))


def test_the_cap_is_an_engine_option_and_a_flag(tmp_path: Path):
    assert EngineConfig().prefix_cache_dir_max_mb == 4096
    with pytest.raises(ValueError, match="prefix_cache_dir_max_mb"):
        EngineConfig(prefix_cache_dir_max_mb=0)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--prefix-cache-dir-max-mb", "5"])
    assert EngineConfig.from_cli_args(args).prefix_cache_dir_max_mb == 5


def _conversations(llm: LLM, n: int, n_tokens: int) -> list[list[int]]:
    words = " ".join(testing.english_sentences(300)).split()
    return [llm.tokenize(" ".join(words[41 * i :]))[:n_tokens] for i in range(n)]


PARAMS = SamplingParams(max_tokens=4, temperature=0)


def _close_with_a_ram_tier(path: str, options: dict, cap_bytes: int | None = None) -> list[list[int]]:
    """Three conversations over two slots, then close: the RAM tier goes to files (under
    ``cap_bytes`` when given: finer than the option's MiB, for the tiny model's states)."""
    with LLM(path, **options) as llm:
        store = llm.core.kv.store
        assert store.max_bytes == options.get("prefix_cache_dir_max_mb", 4096) << 20
        if cap_bytes is not None:
            store.max_bytes = cap_bytes
        convs = _conversations(llm, 3, 120)
        for conv in convs:
            llm.generate(conv, PARAMS)
    return convs


def test_the_engine_keeps_the_directory_under_its_cap(tiny_path, tmp_path: Path):
    options = dict(n_ctx=2048, n_parallel=2, flash_attn=False, cache_ram=64, prefix_cache_dir=str(tmp_path))
    _close_with_a_ram_tier(tiny_path, options)
    sizes = sorted(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}"))
    assert len(sizes) >= 2
    for p in tmp_path.glob(f"*{SUFFIX}"):
        p.unlink()
    cap = sizes[-1] + sizes[0] // 2  # the biggest file fits, not two files
    _close_with_a_ram_tier(tiny_path, {**options, "prefix_cache_dir_max_mb": 7}, cap_bytes=cap)
    kept = list(tmp_path.glob(f"*{SUFFIX}"))
    assert len(kept) == 1 and kept[0].stat().st_size <= cap


def test_a_state_llama_cpp_refuses_counts_as_refused_not_loaded(tiny_path, tmp_path: Path):
    options = dict(n_ctx=2048, n_parallel=2, flash_attn=False, cache_ram=64, prefix_cache_dir=str(tmp_path))
    convs = _close_with_a_ram_tier(tiny_path, options)
    with LLM(tiny_path, **options) as llm:
        store = llm.core.kv.store
        model_id, layout = store.model_id, store.layout
    for path in tmp_path.glob(f"*{SUFFIX}"):  # valid headers and checksums, state cut in half
        tokens, payload = read_prefix_file(path.read_bytes(), model_id, layout)
        path.write_bytes(encode_prefix_file(model_id, layout, tokens, payload[: len(payload) // 2]))
    with LLM(tiny_path, **options) as llm:
        out = llm.generate(convs[0] + [5, 6, 7], PARAMS)[0].outputs[0]
        stats = llm.stats()
    assert len(out.token_ids) == PARAMS.max_tokens  # computed instead
    assert (stats.prefix_files_loaded, stats.prefix_files_refused) == (0, 1), stats
    assert stats.ram_cache_restores == 0
