"""Longest-match drafts (``spec_suffix.SuffixDrafter``): from the request's own history with
no suffix limit, and across requests through the shared history (``"method": "suffix"``);
the scheduler state machine on the fake context with cross-request drafts, whose
completions stay those of a run without speculation."""

from __future__ import annotations

import pytest
from fake_llama import make_core
from fake_scheduling import Recorder, greedy, prompt
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_scheduler_machine import SchedulerMachine
from test_speculative_fake import CHEAP_DRAFTS

from llamabatch.generate import speculative
from llamabatch.generate.draft_model import DraftJob
from llamabatch.generate.spec_suffix import SHARED_CLASS, SuffixDrafter, match_class
from llamabatch.generate.speculative import SpecPolicy, Speculator
from llamabatch.generate.suffix_index import SharedHistory


def _job(key, prompt_tokens, output, k=8):
    return DraftJob(key, prompt_tokens, output, k, greedy(64))


def test_the_longest_match_drafts_whatever_its_length():
    text = list(range(10, 40))
    drafter = SuffixDrafter()
    # the history ends with the first 20 tokens of the passage again: a 20-token match
    drafts = drafter.draft([_job("a", [*text, 1, 2], text[:20])])
    assert drafts["a"].tokens == text[20:28]
    assert drafter.last_match["a"] == match_class(20) == 8


def test_a_loop_drafts_past_the_end_of_its_history():
    drafter = SuffixDrafter()
    drafts = drafter.draft([_job("a", [5, 6, 7, 5, 6, 7, 5], [6], k=10)])
    assert drafts["a"].tokens == [7, 5, 6, 7, 5, 6, 7, 5, 6, 7]


def test_no_draft_below_the_minimum_match_and_none_without_a_repeat():
    drafter = SuffixDrafter(min_match=3)
    assert drafter.draft([_job("a", [1, 2, 9, 1], [2])]) == {}
    assert SuffixDrafter(min_match=1).draft([_job("b", [1, 2, 3], [4])]) == {}


def test_the_history_grows_incrementally_and_restarts_when_it_shrinks():
    drafter = SuffixDrafter()
    p = [1, 2, 3, 4, 1, 2]
    assert drafter.draft([_job("a", p, [])])["a"].tokens[:2] == [3, 4]
    assert drafter.draft([_job("a", p, [3])])["a"].tokens[:2] == [4, 1]
    assert drafter.draft([_job("a", [7, 8, 9, 7, 8], [])])["a"].tokens[:1] == [9]  # shorter: rebuilt


def test_a_long_history_is_caught_up_over_several_calls():
    drafter = SuffixDrafter()
    drafter.CATCH_UP = 10
    text = list(range(100, 125))
    job = _job("a", text, text[:3])  # 28 tokens: three calls
    assert drafter.draft([job]) == {} and drafter.draft([job]) == {}
    assert drafter.draft([job])["a"].tokens == text[3:11]


def test_a_second_request_drafts_the_first_answer_from_the_shared_history():
    shared = SharedHistory(1 << 12)
    drafter = SuffixDrafter(shared=shared)
    question, answer = prompt(30, 1), prompt(40, 2)
    assert drafter.draft([_job("first", question, answer[:1])]).get("first") is None
    drafter.release("first")
    drafter.remember(question, answer)
    drafts = drafter.draft([_job("again", question, answer[:1], k=16)])
    assert drafts["again"].tokens == answer[1:17]
    assert drafter.last_match["again"] >= SHARED_CLASS
    tokens, nbytes = drafter.memory()
    assert tokens >= len(question) + len(answer) and nbytes > 0


def test_the_own_history_wins_a_tie():
    shared = SharedHistory(1 << 12)
    drafter = SuffixDrafter(shared=shared)
    drafter.remember([1, 2, 3], [50, 51])
    drafts = drafter.draft([_job("a", [1, 2, 3, 60, 1, 2], [3])])
    assert drafts["a"].tokens[0] == 60 and drafter.last_match["a"] < SHARED_CLASS


def _suffix(core, min_match=2, max_tokens=1 << 12, k=8, **policy):
    drafter = SuffixDrafter(min_match, SharedHistory(max_tokens))
    config = {"method": "suffix", "num_speculative_tokens": k}
    core.spec = Speculator(config, drafter, SpecPolicy(**policy))
    if core.context.cost is None:
        core.context.cost = CHEAP_DRAFTS
        core.clock = core.context.clock
    return drafter


def test_a_retried_request_is_drafted_in_full_on_the_fake_context():
    core, ctx, model = make_core(n_parallel=1, n_batch=80)
    drafter = _suffix(core, k=32)
    rec = Recorder(core, ctx, model)
    p = prompt(12, 7)
    (first,) = rec.new(p, greedy(40))
    rec.run()
    (again,) = rec.new(p, greedy(40))
    rec.run()
    rec.check_done(first)
    rec.check_done(again)
    assert again.output.token_ids == first.output.token_ids
    t = again.output.timings
    assert t.spec_accepted_tokens >= 30 and t.spec_accepted_tokens == t.spec_draft_tokens
    assert drafter.shared_drafts > 0


def test_opted_out_requests_neither_draft_nor_join_the_shared_history():
    core, ctx, model = make_core(n_parallel=1, n_batch=80)
    drafter = _suffix(core, k=32)
    rec = Recorder(core, ctx, model)
    p = prompt(12, 8)
    (first,) = rec.new(p, greedy(30, speculative=False))
    rec.run()
    assert drafter.shared.documents == 0
    (again,) = rec.new(p, greedy(30))
    rec.run()
    rec.check_done(again)
    assert first.output.timings.spec_draft_tokens == 0
    assert drafter.shared.documents == 1


