"""KV computed under one LoRA adapter set is never given to a request of another: prefix reuse
and the host-RAM tier key on (adapter set, tokens) (fake context)."""

from __future__ import annotations

from typing import Any

from fake_llama import make_core
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamabatch.generate.request import Request
from llamabatch.params import SamplingParams

SETS = ((), "a", "b", {"a": 0.5})


def _watch_placements(core: Any, seen: list[tuple[Any, Any, int]]) -> None:
    """Record, for every placement that reuses KV, the adapter set of the request and the set
    the reused KV was computed under (read before the placement changes it)."""
    kv = core.kv
    place = kv.place

    def watched(tokens: list[int], leader_slot: int = -1, tag: Any = (), owner: Any = None) -> Any:
        before = list(kv.tags)
        restores = kv.ram.restores if kv.ram is not None else 0
        placement = place(tokens, leader_slot, tag, owner)
        if placement.reused_tokens:
            if kv.ram is not None and kv.ram.restores > restores:
                source_tag = kv.ram.entries()[-1].tag  # the state restored (touched last)
            else:
                source = placement.source_seq if placement.source_seq >= 0 else placement.slot
                source_tag = before[source]
            seen.append((tag, source_tag, placement.reused_tokens))
        return placement

    kv.place = watched


prompt_parts = st.lists(st.integers(0, 2), min_size=1, max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=st.lists(
        st.tuples(prompt_parts, st.integers(0, len(SETS) - 1), st.integers(1, 6)), min_size=2, max_size=14
    ),
    cache_ram=st.sampled_from([None, 64]),
)
def test_prefix_cache_never_crosses_adapter_sets(
    jobs: list[tuple[list[int], int, int]], cache_ram: Any
) -> None:
    core, _context, _model = make_core(n_parallel=3, prefix_cache=True, chunk_size=16, cache_ram=cache_ram)
    seen: list[tuple[Any, Any, int]] = []
    _watch_placements(core, seen)
    saves: list[tuple[Any, Any]] = []  # (the sequence's set, the saved state's)
    save = core.kv.save

    def watched_save(seq: int) -> bool:
        tag = core.kv.tags[seq]
        saved = save(seq)
        if saved:
            saves.append((tag, core.kv.ram.entries()[-1].tag))
        return saved

    core.kv.save = watched_save
    matches: list[tuple[Any, Any]] = []  # (asked, found): what the RAM tier's lookups gave
    ram = core.kv.ram
    if ram is not None:
        match = ram.match

        def watched_match(tokens: Any, tag: Any = ()) -> Any:
            entry, n = match(tokens, tag)
            if entry is not None:
                matches.append((tag, entry.tag))
            return entry, n

        ram.match = watched_match
    blocks = [list(range(4 + 16 * b, 20 + 16 * b)) for b in range(3)]  # 16-token shared blocks
    requests = []
    for parts, set_index, max_tokens in jobs:
        tokens = [1] + [t for p in parts for t in blocks[p]]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=SETS[set_index])
        requests.append(Request(tokens, params))
    for i in range(0, len(requests), 3):  # arrivals in waves, so idle slots keep prefixes
        core.add(requests[i : i + 3])
        for _ in range(4):
            core.step()
    while core.has_unfinished():
        core.step()
    assert all(r.done for r in requests)
    for tag, source_tag, _n in seen:
        assert tag == source_tag, (tag, source_tag)
    assert all(tag == saved_tag for tag, saved_tag in saves)  # a state keeps its set
    assert all(asked == found for asked, found in matches)


def test_same_tokens_other_adapter_are_computed_again() -> None:
    core, _context, _model = make_core(n_parallel=4, prefix_cache=True, chunk_size=16, cache_ram=None)
    tokens = [1, *range(10, 50)]
    first = Request(tokens, SamplingParams(max_tokens=2, temperature=0.0, lora="a"))
    core.add([first])
    while core.has_unfinished():
        core.step()
    for lora, expected in (("b", 0), ({"a": 0.5}, 0), ((), 0), ("a", len(tokens) - 1)):
        again = Request(tokens, SamplingParams(max_tokens=2, temperature=0.0, lora=lora))
        core.add([again])
        while core.has_unfinished():
            core.step()
        assert again.reused_tokens == expected, lora


def test_room_is_counted_without_a_prefix_of_another_adapter_set() -> None:
    """Admission counts as reusable only a prefix computed under the request's own set: one
    under another set is computed again, so its cells must be found (evicting) up front."""
    core, _context, _model = make_core(n_parallel=3, n_ctx=96, prefix_cache=True, cache_ram=None)
    shared = [1, *range(2, 31)]  # 30 tokens (the fake vocabulary: ids below 64)

    def run(tokens: list[int], lora: Any, max_tokens: int) -> Request:
        request = Request(tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=lora))
        core.add([request])
        return request

    for tokens, lora in ((shared, "a"), ([63, *range(33, 62)], ())):  # two idle 30-token caches
        run(tokens, lora, 1)
        while core.has_unfinished():
            core.step()
    runner = run([2, *range(40, 59)], (), 40)  # 20 tokens, running: 16 cells free
    core.step()
    # 55 tokens under the base model: slot 0's 30 are adapter "a"'s, not reusable
    late = run([*shared, *range(35, 60)], (), 2)
    core.step()
    assert core.counters.evictions == 2  # both idle caches, not only the unrelated one
    assert core.counters.decode_retries == 0 and core.counters.preemptions == 0
    while core.has_unfinished():
        core.step()
    assert late.finish_reason == runner.finish_reason == "length"
    assert late.reused_tokens == 0


def test_an_adapters_state_is_restored_for_its_own_set_only() -> None:
    """A prompt computed under adapter "a", pushed out of the KV cache, goes to the RAM tier
    under "a": the same tokens under "a" again restore it, under another set or the base
    model they are computed (and the state stays for "a")."""
    core, _context, _model = make_core(n_parallel=1, prefix_cache=True, chunk_size=64, cache_ram=64)
    tokens = [1, *range(2, 50)]  # 49 tokens: over the tier's 32-token block

    def run(prompt: list[int], lora: Any) -> Request:
        request = Request(prompt, SamplingParams(max_tokens=2, temperature=0.0, lora=lora))
        core.add([request])
        while core.has_unfinished():
            core.step()
        return request

    run(tokens, "a")
    run([1, *range(50, 60)], ())  # takes the one slot: "a"'s tokens go to the RAM tier
    ram = core.kv.ram
    assert ram is not None and [e.tag for e in ram.entries()] == [(("a", 1.0),)]  # (name, scale)
    for lora in ("b", ()):
        other = run([*tokens, 60], lora)
        assert other.reused_tokens == 0 and ram.restores == 0, lora
    again = run([*tokens, 60], "a")
    assert ram.restores == 1 and again.reused_tokens == len(tokens)
