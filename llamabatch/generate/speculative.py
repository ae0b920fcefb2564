"""Speculative decoding inside the continuous batch (``speculative_config``).

A speculating request's DECODE slot gets draft tokens (``SlotTable.set_draft``) before the
tick's fill; the fill adds them after its decode token from the budget the strategy's plan
left spare, each with its logits, so they are verified in the same ``llama_decode`` as the
other sequences' decode and prefill tokens. After the decode, ``Speculator.sample_tick``
samples the speculating slot's rows in order with the request's own sampler and accepts
while the sample equals the draft; the first mismatch's sample is the corrected token, and
when every draft matched the sample after the last one is a bonus token. Rejected drafts
leave the slot table (``SlotTable.reject``) and the KV cache (``llama_memory_seq_rm``) in
the same step. Every emitted token went through the same sampler call, stop checks and
logprob row as in a run without speculation: outputs are those of a non-speculative run
given the same logits, and a seed draws once per emitted token.

The Drafter interface (every method implements it: ``spec_suffix.SuffixDrafter`` for ngram
and suffix, ``spec_ngram.NgramDrafter`` when ``prompt_lookup_max`` bounds the lookup,
``draft_model.py`` for a draft model)::

    drafter.draft([DraftJob(key, prompt, output, k, params), ...]) -> {key: Draft}
        # once per tick for all speculating requests; output[-1] is the pending token
        # (sampled, not yet decoded); Draft.tokens are predicted after it (at most k).
        # Draft.rule: "match" (accept while the target's sample equals the draft) or
        # "greedy"/"sampled" (the drafter's own verify() decides; q are its probabilities).
    drafter.verify(key, draft, logits_rows, params) -> (n_accepted, next_token)
        # rule "sampled" only: the min(1, p/q) rule with residual resampling.
    drafter.release(key, done=True)   # request ended (done) or preempted (done=False)
    drafter.close()

With the lookup methods, a grammar request also drafts the text its grammar forces
(``spec_grammar.GrammarDrafts``: a JSON schema's keys), in place of a lookup's draft that does
not go on past it; those drafts go on where failing lookups have spent the ledger's budget.

Only where it pays (``spec_policy.py``): drafts fill spare budget only (decode tokens and
prompt chunks come first), within KV room and under ``target_itl_ms``; each tick, every
speculating request's draft length (0 allowed) is the one that maximises the tick's expected
tokens per second, from a decode cost model fitted on every decode (``observe``), the draft
model's measured time per step and per-request acceptance estimates per draft position;
nobody drafts while more than ``SpecPolicy.max_streams`` (4) sequences decode.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llamabatch._core.slots import SlotState
from llamabatch._ffi.sampler import SamplingError
from llamabatch.generate.cost_model import TickFeatures, most_within
from llamabatch.generate.draft_cuts import cut_at_ends, text_drafts
from llamabatch.generate.draft_model import Draft, DraftJob
from llamabatch.generate.prompt_logprobs import output_logits
from llamabatch.generate.request import RequestKind
from llamabatch.generate.spec_accept import acceptance_rule
from llamabatch.generate.spec_config import validate_speculative_config
from llamabatch.generate.spec_grammar import GRAMMAR_CLASS, GRAMMAR_PRIOR, GrammarDrafts
from llamabatch.generate.spec_ledger import SpecLedger
from llamabatch.generate.spec_ngram import NgramDrafter
from llamabatch.generate.spec_policy import (
    AcceptanceModel,
    DraftTimer,
    RequestAcceptance,
    SpecCostModel,
    SpecPolicy,
    choose_draft_lengths,
    tick_cost,
)
from llamabatch.generate.spec_suffix import SuffixDrafter
from llamabatch.generate.suffix_index import SharedHistory

if TYPE_CHECKING:
    from llamabatch._ffi.model import Model
    from llamabatch.generate.request import Request
    from llamabatch.generate.tick_context import TickContext
    from llamabatch.params import SamplingParams

logger = logging.getLogger("llamabatch")

__all__ = [
    "Draft",
    "DraftJob",
    "Drafter",
    "NgramDrafter",
    "SpecPolicy",
    "Speculator",
    "speculator_for",
    "validate_speculative_config",
]


class Drafter(Protocol):
    """What proposes draft tokens: ``NgramDrafter`` and ``draft_model.DraftModelDrafter``."""

    def draft(self, jobs: Sequence[DraftJob]) -> dict[Hashable, Draft]:
        """Drafts for the jobs (one call per tick); no entry: no draft for that request."""
        ...

    def verify(
        self, key: Hashable, draft: Draft, logits_rows: np.ndarray, params: SamplingParams
    ) -> tuple[int, int]:
        """Rule ``"sampled"``: ``(accepted drafts, the token after them)``."""
        ...

    def release(self, key: Hashable, *, done: bool = True) -> None:
        """Forget a request (``done=False``: preempted, it comes back)."""
        ...

    def close(self) -> None:
        """Free what the drafter holds."""
        ...


@dataclass
class _SpecState:
    n: int  # the most drafts per step
    drafted: int = 0
    accepted: int = 0
    draft: list[int] = field(default_factory=list)
    rule: str = "match"
    q: Any = None
    #: len(prompt) + len(output) at its last draft call (-1: the drafter holds nothing of it)
    synced: int = -1
    #: its drafts' outcomes, by draft class (``AcceptanceModel``), and the current draft's class
    accs: dict[int, RequestAcceptance] = field(default_factory=dict)
    cls: int = 0

    def acc(self, cls: int) -> RequestAcceptance:
        a = self.accs.get(cls)
        if a is None:
            a = self.accs[cls] = RequestAcceptance(self.n)
        return a


class Speculator:
    """The engine's speculative decoding: drafts before the fill, verification after."""

    def __init__(
        self,
        config: dict[str, Any],
        drafter: Drafter,
        policy: SpecPolicy | None = None,
        grammar: GrammarDrafts | None = None,
    ) -> None:
        """``grammar``: drafts of the text grammar requests' grammars force, beside the
        lookups (``spec_grammar.py``; None: none)."""
        self.config = config
        self.k = int(config["num_speculative_tokens"])
        self.drafter = drafter
        self.policy = policy or SpecPolicy()
        self.grammar = grammar
        #: the decode cost model, fitted on every decode of the engine (``observe``)
        self.cost = SpecCostModel(fit_tokens=2 * self.policy.max_batch_tokens)
        priors = {**(getattr(drafter, "class_priors", None) or {}), GRAMMAR_CLASS: GRAMMAR_PRIOR}
        self.acceptance = AcceptanceModel(self.k, self.policy, priors)
        #: whether drafting itself costs (a draft model: lengths are chosen before drafting,
        #: its time per step is measured); n-gram lookups are free and made first
        self.draft_costs = config.get("method") == "draft_model"
        self.draft_timer = DraftTimer()
        #: seconds to sample and check one logits row after a decode with drafts (Python-side
        #: work the decode cost model does not see), exponentially weighted
        self.row_cost = 0.0
        self._decodes = 0
        self._draft_ticks = 0  # ticks given drafts so far
        self._evidence = 0.0  # ticks given drafts, exponentially weighted (see _probe)
        self._lessons_held = True  # every draft of the first lessons was accepted (see _probe)
        self._states: dict[int, _SpecState] = {}
        #: what drafting has cost, measured: exploration stays within it (``spec_ledger``)
        self.ledger = SpecLedger(
            share=self.policy.explore_share,
            limit=math.inf if self.policy.loss_share is None else self.policy.loss_share,
        )
        self._decoded: tuple[TickFeatures, float] | None = None  # the last decode, for the ledger
        self._tick = 0
        self._set: list[int] = []  # slots given drafts this tick
        self.drafted = 0
        self.accepted = 0

    #: ``observe`` fits a cost model on the engine's measured decodes
    learns_costs = True

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        model: Model,
        *,
        n_seq: int,
        n_ctx: int,
        n_batch: int,
        n_threads: int | None,
    ) -> Speculator:
        """The speculator of a validated ``speculative_config`` for an engine over ``model``
        (``n_seq`` slots, a context of ``n_ctx`` cells, batches of ``n_batch`` tokens)."""
        drafter: Drafter
        grammar = None
        if config["method"] in ("ngram", "suffix"):
            drafter = lookup_drafter(config)
            if config["grammar_drafts"]:
                grammar = GrammarDrafts(lambda text: model.tokenize(text, add_special=False))
        else:
            from llamabatch.generate.draft_model import DraftModelDrafter

            drafter = DraftModelDrafter.from_config(
                config, model, n_seq=n_seq, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads
            )
        return cls(config, drafter, grammar=grammar)

    def state(self, request: Request) -> _SpecState:
        st = self._states.get(request.arrival)
        if st is None:
            st = self._states[request.arrival] = _SpecState(self.k)
        return st

    def observe(self, features: TickFeatures, seconds: float) -> None:
        """Fit the decode cost model on one measured ``llama_decode`` of the engine. The
        engine's first decode is left out: it pages the weights in and sets up buffers, often
        a hundred times a later one's cost, and one such point would sway a least-squares
        fit for hundreds of ticks. Attended cells are left out too (``spec_policy.tick_cost``):
        they grow with the tokens and the context alike, and a fit over the few ticks that
        matter here cannot tell them apart; the per-token cost follows the context instead."""
        self._decodes += 1
        if self._decodes > 1:
            self.cost.observe(features, seconds)
            self.ledger.decoded(seconds)
            self._decoded = (features, seconds)

    # -- before the fill ------------------------------------------------------------------

    def prepare(self, core: TickContext) -> None:
        """Set this tick's drafts on the DECODE slots that speculate (see ``spec_policy``).
        With lookups (n-gram, suffix), this work's own time is booked in the ledger with the
        drafts' cost: where drafts fail, it is speculation's price too. (A draft model's
        decodes are priced by its ``DraftTimer`` when lengths are chosen.)"""
        start = core.clock()
        self._prepare(core)
        if not self.draft_costs:
            self.ledger.spent(core.clock() - start)

    def _prepare(self, core: TickContext) -> None:
        self._tick += 1
        table = core.table
        for slot in self._set:  # drafts a fill left out are not kept for a later tick
            if table.state(slot) == SlotState.DECODE:
                table.set_draft(slot, ())
        self._set.clear()
        self.acceptance.tick()
        n_decode = table.count(SlotState.DECODE)
        policy = self.policy
        if not n_decode or (policy.max_streams is not None and n_decode > policy.max_streams):
            return
        # over budget: not even lookups, only the drafts a grammar forces (their class's own
        # evidence decides them: lookups failing on free text must not stop a schema's keys)
        lookups = self.draft_costs or self.ledger.allows_drafts()
        if not lookups and self.grammar is None:
            return
        room = min(policy.max_batch_tokens, core.n_batch) - n_decode
        below = table.draft_rows_below or policy.max_batch_tokens + 2  # (kv_memory.draft_rows_below)
        if table.kv_unified:
            room = min(room, core.kv_cells_free - core.watermark - n_decode, below - 1 - n_decode)
        if room > 0 and core.tick_limit is not None:
            room = latency_room(core, n_decode, room)
        if room <= 0:
            return
        cands: list[tuple[int, Request, _SpecState]] = []
        caps: list[int] = []  # the most drafts each may use (max_tokens: no draft past the limit)
        fixed: list[bool] = []  # drafts its cap, whatever the costs (see _fixed_length)
        for slot, request in core.slots.busy():
            if table.state(slot) != SlotState.DECODE or not request.params.speculative:
                continue
            if request.kind is RequestKind.PIN:
                continue
            if not lookups and not (self.grammar is not None and self.grammar.applies(request)):
                continue  # (over budget: its estimates stay as they are, no decay toward hope)
            cap = min(self.k, below - 2, request.params.max_tokens - len(request.output_tokens) - 1)
            if cap <= 0:
                continue
            st = self.state(request)
            for acc in st.accs.values():
                self.acceptance.decay(acc)
            cands.append((slot, request, st))
            caps.append(cap)
            fixed.append(self._fixed_length(request))
        if not cands:
            return
        target: Callable[[int], float] | None = None  # (computed when first needed)
        timer = self.draft_timer if self.draft_costs else None
        pinned = sum(cap for cap, f in zip(caps, fixed, strict=True) if f)
        pinned_longest = max((cap for cap, f in zip(caps, fixed, strict=True) if f), default=0)
        row_cost = self.row_cost

        def cost(total: int, longest: int) -> float:
            nonlocal target
            if target is None:
                target = tick_cost(core, n_decode, self.cost)
            t = target(pinned + total) + row_cost * (pinned + total)
            return t + (timer.predict(max(longest, pinned_longest)) if timer is not None else 0.0)

        free = max(0, room - pinned)  # the room left to drafts chosen by their worth
        if self._draft_ticks < policy.explore_ticks:  # what drafts cost is not known yet
            free = min(free, policy.explore_tokens << self._draft_ticks)
        sets: list[tuple[tuple[int, Request, _SpecState], int, Draft]]
        if timer is None:  # n-gram: look up first (free), then choose knowing each draft
            jobs = [
                DraftJob(r.arrival, r.prompt_tokens, r.output_tokens, cap, r.params)
                for (_, r, _), cap in zip(cands, caps, strict=True)
            ]
            requests = [r for _, r, _ in cands]
            drafts = text_drafts(self.drafter.draft(jobs)) if lookups else {}
            classes: dict[Hashable, int] = getattr(self.drafter, "last_match", {})
            forced = self.grammar.merge(requests, caps, drafts) if self.grammar else ()
            drafts = cut_at_ends(drafts, requests, core.draft_end)  # (forced text too: a stop string)
            found = [(c, d) for c in cands if (d := drafts.get(c[1].arrival)) is not None and d.tokens]
            for (_, r, st), _ in found:
                st.cls = GRAMMAR_CLASS if r.arrival in forced else classes.get(r.arrival, 0)
            gains = [self.acceptance.gains(st.acc(st.cls), len(d.tokens), st.cls) for (_, _, st), d in found]
            ks = choose_draft_lengths(gains, n_decode, cost, free, policy.margin)
            if lookups:  # (over budget, no lessons or probes: the grammar's drafts as chosen)
                ks = self._size_lesson(self._probe(ks, gains, free), gains, free, n_decode)
            sets = [(c, k, d) for (c, d), k in zip(found, ks, strict=True)]
        else:  # a draft model: choose first, then draft what was chosen
            gains = [
                [] if f else self.acceptance.gains(st.acc(0), cap)
                for (_, _, st), cap, f in zip(cands, caps, fixed, strict=True)
            ]
            ks = self._probe(choose_draft_lengths(gains, n_decode, cost, free, policy.margin), gains, free)
            ks = [cap if f else k for k, cap, f in zip(ks, caps, fixed, strict=True)]
            chosen = [(c, k) for c, k in zip(cands, ks, strict=True) if k > 0]
            if not chosen:
                return
            jobs = [
                DraftJob(r.arrival, r.prompt_tokens, r.output_tokens, k, r.params) for (_, r, _), k in chosen
            ]
            t0 = core.clock()
            drafts = self.drafter.draft(jobs)
            elapsed = core.clock() - t0
            drafts = cut_at_ends(drafts, [r for (_, r, _), _ in chosen], core.draft_end)
            fresh = False  # a request new to the drafter: its prompt was decoded too, not timed
            for (_, r, st), k in chosen:
                n = len(r.prompt_tokens) + len(r.output_tokens)
                fresh = fresh or st.synced < 0 or n - st.synced > k + 1
                st.synced = n
                st.cls = 0
            if not fresh:
                timer.observe(elapsed, max(k for _, k in chosen))
            sets = [(c, k, d) for c, k in chosen if (d := drafts.get(c[1].arrival)) is not None and d.tokens]
        for (slot, _, st), k, d in sets:
            if room <= 0 or k <= 0:
                continue
            tokens = d.tokens[: min(room, k)]  # (a drafter may give more than asked)
            n = table.set_draft(slot, tokens)
            self._set.append(slot)
            st.draft, st.rule, st.q = tokens[:n], d.rule, d.q
            room -= n
        if self._set:
            self._draft_ticks += 1
        self._evidence = self._evidence * policy.evidence_decay + (1.0 if self._set else 0.0)

    def _probe(self, ks: list[int], gains: list[list[float]], free: int) -> list[int]:
        """``ks``, or drafts for the likeliest draft when nobody drafts: while the first lessons
        last (``SpecPolicy.explore_ticks``), up to ``free`` tokens, as long as each is likelier
        than ``probe_gain`` to be accepted with the ones before it; later one token when the cost
        model has seen too few recent ticks with drafts to know what they cost (a slope
        learned from a few noisy ticks would otherwise stand, as nothing refits it)."""
        policy = self.policy
        if not self.ledger.allows_drafts():  # drafts have cost their share of recent time
            return [0] * len(ks)
        exploring = self._draft_ticks < policy.explore_ticks
        if not self.ledger.allows_exploration():  # exploring has cost its share: it waits
            return ks
        # a lesson drafts its full size while the lessons before it held: chosen lengths of a
        # token or two would leave the cost of long drafts a guess nothing corrects (and long
        # drafts never chosen); where drafts fail, the next lessons are as short as probes
        full_lesson = exploring and self._lessons_held
        settled = not exploring and self._evidence >= policy.probe_below
        if free <= 0 or (any(ks) and not full_lesson) or settled:
            return ks
        best = max(range(len(gains)), key=lambda r: gains[r][0] if gains[r] else 0.0, default=None)
        if best is None or not gains[best] or gains[best][0] < policy.probe_gain:
            return ks
        ks = list(ks)
        if full_lesson:
            ks[best] = max(ks[best], min(free - sum(ks) + ks[best], len(gains[best])))
        else:
            ks[best] = min(free, sum(g >= policy.probe_gain for g in gains[best])) if exploring else 1
        return ks

    def _size_lesson(self, ks: list[int], gains: list[list[float]], free: int, n_decode: int) -> list[int]:
        """``ks``, or twice the largest tick size measured so far for the likeliest draft, where
        its drafts hold (``probe_gain`` at that length) and exploration has budget: the cost
        past the largest size measured is read along the last step's slope, and on a CPU each
        token costs less in a bigger batch (a retried answer drafted 2 tokens a tick, its
        cost read from 2- and 3-token ticks, where 64 were right and cheaper per token)."""
        largest = self.cost.largest_size()
        exploring = self._draft_ticks < self.policy.explore_ticks
        if largest < 2 or exploring or not self.ledger.allows_exploration():
            return ks
        best = max(range(len(gains)), key=lambda r: len(gains[r]), default=None)
        if best is None:
            return ks
        want = min(2 * largest - n_decode, len(gains[best]), free - sum(ks) + ks[best])
        if want <= ks[best] or n_decode + want <= largest or gains[best][want - 1] < self.policy.probe_gain:
            return ks
        ks = list(ks)
        ks[best] = want
        return ks

    def _fixed_length(self, request: Request) -> bool:
        """Whether ``request`` drafts its full length on every tick it may: a seeded request
        sampled against a draft model (rule ``"sampled"``), whose tokens depend on how many
        drafts each tick verified; a length chosen from measured times would make its
        tokens depend on the machine's speed, and its seed must reproduce them."""
        return (
            self.draft_costs
            and request.params.seed is not None
            and acceptance_rule(request.params) == "sampled"
        )

    # -- after the decode -----------------------------------------------------------------

    def sample_tick(self, core: TickContext) -> None:
        """Sample every output of a tick that verified drafts: other slots as the core does,
        speculating slots row by row (see the module docstring)."""
        start = core.clock()  # (the engine's clock: scripted in the fake context's tests)
        self._book_drafts(core.table.n_draft_tokens, len(core.table.outputs()))
        outputs = core.table.outputs()
        running: list[Any] = core.slots.requests
        logits = None
        if any(running[s].fast_greedy for s, _ in outputs):
            logits = output_logits(core.context, core.table, outputs)
        try:
            self._sample_rows(core, outputs, running, logits, time.perf_counter())
        finally:
            if outputs:
                per_row = (core.clock() - start) / len(outputs)
                old = self.row_cost
                self.row_cost = per_row if not old else old + 0.2 * (per_row - old)

    def _sample_rows(
        self, core: TickContext, outputs: list[tuple[int, int]], running: list[Any], logits: Any, now: float
    ) -> None:
        table = core.table
        row = 0
        n = len(outputs)
        while row < n:
            slot, idx = outputs[row]
            request = running[slot]
            d = table.draft_in_fill(slot)
            rows = list(range(row, row + 1 + d))
            row += 1 + d
            if d == 0:
                token = core.sample_row(slot, request, idx, logits, rows[0])
                if token is not None:
                    core.emit_token(slot, request, token, now)
                continue
            self._verify(core, slot, request, [outputs[r][1] for r in rows], logits, rows, now)

    def _verify(
        self,
        core: TickContext,
        slot: int,
        request: Request,
        idxs: list[int],
        logits: np.ndarray | None,
        rows: list[int],
        now: float,
    ) -> None:
        table = core.table
        st = self.state(request)
        d = len(idxs) - 1
        draft = st.draft[:d]
        tokens: list[int] = []
        error: SamplingError | None = None
        if st.rule == "sampled":
            rows_logits = np.stack([core.context.logits_view(i) for i in idxs]).astype(np.float32)
            n_acc, nxt = self.drafter.verify(
                request.arrival, _draft_of(draft, st), rows_logits, request.params
            )
            tokens = [*draft[:n_acc], nxt]
        else:
            for i in range(d + 1):
                try:
                    token = core.sample_row(slot, request, idxs[i], logits, rows[i], n_before=len(tokens))
                except SamplingError as exc:  # a grammar at a dead end: what came before is emitted
                    error = exc
                    break
                assert token is not None
                tokens.append(token)
                if i < d and token != draft[i]:
                    break
        # drafts accepted: all tokens but the last (the next decode input), or all before an error
        n_acc = len(tokens) - 1 if error is None else len(tokens)
        self._account(st, d, n_acc)
        if st.cls == GRAMMAR_CLASS and self.grammar is not None:
            self.grammar.verified(request.arrival, d, n_acc, tokens)
        request.spec_counts[0] += d
        counters = core.counters
        # the tick's counts knew one decode token per stream: drafts were computed too, and
        # the kept ones are generated tokens (stats' batch_tokens, decode_tokens, tokens/s)
        counters.batch_tokens += d
        counters.spec_drafts += 1
        counters.spec_draft_tokens += d
        per_pos = counters.spec_accepted_per_pos
        if len(per_pos) < d:
            per_pos.extend([0] * (d - len(per_pos)))
        if d - n_acc:
            table.reject(slot, d - n_acc)
            core.context.seq_rm(slot, table.n_past(slot), -1)
        base = table.n_past(slot) - 1 - n_acc  # n_past before the pending token was decoded
        logprobs = request.state.logprobs
        kept = 0  # accepted drafts emitted so far (a stop or limit inside the run cuts it)
        for i, token in enumerate(tokens):
            if logprobs is not None:  # from the row the token was sampled at
                logprobs.append(core.logprobs(idxs[i], token, request.params.logprobs or 0))
            last = i == len(tokens) - 1
            # emitting token i keeps draft i - 1 (and, after an error, the token is a draft too)
            while kept < min(n_acc, i + (1 if last and error is not None else 0)):
                per_pos[kept] += 1
                kept += 1
                request.spec_counts[1] += 1
                counters.decode_tokens += 1
                counters.spec_accepted_tokens += 1
            n_past = base + 1 + i
            if not core.emit_token(slot, request, token, now, n_past=n_past, last=last and error is None):
                return
        if error is not None:
            core.finish(slot, "error", error=error)

    def _account(self, st: _SpecState, d: int, n_acc: int) -> None:
        st.drafted += d
        st.accepted += n_acc
        self.drafted += d
        self.accepted += n_acc
        self.acceptance.observe(st.acc(st.cls), d, n_acc, st.cls)
        self.ledger.accepted(n_acc)
        if self._draft_ticks <= self.policy.explore_ticks and n_acc < d:
            self._lessons_held = False

    def _book_drafts(self, drafts: int, rows: int) -> None:
        """Open the ledger's account of the tick just decoded with ``drafts`` draft tokens
        among its ``rows`` logits rows: its time against the same tick's predicted without."""
        if self._decoded is None:
            return
        features, seconds = self._decoded
        self._decoded = None
        base = self.cost.predict(TickFeatures(features.tokens - drafts, features.outputs - drafts, 0.0))
        # (drafts never make a tick cheaper: an early, loose fit is not taken above the measure)
        self.ledger.drafted(seconds, min(base, seconds), rows - drafts, drafts, self.row_cost)

    # -- the end of a request -------------------------------------------------------------

    def counts(self, request: Request) -> tuple[int, int]:
        """``(drafted, accepted)`` tokens of ``request`` so far."""
        st = self._states.get(request.arrival)
        return (st.drafted, st.accepted) if st is not None else (0, 0)

    def release(self, request: Request, *, done: bool = True) -> None:
        """``request`` ended (``done``) or was preempted."""
        if done:
            self._states.pop(request.arrival, None)
        elif (st := self._states.get(request.arrival)) is not None:
            st.synced = -1  # the drafter forgets what it held of it
        try:
            self.drafter.release(request.arrival, done=done)
            if done and self.grammar is not None:
                self.grammar.release(request.arrival)
            remember = getattr(self.drafter, "remember", None)
            if done and remember is not None and request.params.speculative and request.kind is not _PIN:
                remember(request.prompt_tokens, request.output_tokens)
        except Exception:  # pragma: no cover - a drafter's cleanup never fails a request
            logger.exception("speculative drafter release failed")

    def close(self) -> None:
        self.drafter.close()

    def memory(self) -> tuple[int, int]:
        """``(tokens, bytes)`` of histories the drafter holds (the suffix method's shared
        history and the running requests' own; ``(0, 0)`` for a drafter that keeps none)."""
        memory = getattr(self.drafter, "memory", None)
        return memory() if memory is not None else (0, 0)


