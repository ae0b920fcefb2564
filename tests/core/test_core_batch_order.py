"""One KV stream per sequence: the batch order that decides llama.cpp's ubatches.

llama.cpp splits a per-stream batch into ubatches of consecutive seq_ids, scanning the
batch in order, and a ubatch attends over as many cells in each stream as its longest
stream holds (padded to 256). ``llama_ubatches`` below follows that rule (a fact of the
pinned llama.cpp, ``split_equal`` with ``sequential``), so these tests check what llama.cpp
will do with the batches the table writes.
"""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_reference import check_against_reference

from llamabatch import LLM, SamplingParams
from llamabatch._core import BatchPool, SlotTable
from llamabatch.bench.runners.llama_cpp import load_llama_cpp


def llama_ubatches(seq_of_token: list[int]) -> list[list[int]]:
    """The seq_id sets of the ubatches llama.cpp makes of a batch (per-stream KV): each
    starts at the first unused token and takes, in batch order, every sequence whose
    seq_id is the last taken one's + 1; then equal shares of their tokens."""
    used = [False] * len(seq_of_token)
    ubatches = []
    while not all(used):
        seqs: list[int] = []
        for i, s in enumerate(seq_of_token):
            if not used[i] and s not in seqs and (not seqs or s == seqs[-1] + 1):
                seqs.append(s)
        left = {s: sum(1 for i, t in enumerate(seq_of_token) if t == s and not used[i]) for s in seqs}
        share = min(left.values())
        for s in seqs:
            taken = 0
            for i, t in enumerate(seq_of_token):
                if t == s and not used[i] and taken < share:
                    used[i] = True
                    taken += 1
        ubatches.append(seqs)
    return ubatches


def attended(table: SlotTable, ubatches: list[list[int]]) -> int:
    """Cells the first ubatch of each run attends: its streams x its longest stream."""
    return sum(len(u) * max(pad(table.n_past(s) + 1) for s in u) for u in ubatches)


