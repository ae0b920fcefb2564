"""Fuzzing the prefix files of ``prefix_cache_dir``: no file may crash the process or be
loaded unchecked.

Two levels, as ``test_fuzz_gguf.py`` does for models:

* the file format (``read_prefix_file``), in process: truncations at every length, bit
  flips, header fields set to extreme values (each with the checksum recomputed too, so the
  structural checks are reached), another model, layout or tokens. Every mutant raises
  ``PrefixFileError`` (a ``ValueError``), or is byte-identical in meaning to the original;
* llama.cpp's own state bytes, in a child process: files with a valid header and checksum
  but a mutated payload, loaded by ``LLM.register_prefix``. Each is loaded or refused
  (counted in ``prefix_files_refused``, the prefix computed), the engine then generates;
  a child killed by a signal is a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from llamabatch.generate.prefix_store import (
    PrefixFileError,
    encode_prefix_file,
    read_prefix_file,
)

MODEL = hashlib.sha256(b"model").digest()
LAYOUT = "type_k=f16;type_v=f16;kv_unified=True;flash_attn=False"
TOKENS = np.arange(1, 41, dtype=np.int32)
PAYLOAD = bytes(range(256)) * 3
GOOD = encode_prefix_file(MODEL, LAYOUT, TOKENS, PAYLOAD)


def _resum(data: bytes) -> bytes:
    """``data`` with its trailing checksum made right again (to reach the structural checks)."""
    body = data[:-32] if len(data) >= 32 else data
    return body + hashlib.sha256(body).digest()


def _mutants(seed: int, n: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out: list[tuple[str, bytes]] = []
    fields = {  # offset, struct format of the header's fields
        "version": (8, "<I"),
        "layout_len": (44, "<I"),
        "n_tokens": (48 + len(LAYOUT), "<I"),
        "n_payload": (52 + len(LAYOUT), "<Q"),
    }
    extremes = [0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, len(TOKENS) + 1, len(PAYLOAD) - 1]
    for k in range(n):
        kind = k % 5
        data = bytearray(GOOD)
        if kind == 0:
            name, data = f"truncate-{k}", data[: rng.randrange(len(data))]
        elif kind == 1:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
            name = f"flip-{i}"
        elif kind == 2:
            field, (offset, fmt) = rng.choice(sorted(fields.items()))
            value = rng.choice(extremes) % (2 ** (8 * struct.calcsize(fmt)))
            struct.pack_into(fmt, data, offset, value)
            name = f"{field}={value}"
        elif kind == 3:
            i = rng.randrange(len(data) - 32)
            data[i] = rng.randrange(256)
            name = f"byte-{i}"
        else:
            cut = rng.randrange(len(data) - 32)
            data = data[:cut] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) + data[cut:]
            name = f"insert-{cut}"
        out.append((name, bytes(data)))
        out.append((name + "+sum", _resum(bytes(data))))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_mutated_files_are_refused_cleanly(seed):
    refused = 0
    for name, data in _mutants(seed, 150):
        try:
            tokens, payload = read_prefix_file(data, MODEL, LAYOUT, TOKENS)
        except PrefixFileError:
            refused += 1
            continue
        assert name.endswith("+sum") or data == GOOD, f"{name}: a changed file passed the checksum"
        # accepted: the header means what the original's does; only a mutant whose checksum
        # was recomputed may carry other payload bytes (llama.cpp's to check: the child test)
        assert np.array_equal(tokens, TOKENS) and len(payload) == len(PAYLOAD), name
        assert payload == PAYLOAD or name.endswith("+sum"), name
    assert refused >= 200


def test_wrong_model_layout_tokens_and_garbage_are_refused():
    with pytest.raises(PrefixFileError, match="another model"):
        read_prefix_file(GOOD, hashlib.sha256(b"other").digest(), LAYOUT, TOKENS)
    with pytest.raises(PrefixFileError, match="layout"):
        read_prefix_file(GOOD, MODEL, LAYOUT.replace("f16", "q8_0"), TOKENS)
    with pytest.raises(PrefixFileError, match="other tokens"):
        read_prefix_file(GOOD, MODEL, LAYOUT, TOKENS[:-1])
    with pytest.raises(PrefixFileError, match="other tokens"):
        read_prefix_file(GOOD, MODEL, LAYOUT, TOKENS[::-1])
    for data in (b"", b"LBPREFIX", b"\x00" * 100, os.urandom(5000), GOOD[:-1], GOOD + b"\x00"):
        with pytest.raises(PrefixFileError):
            read_prefix_file(data, MODEL, LAYOUT, TOKENS)
    assert read_prefix_file(GOOD, MODEL, LAYOUT)[1] == PAYLOAD


_CHILD = textwrap.dedent(
    """
    import json, random, sys
    from pathlib import Path
    from llamabatch import LLM, SamplingParams, testing
    from llamabatch.generate.prefix_store import encode_prefix_file, read_prefix_file

    seed, n, workdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    rng = random.Random(seed)
    path = testing.model_path("tiny")
    options = dict(n_ctx=1024, n_parallel=2, kv_unified=True, flash_attn=False, cache_ram=0)
    options["prefix_cache_dir"] = str(workdir)
    with LLM(path, **options) as llm:
        prefix = llm.tokenize(" ".join(testing.english_sentences(20)))[:120]
        llm.register_prefix(prefix).release()
        store = llm.core.kv.store
        file = store.path_for(prefix)
        tokens, payload = read_prefix_file(file.read_bytes(), store.model_id, store.layout, prefix)
    counts = {"loaded": 0, "refused": 0}
    for k in range(n):
        data = bytearray(payload)
        kind = k % 3
        if kind == 0:  # the state's header and cell metadata
            i = rng.randrange(min(len(data), 1024))
            data[i] = rng.choice([0, 1, 2, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif kind == 1:
            data = data[: rng.randrange(1, len(data))]
        else:
            i = rng.randrange(min(len(data), 1024))
            data[i : i + 4] = rng.choice([b"\\xff" * 4, b"\\xff\\xff\\xff\\x7f", b"\\x00\\x00\\x00\\x80"])
        file.write_bytes(encode_prefix_file(store.model_id, store.layout, tokens, bytes(data)))
        with LLM(path, **options) as llm:
            llm.register_prefix(prefix).release()
            out = llm.generate(prefix + [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
            assert len(out[0].outputs[0].token_ids) == 2
            stats = llm.stats()
        counts["loaded"] += stats.prefix_files_loaded
        counts["refused"] += stats.prefix_files_refused
        assert stats.prefix_files_loaded + stats.prefix_files_refused == 1, stats
    print(json.dumps(counts))
    """
)


@pytest.mark.parametrize("seed", range(2))
def test_llama_cpp_state_mutants_never_crash(tmp_path: Path, seed: int):
    n = 20
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(seed), str(n), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-3000:]}"
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["loaded"] + counts["refused"] == n
    assert counts["refused"] > 0  # llama.cpp refuses what it cannot read, and we count it