_PIN = RequestKind.PIN


def spec_stats(spec: Speculator | None) -> dict[str, Any]:
    """``GenerationStats``' ``spec_history_tokens`` / ``spec_history_bytes`` and
    ``spec_grammar_*`` of ``spec``."""
    tokens, nbytes = spec.memory() if spec is not None else (0, 0)
    grammar = spec.grammar if spec is not None else None
    return {
        "spec_history_tokens": tokens,
        "spec_history_bytes": nbytes,
        "spec_grammar_drafts": grammar.drafts if grammar is not None else 0,
        "spec_grammar_draft_tokens": grammar.draft_tokens if grammar is not None else 0,
        "spec_grammar_accepted_tokens": grammar.accepted if grammar is not None else 0,
    }


def lookup_drafter(config: dict[str, Any]) -> Drafter:
    """The drafter of the ``ngram`` and ``suffix`` methods: longest matches over the whole
    history (``spec_suffix.SuffixDrafter``; ``suffix`` adds the history shared across
    requests), or, when ``prompt_lookup_max`` bounds the suffix, the bounded n-gram lookup."""
    if config["method"] == "ngram" and config.get("prompt_lookup_max") is not None:
        return NgramDrafter(config["prompt_lookup_min"], config["prompt_lookup_max"])
    shared = SharedHistory(config["suffix_cache_tokens"]) if config["method"] == "suffix" else None
    return SuffixDrafter(config["prompt_lookup_min"], shared)


