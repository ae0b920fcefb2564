"""The batch pool: preallocated llama_batch buffers, their layout, leak counters."""

from __future__ import annotations

import ctypes
import gc
from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llamabatch._core import Batch, BatchPool
from llamabatch._core import batch as batch_mod


class LlamaBatch(ctypes.Structure):
    """llama_batch as llama.h lays it out (for reading a batch through its address)."""

    _fields_ = [
        ("n_tokens", ctypes.c_int32),
        ("token", ctypes.POINTER(ctypes.c_int32)),
        ("embd", ctypes.POINTER(ctypes.c_float)),
        ("pos", ctypes.POINTER(ctypes.c_int32)),
        ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
        ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
        ("logits", ctypes.POINTER(ctypes.c_int8)),
    ]


def read_struct(batch):
    c = LlamaBatch.from_address(batch.address)
    return [
        (
            c.token[i],
            c.pos[i],
            tuple(c.seq_id[i][k] for k in range(c.n_seq_id[i])),
            bool(c.logits[i]),
        )
        for i in range(c.n_tokens)
    ], c


def test_batch_cannot_be_constructed_from_python():
    with pytest.raises(TypeError, match=r"BatchPool\.acquire"):
        Batch()
    with pytest.raises(TypeError):
        Batch(object(), 8, 1)
    with pytest.raises(TypeError):
        batch_mod.CView()


def test_pool_counters_and_reuse():
    pool = BatchPool(n_batch=16, n_seq_max=1)
    assert (pool.n_acquired, pool.n_released, pool.n_outstanding, pool.n_allocated) == (0, 0, 0, 1)
    a = pool.acquire()
    b = pool.acquire()  # allocates a second one
    assert pool.n_outstanding == 2 and pool.n_allocated == 2
    a.add(1, 0, 0, True)
    pool.release(a)
    c = pool.acquire()
    assert c is a and c.n_tokens == 0  # reused and empty
    pool.release(b)
    pool.release(c)
    assert (pool.n_acquired, pool.n_released, pool.n_outstanding) == (3, 3, 0)
    for _ in range(1000):
        pool.release(pool.acquire())
    assert pool.n_allocated == 2 and pool.n_outstanding == 0


def test_release_errors():
    pool, other = BatchPool(4), BatchPool(4)
    b = pool.acquire()
    with pytest.raises(ValueError, match="does not belong"):
        other.release(b)
    pool.release(b)
    with pytest.raises(ValueError, match="already released"):
        pool.release(b)
    assert pool.n_outstanding == 0


def test_pool_arguments():
    with pytest.raises(ValueError):
        BatchPool(0)
    with pytest.raises(ValueError):
        BatchPool(8, n_seq_max=0)


def test_struct_layout_through_address():
    pool = BatchPool(n_batch=8, n_seq_max=3)
    b = pool.acquire()
    b.add(11, 0, 0, False)
    b.add(12, 1, [0, 2], True)
    start = b.add_sequence(array("i", [5, 6, 7]), seq_id=1, pos0=4)
    assert start == 2
    entries, c = read_struct(b)
    assert entries == [
        (11, 0, (0,), False),
        (12, 1, (0, 2), True),
        (5, 4, (1,), False),
        (6, 5, (1,), False),
        (7, 6, (1,), True),
    ]
    assert not c.embd
    assert b.entries() == [
        (11, 0, 0, False),
        (12, 1, (0, 2), True),
        (5, 4, 1, False),
        (6, 5, 1, False),
        (7, 6, 1, True),
    ]
    assert b.seq_ids.tolist() == [0, 0, 1, 1, 1]
    assert b.seq_ids_all[1, :2].tolist() == [0, 2]
    assert b.n_seq_id.tolist() == [1, 2, 1, 1, 1]
    pool.release(b)


def test_cffi_sees_the_same_batch():
    ffi_mod = pytest.importorskip("llamabatch._ffi._llama")
    ffi = ffi_mod.ffi
    pool = BatchPool(n_batch=4)
    b = pool.acquire()
    b.add_sequence([3, 4], seq_id=2, pos0=7, output_all=True)
    cb = ffi.cast("llama_batch *", b.address)[0]
    assert cb.n_tokens == 2
    assert [cb.token[i] for i in range(2)] == [3, 4]
    assert [cb.pos[i] for i in range(2)] == [7, 8]
    assert [cb.seq_id[i][0] for i in range(2)] == [2, 2]
    assert [cb.logits[i] for i in range(2)] == [1, 1]
    pool.release(b)


def test_add_sequence_output_flags_and_inputs():
    pool = BatchPool(n_batch=10)
    b = pool.acquire()
    assert b.add_sequence(np.array([1, 2, 3], dtype=np.int32), 0) == 0
    assert b.logits.tolist() == [0, 0, 1]
    assert b.add_sequence([4, 5], 1, output_all=True) == 3  # a list works too
    assert b.add_sequence(np.array([6], dtype=np.int64), 2, pos0=9) == 5  # converted
    assert b.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert b.pos.tolist() == [0, 1, 2, 0, 1, 9]
    assert b.logits.tolist() == [0, 0, 1, 1, 1, 1]
    assert b.n_free == 4
    with pytest.raises(ValueError, match="does not fit"):
        b.add_sequence(list(range(5)), 3)
    assert b.n_tokens == 6  # nothing added
    with pytest.raises(ValueError, match="empty"):
        b.add_sequence([], 3)
    with pytest.raises(OverflowError):
        b.add_sequence([2**40], 3)
    with pytest.raises(TypeError):
        b.add_sequence([0.5], 3)
    b.clear()
    assert b.n_tokens == 0 and b.tokens.tolist() == []
    pool.release(b)


def test_add_errors():
    pool = BatchPool(n_batch=2, n_seq_max=2)
    b = pool.acquire()
    b.add(1, 0, 0)
    with pytest.raises(ValueError, match="seq ids"):
        b.add(1, 1, [0, 1, 2])
    b.add(1, 1, 0)
    with pytest.raises(ValueError, match="full"):
        b.add(1, 2, 0)
    pool.release(b)


def test_views_are_read_only_and_keep_the_batch_alive():
    pool = BatchPool(n_batch=4)
    b = pool.acquire()
    b.add_sequence([9, 8, 7], 0)
    tokens = b.tokens
    with pytest.raises(ValueError):
        tokens[0] = 1
    pool.release(b)
    del b, pool
    gc.collect()
    assert tokens.tolist() == [9, 8, 7]  # the view holds the buffer


def test_live_batch_counter_returns_to_baseline():
    gc.collect()
    base = batch_mod.live_batches()
    pool = BatchPool(n_batch=32, prealloc=3)
    held = [pool.acquire() for _ in range(5)]
    assert batch_mod.live_batches() == base + 5
    for b in held:
        pool.release(b)
    del held, b, pool
    gc.collect()
    assert batch_mod.live_batches() == base


@given(
    seqs=st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=6), max_size=6),
    output_all=st.booleans(),
)
def test_add_sequence_matches_add(seqs, output_all):
    pool = BatchPool(n_batch=40)
    a, b = pool.acquire(), pool.acquire()
    for sid, seq in enumerate(seqs):
        a.add_sequence(seq, sid, pos0=sid, output_all=output_all)
        for j, tok in enumerate(seq):
            b.add(tok, sid + j, sid, output_all or j == len(seq) - 1)
    assert a.entries() == b.entries()
    assert [(t, p, s[0], lg) for t, p, s, lg in read_struct(a)[0]] == a.entries()
    pool.release(a)
    pool.release(b)
    assert pool.n_outstanding == 0