def pad(n: int) -> int:
    return max(256, -(-n // 256) * 256)


def decoding_table(lengths: dict[int, int], n_parallel: int = 8, **kw) -> tuple[SlotTable, BatchPool]:
    """A per-stream table whose slots in ``lengths`` decode, each holding that many tokens."""
    table = SlotTable(n_parallel, 8192, 512, kv_unified=False, **kw)
    pool = BatchPool(n_batch=512)
    batch = pool.acquire()
    for slot, n in lengths.items():
        tokens = array("i", [(slot * 7 + i) % 50 for i in range(n)])
        table.record_cached(slot, tokens[:-1])
        table.start(slot, tokens, n_past=n - 1)
    table.fill(batch, "decode_maximal", 512)
    table.commit()
    for slot in lengths:
        table.accept(slot, 1)
    pool.release(batch)
    return table, pool


def fill(table: SlotTable, pool: BatchPool) -> list[int]:
    batch = pool.acquire()
    try:
        table.fill(batch, "decode_maximal", 512)
        return [e[2] for e in batch.entries()]
    finally:
        table.rollback()
        pool.release(batch)


def test_a_long_stream_gets_its_own_ubatch():
    lengths = {s: 100 for s in range(8)} | {3: 6000}
    table, pool = decoding_table(lengths)
    assert llama_ubatches(fill(table, pool)) == [list(range(8))]  # no cost given: no cuts
    table.ubatch_cost_cells = 4000.0
    order = fill(table, pool)
    ubatches = llama_ubatches(order)
    assert sorted(map(tuple, ubatches)) == [(0, 1, 2), (3,), (4, 5, 6, 7)]
    assert attended(table, ubatches) == 7 * 256 + 6144  # against 8 x 6,144 in one ubatch


def test_streams_of_similar_length_stay_together():
    table, pool = decoding_table({s: 300 + 40 * s for s in range(8)})
    table.ubatch_cost_cells = 4000.0
    assert llama_ubatches(fill(table, pool)) == [list(range(8))]


def test_a_costly_ubatch_is_not_worth_a_short_gap():
    # 7 streams spared 512 cells each (3,584) do not pay for a ubatch of 4,000
    table, pool = decoding_table({s: 100 for s in range(8)} | {0: 600})
    table.ubatch_cost_cells = 4000.0
    assert llama_ubatches(fill(table, pool)) == [list(range(8))]
    table.ubatch_cost_cells = 3000.0
    assert sorted(map(tuple, llama_ubatches(fill(table, pool)))) == [(0,), (1, 2, 3, 4, 5, 6, 7)]


def test_a_prompt_behind_the_decodes_joins_their_ubatch():
    # the plan lists decode slots first and the prompt last; by seq_id they are one run
    table, pool = decoding_table({s: 100 for s in range(8) if s != 2})
    table.start(2, array("i", range(1, 40)))
    order = fill(table, pool)
    assert order.index(2) > 0  # not first: the plan's order was not kept
    # one ubatch of every stream's first token, then the prompt's other tokens alone
    assert llama_ubatches(order) == [list(range(8)), [2]]


def test_a_unified_cache_keeps_the_plans_order():
    table = SlotTable(4, 256, 64, kv_unified=True)
    pool = BatchPool(n_batch=512)
    for slot in (3, 1):
        table.start(slot, array("i", [5, 6]))
    assert fill(table, pool) == [3, 3, 1, 1]  # prompts in arrival order


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.dictionaries(st.integers(0, 11), st.integers(1, 5000), min_size=1, max_size=12),
    prompts=st.dictionaries(st.integers(0, 11), st.integers(1, 700), max_size=4),
    cost=st.sampled_from([0.0, 500.0, 4000.0, 50000.0]),
)
def test_the_batch_is_a_valid_reordering(lengths, prompts, cost):
    """Whatever the lengths: each slot's tokens stay together in order, outputs name the
    right slot and row, and the cuts never cost more than llama.cpp's own runs."""
    decoding = {s: n for s, n in lengths.items() if s not in prompts}
    table, pool = decoding_table(decoding, n_parallel=12) if decoding else (None, None)
    if table is None:
        table, pool = SlotTable(12, 8192, 512, kv_unified=False), BatchPool(n_batch=512)
    for slot, n in prompts.items():
        table.start(slot, array("i", [(slot + i) % 50 for i in range(n)]))
    natural_cost = None
    if cost:
        natural = llama_ubatches(fill(table, pool))  # no cuts: llama.cpp's runs
        natural_cost = cost * len(natural) + attended(table, natural)
    table.ubatch_cost_cells = cost
    batch = pool.acquire()
    try:
        n = table.fill(batch, "decode_maximal", 512)
        entries = batch.entries()
        seqs = [e[2] for e in entries]
        assert len(entries) == n
        plan = table.last_plan()
        assert [s for s, k in plan for _ in range(k)] == seqs  # last_plan is in batch order
        for slot, k in plan:
            first = table.batch_index(slot)
            assert seqs[first : first + k] == [slot] * k
            assert [e[1] for e in entries[first : first + k]] == list(
                range(table.n_past(slot), table.n_past(slot) + k)
            )
        for slot, idx in table.outputs():
            assert seqs[idx] == slot and entries[idx][3]
        assert sum(e[3] for e in entries) == table.n_outputs
        if natural_cost is not None and not prompts:  # decode-only: the model is exact
            ubatches = llama_ubatches(seqs)
            assert cost * len(ubatches) + attended(table, ubatches) <= natural_cost
    finally:
        table.rollback()
        pool.release(batch)


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_small_tables(n_parallel):
    table, pool = decoding_table({s: 5 for s in range(n_parallel)}, n_parallel=n_parallel)
    table.ubatch_cost_cells = 1.0
    assert sorted(fill(table, pool)) == list(range(n_parallel))


def test_cut_batches_decode_as_the_reference(tiny_path):
    """llama.cpp itself, cutting where the table asks: one 1,500-token stream among three
    short ones gets ubatches of its own, and every stream's log-probabilities stay those of
    a teacher-forced single-sequence run."""
    long_prompt = [1, *[(7 * i) % 200 + 3 for i in range(1500)]]
    prompts = [long_prompt] + [[1, *[(s * 11 + i) % 200 + 3 for i in range(20)]] for s in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)
    with LLM(tiny_path, kv_unified=False, n_ctx=4 * 2048, n_parallel=4, n_threads=2, flash_attn=False) as llm:
        core = llm.core
        assert core.table.ubatch_cost_cells > 0
        decode, cuts = core.context.decode_address, []

        def spy(address: int) -> int:  # do neighbouring streams of the batch share no ubatch?
            seqs = [e[2] for e in core.batch.entries()]
            neighbours = {s for s in seqs if s + 1 in seqs}
            together = {s for u in llama_ubatches(seqs) for s in u if s + 1 in u}
            cuts.append(bool(neighbours - together))
            return decode(address)

        core.context.decode_address = spy
        handles = [llm.submit(p, params) for p in prompts]
        outs = [h.result(timeout=120).outputs[0] for h in handles]
    assert any(cuts)  # some batch of consecutive streams was cut in two
    reference = load_llama_cpp(
        str(tiny_path), n_ctx=2048, n_batch=512, logits_all=True, verbose=False, flash_attn=False
    )
    check_against_reference(reference, outs)