def speculator_for(
    config: dict[str, Any] | None,
    model: Model,
    *,
    n_seq: int,
    n_ctx: int,
    n_batch: int,
    n_threads: int | None = None,
) -> Speculator | None:
    """The engine's ``Speculator`` of a checked ``speculative_config`` (None: off; the sizes:
    ``Speculator.from_config``). Recurrent and hybrid models cannot speculate (their memory
    cannot drop rejected positions): off, with a warning, as prefix reuse."""
    if not config:
        return None
    if model.is_recurrent or model.is_hybrid:
        logger.warning(
            "llamabatch: speculative decoding switched off: %s has %s memory (rejected drafts "
            "cannot be removed)",
            model.path.name,
            "recurrent" if model.is_recurrent else "hybrid",
        )
        return None
    return Speculator.from_config(
        config, model, n_seq=n_seq, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads
    )


def latency_room(core: TickContext, n_decode: int, room: int) -> int:
    """The most draft tokens (up to ``room``) that keep the tick's predicted decode time
    under its limit (``TickContext.tick_limit``: under ``target_itl_ms``, what the
    ``LatencyBudget``'s plans aim at, the target over the model's recent error), as the
    limit's cost model predicts it (``spec_policy.tick_cost``)."""
    limit = core.tick_limit
    assert limit is not None
    return most_within(tick_cost(core, n_decode, limit.model), limit.seconds, room)


def _draft_of(tokens: list[int], st: _SpecState) -> Draft:
    q = st.q[: len(tokens)] if st.q is not None else None
    return Draft(tokens, "sampled", q)  # type: ignore[arg-type]