class CrossRequestMachine(SchedulerMachine):
    """``SchedulerMachine`` (its prompts share prefixes and often repeat) with the suffix
    method: drafts from each request's own history and from the ended requests', in a shared
    history bounded from tiny (constant rotation) to roomy."""

    @initialize(min_match=st.integers(1, 3), max_tokens=st.sampled_from([8, 64, 4096]), k=st.integers(1, 16))
    def choose_speculation(self, min_match, max_tokens, k):
        self.spec_choice = (min_match, max_tokens, k)

    @rule(n=st.integers(1, 8))
    def step(self, n):
        if self.core.spec is None:
            min_match, max_tokens, k = self.spec_choice
            self.drafter = _suffix(self.core, min_match, max_tokens, k)
        super().step(n)

    def teardown(self):
        super().teardown()
        if hasattr(self, "drafter"):
            c = self.core.counters
            assert c.spec_accepted_tokens <= c.spec_draft_tokens
            shared = self.drafter.shared
            assert shared.n_tokens <= shared.max_tokens + shared.max_tokens // 2 + 1


TestCrossRequestMachine = CrossRequestMachine.TestCase
TestCrossRequestMachine.settings = settings(settings.default, stateful_step_count=60, max_examples=60)


# -- on llama.cpp ---------------------------------------------------------------------------


@pytest.fixture
def always_draft(monkeypatch):
    """On llama.cpp, drafting must happen whatever this machine's timings say it is worth
    (margin -1: any draft beats none; no bound on what drafts cost); what pays is the benchmarks' question."""
    monkeypatch.setattr(speculative, "SpecPolicy", lambda: SpecPolicy(margin=-1.0, loss_share=None))


def test_suffix_outputs_match_the_reference_and_the_history_is_counted(tiny_path, reference, always_draft):
    """Random model: the suffix method's outputs (requests asked twice, interleaved) are the
    teacher-forced reference's by log-probability; ``stats()`` counts the shared history."""
    from llama_reference import check_against_reference

    from llamabatch import LLM, SamplingParams

    prompts = ["the cat sat on the mat. the cat", "one two three", "hello world"]
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=2)
    spec = {"method": "suffix", "suffix_cache_tokens": 4096}
    with LLM(tiny_path, n_ctx=1024, n_parallel=2, flash_attn=False, speculative_config=spec) as llm:
        first = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    check_against_reference(reference, first + again, top_n=2)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert sum(o.timings.spec_accepted_tokens for o in again) > 0
    assert stats.spec_history_tokens >= sum(len(o.token_ids) for o in first)
    assert 0 < stats.spec_history_bytes < 4096 * 400


def test_a_retried_chat_on_the_real_model_is_the_same_token_for_token(smollm2_path, always_draft):
    """SmolLM2: a chat answered again with ``suffix`` equals the answer without speculation
    token for token, and the second time its drafts (from the first answer) hold."""
    from llamabatch import LLM, SamplingParams

    chat = [{"role": "user", "content": "Write a short poem about the sea, in four lines."}]
    params = SamplingParams(max_tokens=48, temperature=0)
    outs = {}
    for spec in (None, {"method": "suffix"}):
        with LLM(smollm2_path, n_ctx=1024, n_parallel=1, n_threads=1, speculative_config=spec) as llm:
            outs[spec is None] = [llm.chat(chat, params)[0].outputs[0] for _ in range(2)]
    plain, speculated = outs[True], outs[False]
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    second = speculated[1].timings  # (how long its drafts are is this machine's timings' choice)
    assert second.spec_accepted_tokens >= len(plain[1].token_ids) // 4, second
    assert second.spec_accepted_tokens >= second.spec_draft_tokens - 1, second


def test_bench_retry_workload_with_the_suffix_method(tiny_path, capsys):
    import json

    from llamabatch.bench.workloads import open_tokenizer, retry_requests
    from llamabatch.cli import main

    vocab = open_tokenizer(tiny_path)
    try:
        requests = retry_requests(vocab, 32, 8, 2)
    finally:
        vocab.close()
    assert [r.prompt for r in requests[2:]] == [r.prompt for r in requests[:2]]
    assert requests[0].prompt != requests[1].prompt
    argv = ["bench", "-m", str(tiny_path), "--workload", "retry", "--npp", "32", "--ntg", "16", "--npl", "1"]
    argv += ["--spec-type", "suffix", "-t", "2", "--json", "--no-progress"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["workload"], r["npl"], r["speculative"]) for r in rows] == [("retry", 1, "suffix:64")]


def test_drafts_longer_than_a_tile_do_not_change_the_answer(smollm2_path, always_draft):
    """SmolLM2, a 120-token story asked twice with ``suffix``: the second time the whole first
    answer is drafted, 64 tokens a tick. A tick of 64 rows or more in one KV stream switches
    CPU flash attention (f16 cache) to its tiled kernel, whose sums round otherwise than the
    one-row kernel a decode without drafts takes, and a near tie flipped at token 31. Drafts
    keep the tick's rows per stream under 64 (``SlotTable.draft_rows_below``): the answers are
    the plain run's token for token, and the second one's drafts hold."""
    from llamabatch import LLM, SamplingParams

    story = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    chat = [{"role": "user", "content": story}]
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    outs = {}
    for spec in (None, {"method": "suffix"}):
        with LLM(smollm2_path, n_ctx=1024, n_parallel=1, speculative_config=spec) as llm:
            outs[spec is None] = [llm.chat(chat, params)[0].outputs[0] for _ in range(2)]
            if spec:
                assert llm.stats().flash_attn and llm.stats().kv_type_k == "f16"
    plain, speculated = outs[True], outs[False]
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    second = speculated[1].timings
    assert second.spec_accepted_tokens >= len(plain[1].token_ids) // 2, second
