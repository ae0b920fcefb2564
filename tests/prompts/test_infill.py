"""The fill-in-the-middle layout (``prompts/infill.py``): the repository-level pattern, the
3:1 prefix:suffix budget of ``n_batch``, the other files in what the context leaves."""

from __future__ import annotations

import pytest

from llamabatch.prompts.infill import InfillUnsupported, infill_tokens

FIM = {k: 1000 + i for i, k in enumerate(("pre", "suf", "mid", "rep", "sep"))}  # (no character here)
PRE, SUF, MID, REP, SEP = (FIM[k] for k in ("pre", "suf", "mid", "rep", "sep"))


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_repository_level_layout():
    tokens = infill_tokens(FIM, chars, "ab", "cd", extra=[("f.py", "x")], prompt="p", bos=1, n_ctx=10_000)
    assert tokens == [
        REP, *chars("myproject\n"), SEP, *chars("f.py\n"), *chars("x"), SEP, *chars("filename\n"),
        1, PRE, *chars("ab"), *chars("p"), SUF, *chars("cd"), MID,
    ]  # fmt: skip


def test_budgets_keep_the_code_nearest_the_cursor():
    prefix, suffix = "P" * 100 + "<", ">" + "S" * 100
    tokens = infill_tokens(
        {"pre": PRE, "suf": SUF, "mid": MID}, chars, prefix, suffix, n_batch=40, n_ctx=10_000
    )
    body = tokens[tokens.index(PRE) + 1 : tokens.index(SUF)]
    after = tokens[tokens.index(SUF) + 1 : tokens.index(MID)]
    assert len(body) == 30 and body[-1] == ord("<")  # 3/4 of n_batch, the end of the prefix
    assert len(after) == 8 and after[0] == ord(">")  # n_batch/4 - 2, the start of the suffix
    no_room = infill_tokens(FIM, chars, "a", "b", extra=[("f", "long text")], n_batch=64, n_ctx=64)
    assert no_room[0] == PRE  # the context leaves nothing for other files
    some = infill_tokens(FIM, chars, "a", "b", extra=[("f", "0123456789")], n_batch=64, n_ctx=70)
    assert some[: some.index(PRE)] == chars("filename\n")[-6:]  # the latest of them


def test_a_model_without_fim_tokens_cannot_fill_in():
    with pytest.raises(InfillUnsupported, match="pre, mid"):
        infill_tokens({"pre": -1, "suf": 5, "mid": -1}, chars, "a", "b")
    without_sep = infill_tokens(
        {"pre": PRE, "suf": SUF, "mid": MID}, chars, "a", "b", extra=[("f", "x")], n_ctx=9999
    )
    assert without_sep[: without_sep.index(PRE)] == chars("\n\n--- snippet ---\n\n") + chars("x")
