"""The KV layout that follows the workload: the prediction rules, the hysteresis (no flapping,
whatever the workload does), which layouts a config allows, and the state rewrite's refusals.
Pure functions; the switch on real llama.cpp is in test_layout_switch_real.py."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch.config import EngineConfig
from llamabatch.generate import layout_switch as ls
from llamabatch.generate.kv_state_format import convert_seq_state, drop_leading_cells
from llamabatch.generate.layout_switch import Layout, LayoutSwitcher, WorkloadSummary, preferred_layout

PER_STREAM = Layout(False, False)
SHARED = Layout(True, False)
LONG = Layout(True, True)
ALL = frozenset({PER_STREAM, SHARED, LONG})


def _summary(share=0.0, longest=200, median=200, busy=4.0, requests=16) -> WorkloadSummary:
    return WorkloadSummary(requests, share, longest, median, busy)


def test_rules():
    assert preferred_layout(_summary(share=0.8), PER_STREAM, ALL) == (SHARED, "shared_prefix")
    assert preferred_layout(_summary(share=0.8, busy=1.0), PER_STREAM, ALL) == (PER_STREAM, "independent")
    assert preferred_layout(_summary(longest=5000, median=100), PER_STREAM, ALL) == (LONG, "long_prompt")
    assert preferred_layout(_summary(longest=5000, median=4000), PER_STREAM, ALL)[0] == PER_STREAM
    assert preferred_layout(_summary(), SHARED, ALL) == (SHARED, "independent")
    # a layout not allowed is never chosen
    assert preferred_layout(_summary(share=0.8), LONG, frozenset({LONG})) == (LONG, "independent")


def test_explicit_choices_pin_the_layout():
    default = PER_STREAM
    assert ls.layouts_allowed(EngineConfig(), default) == ALL | {Layout(False, True)}
    assert ls.layouts_allowed(EngineConfig(kv_unified=False), default) == {PER_STREAM, Layout(False, True)}
    assert ls.layouts_allowed(EngineConfig(flash_attn=False), default) == {PER_STREAM, SHARED}
    assert ls.layouts_allowed(EngineConfig(kv_unified=True, flash_attn=True), LONG) == {LONG}
    # a given n_ctx pins nothing: streams of it are the default's own choice (at_quiet)
    assert ls.layouts_allowed(EngineConfig(n_ctx=4096), LONG) == ALL | {Layout(False, True)}
    for pinned in (
        EngineConfig(n_gpu_layers=1),
        EngineConfig(batch_invariant=True),
        EngineConfig(type_v="q8_0"),
        EngineConfig(mmproj="encoder.gguf"),
    ):
        assert ls.layouts_allowed(pinned, default) == {default}
    assert ls.layouts_allowed(EngineConfig(), default, pinned_prefixes=True) == {default}


def _switcher() -> LayoutSwitcher:
    return LayoutSwitcher(PER_STREAM, PER_STREAM, ALL)


def test_a_switch_needs_a_confirmed_preference_and_served_requests():
    sw = _switcher()
    shared = _summary(share=0.9)
    far = 1e9  # long enough since the start that the switch's cost is repaid
    assert sw.decide(shared, served=100, now=far) is None  # the first vote
    assert sw.decide(shared, served=101, now=far) == (SHARED, "shared_prefix")
    sw.switched(SHARED, "shared_prefix", 0.1, served=101, now=far)
    assert sw.decide(_summary(), served=102, now=2 * far) is None  # back? too soon after
    assert sw.decide(_summary(), served=103, now=2 * far) is None
    assert sw.decide(_summary(), served=101 + ls.MIN_REQUESTS_BETWEEN, now=2 * far) == (
        PER_STREAM,
        "independent",
    )
    assert sw.stats.reasons == {"shared_prefix": 1}


def test_a_switch_must_repay_its_cost():
    sw = _switcher()
    shared = _summary(share=0.9)
    sw.switched(PER_STREAM, "independent", 2.0, served=0, now=0.0)  # a measured 2 s switch
    now = ls.COST_MARGIN * 2.0 / ls.PREDICTED_GAIN  # the time served that repays it
    for served in range(100, 110):
        assert sw.decide(shared, served=served, now=now * 0.99) is None
    assert sw.decide(shared, served=111, now=now * 1.01) == (SHARED, "shared_prefix")


def test_too_few_requests_seen():
    assert _switcher().decide(_summary(share=0.9, requests=ls.COLLECTED - 1), 500, now=1e9) is None


workloads = st.lists(
    st.tuples(
        st.floats(0, 1),  # share
        st.integers(1, 8000),  # longest prompt
        st.integers(1, 8000),  # median prompt
        st.floats(0, 16),  # busy
        st.integers(0, 40),  # requests served since the last quiet moment
        st.floats(0, 30),  # seconds since the last quiet moment
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(workloads, st.floats(0.001, 5.0))
def test_no_flapping(moments, cost):
    """Whatever the workload does: two switches are MIN_REQUESTS_BETWEEN requests apart, each
    follows CONFIRM equal preferences, and the time between them repays the switch."""
    sw = _switcher()
    served, now = 0, 0.0
    switches: list[tuple[int, float]] = [(0, 0.0)]
    votes: list[Layout] = []
    for share, longest, median, busy, n, dt in moments:
        served += n
        now += dt
        summary = _summary(share, longest, min(median, longest), busy)
        votes.append(preferred_layout(summary, sw.default, sw.allowed)[0])
        decision = sw.decide(summary, served, now=now)
        if decision is None:
            continue
        layout, reason = decision
        assert layout != sw.current
        assert votes[-ls.CONFIRM :] == [layout] * ls.CONFIRM
        last_served, last_time = switches[-1]
        assert served - last_served >= ls.MIN_REQUESTS_BETWEEN
        measured = sw.stats.time_s / sw.stats.switches if sw.stats.switches else ls.DEFAULT_SWITCH_COST
        assert ls.PREDICTED_GAIN * (now - last_time) >= ls.COST_MARGIN * measured
        sw.switched(layout, reason, cost, served, now=now)
        switches.append((served, now))
    assert sw.stats.switches == len(switches) - 1 <= served // ls.MIN_REQUESTS_BETWEEN


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 8), st.booleans())
def test_state_rewrite_refuses_bytes_that_do_not_parse(data, n_stream, v_trans):
    out = convert_seq_state(data, n_stream, v_trans, n_layer=2)
    assert out is None or isinstance(out, bytes)
    magic = struct.pack("<Ii", 0xAF143CD8, 3)
    out = convert_seq_state(magic + data, n_stream, v_trans, n_layer=2)
    assert out is None or out.startswith(magic)


def _state(
    n_stream: int, cells: int, v_trans: bool, n_layer: int = 2, n_embd: int = 3, first: int = 0
) -> bytes:
    """A one-sequence state as llama.cpp writes it (f16 K and V), in stream 0, holding
    positions ``first`` to ``cells - 1``, with values that say where they came from:
    V[cell][dim] = 100 * dim + cell."""
    kept = range(first, cells)
    out = [struct.pack("<IiI", 0xAF143CD8, 5, n_stream), struct.pack("<I", len(kept))]
    out += [struct.pack("<iIi", pos, 1, 5) for pos in kept]
    out.append(struct.pack("<II", int(v_trans), n_layer))
    for layer in range(n_layer):
        k = bytes(range(layer, layer + 2 * n_embd * cells))[2 * n_embd * first :]
        out.append(struct.pack("<iQ", 1, 2 * n_embd) + k)
    for _ in range(n_layer):
        if v_trans:
            out.append(struct.pack("<iII", 1, 2, n_embd))
            out += [struct.pack("<H", 100 * d + c) for d in range(n_embd) for c in kept]
        else:
            out.append(struct.pack("<iQ", 1, 2 * n_embd))
            out += [struct.pack("<H", 100 * d + c) for c in kept for d in range(n_embd)]
    out += [struct.pack("<I", 0)] * (n_stream - 1)
    return b"".join(out)


def test_state_rewrite_moves_streams_and_transposes_v():
    for cells in (1, 4):
        for src in (1, 4):
            for dst in (1, 3):
                for a in (False, True):
                    for b in (False, True):
                        assert convert_seq_state(_state(src, cells, a), dst, b, 2) == _state(dst, cells, b)
    assert convert_seq_state(_state(1, 4, False), 1, True, n_layer=3) is None  # another model
    assert convert_seq_state(_state(1, 4, False)[:-1], 1, True, 2) is None  # truncated


def test_leading_cells_are_dropped_from_a_state():
    for v_trans in (False, True):
        for first in (1, 3):
            assert drop_leading_cells(_state(1, 4, v_trans), first, 2) == _state(1, 4, v_trans, first=first)
        assert drop_leading_cells(_state(1, 4, v_trans), 4, 2) is None  # no cell left
        assert drop_leading_cells(_state(1, 4, v_trans), 1, 3) is None  # another model


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 6))
def test_dropping_cells_refuses_bytes_that_do_not_parse(data, first):
    magic = struct.pack("<Ii", 0xAF143CD8, 3)
    for state in (data, magic + data):
        out = drop_leading_cells(state, first, n_layer=2)
        assert out is None or (isinstance(out, bytes) and out.startswith(magic))
