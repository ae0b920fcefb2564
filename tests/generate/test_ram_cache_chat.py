"""The host-RAM tier on issue 23's chat (more conversations than slots, a shared system
prompt, several turns), over the fake context: counts, not timings.

Every later turn must compute only its new tokens (the new user message, and the previous
reply's last token, which was sampled but never decoded): the conversation so far comes back
from RAM. A restored conversation must not keep its own copy of the shared system prompt:
it shares the cells other sequences hold, as a prefix copied at admission does, so the KV
cells every tick attends to stay what they are with the tier off.
"""

from __future__ import annotations

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt

from llamabatch.generate.request import Request

SYSTEM, USER, REPLY = 100, 24, 12


def chat(
    n_parallel: int,
    cache_ram: int,
    kv_unified: bool = True,
    n_conv: int = 6,
    n_turns: int = 3,
    user: int = USER,
    reply: int = REPLY,
    n_ctx: int = 4096,
):
    """Run the chat step by step (invariants checked after every step); a conversation sends
    its next turn one step after its reply ends (another waiting request may take its slot
    meanwhile). Returns the recorder and, per later turn, (prompt tokens, reused, new tokens)."""
    core, ctx, model = make_core(
        n_parallel=n_parallel,
        n_ctx=n_ctx,
        kv_unified=kv_unified,
        prefix_cache=True,
        cache_ram=cache_ram,
        n_batch=256,
        chunk_size=256,
    )
    rec = Recorder(core, ctx, model)
    system = prompt(SYSTEM, 1)
    history = {c: list(system) for c in range(n_conv)}
    turn = dict.fromkeys(range(n_conv), 0)
    of: dict[int, int] = {}  # id(request) -> conversation
    later: list[tuple[int, int, int]] = []
    cells: list[int] = []
    due: dict[int, list[int]] = {}

    def send(c: int) -> None:
        history[c] += prompt(user, 1000 + 10 * c + turn[c])
        (r,) = rec.new(history[c], greedy(reply, ignore_eos=True))
        of[id(r)] = c

    for c in range(n_conv):
        send(c)
    while core.has_unfinished() or due:
        for c in due.pop(rec.steps, []):
            send(c)
        for event in rec.step():
            r = event.request
            if event.finish_reason is None:
                continue
            rec.check_done(r)
            c = of[id(r)]
            if turn[c]:
                later.append((len(r.prompt_tokens), r.output.usage.reused_tokens, user))
            history[c] += r.output.token_ids
            turn[c] += 1
            if turn[c] < n_turns:
                due.setdefault(rec.steps + 1, []).append(c)
        cells.append(core.table.cells_used)
    assert len(later) == n_conv * (n_turns - 1)
    return rec, later, cells


@pytest.mark.parametrize("n_parallel", [2, 4])
@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "split"])
def test_returning_conversations_compute_only_their_new_tokens(n_parallel, kv_unified):
    rec, later, _ = chat(n_parallel, cache_ram=64, kv_unified=kv_unified)
    ram = rec.core.kv.ram
    for n_prompt, reused, new in later:
        # the new user message + the previous reply's last token (sampled, never decoded)
        assert n_prompt - reused <= new + 1, (n_prompt, reused, new)
    assert ram.restores >= len(later) - n_parallel  # most returns found their slot taken
    assert ram.restore_failures == 0 and ram.evictions == 0
    ram.check()


def test_a_short_turn_costs_less_than_a_block():
    """A conversation whose tokens past the shared system prompt are fewer than a block
    (32) is not saved when its slot is reused (computing them is cheaper than a copy): its
    return computes those too, fewer than 32 more."""
    rec, later, _ = chat(2, cache_ram=64, user=12, reply=10)
    block = rec.core.kv.ram.block
    for n_prompt, reused, new in later:
        assert n_prompt - reused <= new + 1 + block - 1, (n_prompt, reused, new)


def test_under_kv_pressure_idle_slots_make_room_for_a_restore():
    """A restore loads the whole state (system prompt included) before sharing the system
    prompt again: with few free cells, idle slots' cached tokens are evicted (saved to RAM
    first) to make room, rather than computing the conversation again."""
    rec, later, _ = chat(4, cache_ram=64, n_ctx=500)
    ram, core = rec.core.kv.ram, rec.core
    assert core.counters.evictions > 0  # there is pressure
    assert ram.restore_failures == 0 and ram.hits - ram.restores <= 1
    # at most one return (no idle slot left to evict) computes its history again
    assert sum(1 for n_prompt, reused, new in later if n_prompt - reused > new + 1) <= 1
    ram.check()


def test_without_the_tier_the_history_is_computed_again():
    _, later, _ = chat(2, cache_ram=0)
    recomputed = [n_prompt - reused - new for n_prompt, reused, new in later]
    assert max(recomputed) > SYSTEM // 2  # what the tier saves (the counts above)


@pytest.mark.parametrize("n_parallel", [2, 4])
def test_restored_conversations_share_the_system_prompt_cells(n_parallel):
    rec, _, with_tier = chat(n_parallel, cache_ram=64)
    ram = rec.core.kv.ram
    assert ram.restores and ram.shared_tokens >= ram.restores * SYSTEM
    _, _, without = chat(n_parallel, cache_ram=0)
    # the KV cells in use per step (what each tick attends to): as with the tier off, not one
    # more copy of the system prompt per restored conversation
    mean_with, mean_without = sum(with_tier) / len(with_tier), sum(without) / len(without)
    assert mean_with <= 1.05 * mean_without, (mean_with, mean_without)
    assert max(with_tier) <= max(without) + REPLY


def test_a_refused_state_is_kept_once_then_dropped():
    core, ctx, model = make_core(n_parallel=2, n_ctx=512, prefix_cache=True, cache_ram=64)
    rec = Recorder(core, ctx, model)
    convs = [prompt(80, 10 + c) for c in range(3)]
    first = []
    for c in range(3):  # 3 conversations, 2 slots: the first one's tokens go to RAM
        (r,) = rec.new(convs[c], greedy(6))
        rec.run()
        first.append(r)
    ram = core.kv.ram
    (entry,) = [e for e in ram.entries() if e.tokens[:80].tolist() == convs[0]]
    entry.data = b"garbage!" + entry.data[8:]
    follow_up = convs[0] + first[0].output.token_ids + prompt(20, 99)

    def again() -> Request:
        (r,) = rec.new(follow_up, greedy(4))
        rec.run()
        rec.check_done(r)
        return r

    assert again().output.usage.reused_tokens < 80 and ram.restore_failures == 1
    assert entry in ram.entries()  # refused once (no contiguous room, say): kept
    for slot in range(core.n_parallel):  # the follow-up leaves the KV cache, unsaved
        core.kv.trim(slot, 0)
    assert again().output.usage.reused_tokens < 80 and ram.restore_failures == 2
    assert entry not in ram.entries()  # refused twice: dropped
    ram.check()
