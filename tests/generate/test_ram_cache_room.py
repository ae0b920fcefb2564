"""A restore always gets its room: idle cached prefixes holding the cells a saved state needs
are saved and evicted for it (never a silent recompute); a hit that running requests keep
out is counted with its reason (``ram_cache_restore_skipped``). Over the fake context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt

#: every prompt starts with the same token, as a BOS token makes real prompts do
BOS = 1


def _prompt(n: int, seed: int) -> list[int]:
    return [BOS, *prompt(n - 1, seed)]


def _core(n_ctx: int = 1024):
    core, ctx, model = make_core(
        n_parallel=2,
        n_ctx=n_ctx,
        kv_unified=True,
        prefix_cache=True,
        cache_ram=64,
        n_batch=512,
        chunk_size=512,
    )
    return Recorder(core, ctx, model), core


def _turn(rec: Recorder, tokens: list[int], max_tokens: int = 1):
    (r,) = rec.new(tokens, greedy(max_tokens))
    rec.run()
    rec.check_done(r)
    return r


def test_idle_prefixes_make_room_for_a_restore():
    """The issue's case in small: a 375-token prompt, four 750-token prompts one after another
    (each one evicts what came before), then the first prompt plus two tokens. The room the
    state needs is held by an idle 750-token prefix sharing only the BOS token with it."""
    rec, core = _core()
    first = _prompt(375, 1)
    _turn(rec, first)
    for i in range(4):
        _turn(rec, _prompt(750, 10 + i))
    before = core.counters.prefill_tokens
    r = _turn(rec, [*first, *prompt(2, 99)])
    ram = core.kv.ram
    assert ram is not None
    stats = ram.stats()
    assert (stats.saves, stats.hits, stats.misses) == (5, 1, 5)
    assert (stats.restores, stats.restore_failures, stats.restore_skipped) == (1, 0, {})
    assert r.output.usage.reused_tokens == 375 == stats.restored_tokens
    assert core.counters.prefill_tokens - before == 2  # only the two new tokens were computed
    ram.check()


def test_room_held_by_a_running_request_is_counted_with_its_reason():
    """A saved state longer than the prompt's match needs more cells than computing the
    prompt; a running request holds them: the prompt is computed, the skip counted."""
    rec, core = _core()
    saved = _prompt(420, 1)
    _turn(rec, saved)
    _turn(rec, _prompt(700, 2))  # evicts (saves) the first
    (running,) = rec.new(_prompt(620, 3), greedy(64))
    while not running.output_tokens:
        rec.step()
    (r,) = rec.new([*saved[:300], *prompt(20, 4)], greedy(1))
    while not r.output_tokens:
        rec.step()
    assert not running.done
    ram = core.kv.ram
    assert ram is not None
    assert ram.hits == 1 and ram.restores == 0
    assert ram.stats().restore_skipped == {"room_held_by_running": 1}
    assert r.reused_tokens <= 1  # computed (at most the BOS shared)
    rec.run()
    rec.check_done(r)
    rec.check_done(running)


def test_restore_waits_for_room_a_running_request_frees_soon():
    """The same held room, but the running request ends in a few ticks: the prompt waits for
    them (fewer ticks than computing its 300 restorable tokens would cost), then its state is
    restored, not computed; greedy tokens equal those of the same prompt computed."""
    rec, core = _core()
    saved = _prompt(420, 1)
    _turn(rec, saved)
    _turn(rec, _prompt(700, 2))  # evicts (saves) the first
    (running,) = rec.new(_prompt(620, 3), greedy(6))
    while not running.output_tokens:
        rec.step()
    later = [*saved[:300], *prompt(20, 4)]
    (r,) = rec.new(later, greedy(4))
    rec.run()
    rec.check_done(r)
    rec.check_done(running)
    ram = core.kv.ram
    assert ram is not None
    stats = ram.stats()
    assert (stats.hits, stats.restores, stats.restore_skipped, stats.restore_waits) == (1, 1, {}, 1)
    assert r.reused_tokens == 300
    assert r.output.usage.prompt_tokens == len(later)
    fresh, _ = _core()
    (again,) = fresh.new(later, greedy(4))
    fresh.run()
    assert again.reused_tokens <= 1
    assert r.output.token_ids == again.output.token_ids


def test_wait_for_a_restore_is_bounded():
    """A running request that keeps the room longer than computing would take: the prompt
    waits about the restorable tokens over WAIT_TICK_PROMPT_TOKENS admission steps, then is
    computed, the skip counted."""
    from llamabatch.generate.kv_cache import WAIT_TICK_PROMPT_TOKENS

    rec, core = _core()
    saved = _prompt(420, 1)
    _turn(rec, saved)
    _turn(rec, _prompt(700, 2))
    (running,) = rec.new(_prompt(620, 3), greedy(200))
    while not running.output_tokens:
        rec.step()
    (r,) = rec.new([*saved[:300], *prompt(20, 4)], greedy(1))
    steps = 0
    while not r.output_tokens:
        rec.step()
        steps += 1
    assert not running.done
    bound = -(-299 // WAIT_TICK_PROMPT_TOKENS)  # 299: the state's match less the BOS cached
    assert bound <= steps <= bound + 3
    ram = core.kv.ram
    assert ram is not None
    assert (ram.restores, ram.restore_waits) == (0, 1)
    assert ram.stats().restore_skipped == {"room_held_by_running": 1}
    rec.run()


class _Source:
    """An engine as the metrics see it: listeners, and ``stats()``."""

    def __init__(self, stats: object) -> None:
        self._stats = stats

    def add_listener(self, listener: object) -> None:
        pass

    def remove_listener(self, listener: object) -> None:
        pass

    def stats(self) -> object:
        return self._stats


def test_restore_skipped_in_metrics_by_reason():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from llamabatch.runtime.metrics import PrometheusListener

    metrics = PrometheusListener(prometheus_client.CollectorRegistry())
    skipped = {"room_held_by_running": 3, "state_dropped": 1}
    source = _Source(SimpleNamespace(ram_cache_restore_skipped=skipped))  # held: metrics hold it weakly
    metrics.attach(source, model_name="m")
    text = metrics.generate_latest().decode()
    samples = {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llamabatch:ram_cache_restore_skipped_total"
    }
    assert samples == skipped
