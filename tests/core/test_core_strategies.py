"""The built-in strategies: hand-checked plans, agreement with the reference, budget rules."""

from __future__ import annotations

import pytest
import reference_scheduler as ref
from hypothesis import given
from hypothesis import strategies as st

from llamabatch._core import (
    STRATEGIES,
    Balanced,
    BatchPool,
    DecodeMaximal,
    PrefillPriority,
    SlotTable,
    Strategy,
    get_strategy,
    strategy_name,
)


class FakeView:
    """The view protocol over plain lists (what a strategy's plan() reads)."""

    def __init__(self, decode, prefill):
        self.decode_slots = list(decode)
        self.prefill_slots = [s for s, _ in prefill]
        self._pending = dict(prefill)
        self.n_parallel = 1 + max([*self.decode_slots, *self.prefill_slots, 0])

    def n_pending(self, slot):
        return self._pending[slot]


def plan(name, decode, prefill, budget, chunk):
    return get_strategy(name).plan(FakeView(decode, prefill), budget, chunk, 0)


@pytest.mark.parametrize(
    ("name", "budget", "expected"),
    [
        # decode 0..2, prefill slot 5 (10 pending) then slot 4 (3 pending), chunk 4
        ("decode_maximal", 16, [(0, 1), (1, 1), (2, 1), (5, 4), (4, 3)]),
        ("decode_maximal", 6, [(0, 1), (1, 1), (2, 1), (5, 3)]),
        ("decode_maximal", 3, [(0, 1), (1, 1), (5, 1)]),  # one token kept for the prompt
        ("decode_maximal", 1, [(0, 1)]),
        ("prefill_priority", 16, [(5, 4), (4, 3), (0, 1), (1, 1), (2, 1)]),
        ("prefill_priority", 6, [(5, 4), (4, 1), (0, 1)]),  # one token kept for decode
        ("prefill_priority", 1, [(5, 1)]),
        ("balanced", 16, [(0, 1), (1, 1), (2, 1), (5, 4), (4, 3)]),
        ("balanced", 6, [(0, 1), (1, 1), (2, 1), (5, 3)]),
        ("balanced", 4, [(0, 1), (1, 1), (5, 2)]),
        ("balanced", 1, [(5, 1)]),
    ],
)
def test_hand_checked_plans(name, budget, expected):
    decode, prefill = [0, 1, 2], [(5, 10), (4, 3)]
    assert plan(name, decode, prefill, budget, 4) == expected
    assert ref.STRATEGIES[name](decode, prefill, budget, 4) == expected


def test_balanced_unused_budget_flows_both_ways():
    # few decode slots: prefill takes what decode leaves
    assert plan("balanced", [0], [(1, 100)], 10, 100) == [(0, 1), (1, 9)]
    # little prompt left: decode takes more than half
    assert plan("balanced", list(range(8)), [(9, 1)], 8, 4) == [(s, 1) for s in range(7)] + [(9, 1)]


def test_get_strategy():
    assert isinstance(get_strategy(), DecodeMaximal)
    assert isinstance(get_strategy("Prefill-Priority"), PrefillPriority)
    assert isinstance(get_strategy("balanced"), Balanced)
    s = DecodeMaximal()
    assert get_strategy(s) is s
    with pytest.raises(ValueError, match="unknown strategy"):
        get_strategy("nope")
    with pytest.raises(TypeError, match="instance"):
        get_strategy(Balanced)
    with pytest.raises(TypeError, match="plan"):
        get_strategy(object())

    class Mine:
        def plan(self, view, budget, chunk_size, queue_depth):
            return []

    m = Mine()
    assert get_strategy(m) is m
    assert strategy_name(m) == "Mine"
    assert strategy_name(DecodeMaximal()) == "decode_maximal"
    assert set(STRATEGIES) == {"decode_maximal", "prefill_priority", "balanced"}
    assert all(cls().native for cls in STRATEGIES.values())
    with pytest.raises(NotImplementedError):
        Strategy().plan(FakeView([], []), 1, 1)


def test_subclass_of_a_builtin_takes_the_python_path():
    class Sub(DecodeMaximal):
        name = "sub"

    assert not Sub().native
    pool = BatchPool(16)
    b = pool.acquire()
    t = SlotTable(3, 16, chunk_size=4)
    t.start(0, list(range(9)))
    t.start(2, [1, 2])
    t.fill(b, Sub(), 5)
    via_python = b.entries()
    t.rollback()
    t.fill(b, DecodeMaximal(), 5)
    assert b.entries() == via_python
    t.commit()
    pool.release(b)


slots_and_pending = st.integers(1, 24).flatmap(
    lambda n: st.permutations(range(n)).flatmap(
        lambda perm: st.integers(0, len(perm)).flatmap(
            lambda k: st.tuples(
                st.just(list(perm[:k])),
                st.lists(st.integers(1, 40), min_size=len(perm) - k, max_size=len(perm) - k).map(
                    lambda pend, rest=perm[k:]: list(zip(rest, pend, strict=True))
                ),
            )
        )
    )
)


@given(
    sp=slots_and_pending,
    budget=st.integers(1, 48),
    chunk=st.integers(1, 20),
    name=st.sampled_from(list(STRATEGIES)),
)
def test_builtins_match_the_reference_and_the_budget_rules(sp, budget, chunk, name):
    decode, prefill = sp
    got = plan(name, decode, prefill, budget, chunk)
    assert got == ref.STRATEGIES[name](decode, prefill, budget, chunk)
    total = sum(n for _, n in got)
    assert total <= budget
    slots = [s for s, _ in got]
    assert len(slots) == len(set(slots))
    pending = dict(prefill)
    n_dec = sum(1 for s, _ in got if s not in pending)
    served_pf = [s for s, _ in got if s in pending]
    for s, n in got:
        assert n == 1 if s not in pending else 1 <= n <= min(pending[s], chunk)
    # decode slots are a prefix of the round-robin order, prompts a prefix of the FIFO
    assert [s for s, _ in got if s not in pending] == decode[:n_dec]
    assert served_pf == [s for s, _ in prefill][: len(served_pf)]
    demand = sum(min(p, chunk) for _, p in prefill)
    # work-conserving: the batch is full, or everything that could go in went in
    assert total == min(budget, len(decode) + demand)
    if budget >= 2:  # nobody starves: each side with work gets a token
        assert not decode or n_dec >= 1
        assert not prefill or served_pf[:1] == [prefill[0][0]]
    if name == "decode_maximal" and len(decode) < budget:
        assert n_dec == len(decode)
    if name == "decode_maximal":  # all of them, less one token kept for a waiting prompt
        keep = 1 if prefill and budget >= 2 and len(decode) >= budget else 0
        assert n_dec == min(len(decode), budget - keep)
    if name == "balanced":
        assert n_dec >= min(len(decode), budget // 2)
