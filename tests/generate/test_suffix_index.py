"""The suffix automaton and the shared history against brute-force references (hypothesis):
the longest repeated suffix of a growing sequence and its first occurrence; a matcher's
longest suffix found in another sequence that keeps growing (states split under it); the
shared history's documents apart, its bound and its generations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch.generate.suffix_index import SharedHistory, SuffixAutomaton

tokens = st.lists(st.integers(0, 3), max_size=60)


def longest_repeat(text: list[int]) -> tuple[int, int]:
    """The longest suffix that also ends before the last position, and its first end."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        suffix = text[n - length :]
        for end in range(length - 1, n - 1):
            if text[end - length + 1 : end + 1] == suffix:
                return length, end
    return 0, -1


def longest_found(query: list[int], text: list[int]) -> tuple[int, int]:
    """The longest suffix of ``query`` found in ``text``, and its first end (0, -1: none)."""
    for length in range(len(query), 0, -1):
        suffix = query[len(query) - length :]
        for end in range(length - 1, len(text)):
            if text[end - length + 1 : end + 1] == suffix:
                return length, end
    return 0, -1


@settings(max_examples=300, deadline=None)
@given(tokens)
def test_repeat_is_the_longest_repeated_suffix_and_its_first_occurrence(text):
    sam = SuffixAutomaton()
    for i, t in enumerate(text):
        sam.append(t)
        assert sam.repeat() == longest_repeat(text[: i + 1])
    assert sam.n_states <= max(1, 2 * len(text))


def first_end(suffix: list[int], text: list[int]) -> int:
    n = len(suffix)
    return next(e for e in range(n - 1, len(text)) if text[e - n + 1 : e + 1] == suffix)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=80))
def test_a_matcher_follows_while_the_automaton_grows(ops):
    """Interleaved: a token appended to the automaton's text or to the followed query. The
    matcher's string is always found, first where ``end_of`` says; it is the longest while
    the text has not grown since the matcher started (text added later can make a longer
    suffix of the query appear, which a matcher cannot see: ``SharedHistory`` resyncs)."""
    sam = SuffixAutomaton()
    state, length = 0, 0
    text: list[int] = []
    query: list[int] = []
    for to_query, t in ops:
        if to_query:
            query.append(t)
            state, length = sam.step(state, length, t)
        else:
            text.append(t)
            sam.append(t)
        longest = longest_found(query, text)
        assert length <= longest[0]
        if length:
            assert sam.end_of(state, length) == first_end(query[len(query) - length :], text)
    state, length = 0, 0
    for t in query:
        state, length = sam.step(state, length, t)
    assert (length, sam.end_of(state, length) if length else -1) == longest_found(query, text)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), max_size=8), tokens, st.integers(1, 8))
def test_shared_history_matches_within_documents(docs, query, k):
    shared = SharedHistory(max_tokens=1000)  # no rotation
    for d in docs:
        shared.add(d)
    m = shared.match("q", query, k)
    best = 0
    for d in docs:
        best = max(best, longest_found(query, d)[0])
    if best == 0:
        assert m is None
        return
    assert m is not None and m.length == best
    # the continuation is what followed one occurrence of the match, in its document
    suffix = query[len(query) - best :]
    assert any(
        d[e - best + 1 : e + 1] == suffix and d[e + 1 : e + 1 + k] == m.tokens
        for d in docs
        for e in range(best - 1, len(d))
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=20), min_size=1, max_size=20))
def test_shared_history_is_bounded_and_keeps_the_latest_document(docs):
    shared = SharedHistory(max_tokens=40)
    for d in docs:
        shared.add(d)
        assert shared.n_tokens <= 40 + 21
        m = shared.match(object(), d[:-1] or d, 50)  # (a fresh matcher per query)
        assert m is not None
    last = docs[-1]
    m = shared.match("last", last, 50)
    assert m is not None and m.length == len(last)


def test_a_retried_request_drafts_the_first_answer_and_matchers_resync_after_rotation():
    shared = SharedHistory(max_tokens=64)
    prompt, answer = list(range(100, 110)), list(range(200, 220))
    shared.add(prompt + answer)
    m = shared.match("retry", prompt, 8)
    assert m is not None and m.length == len(prompt) and m.tokens == answer[:8]
    m = shared.match("retry", prompt + answer[:5], 100)
    assert m is not None and m.tokens == answer[5:]  # up to its document's end
    for i in range(3):  # others' documents rotate the generations
        shared.add(list(range(300 + 20 * i, 320 + 20 * i)))
    assert shared.rotations >= 1
    m = shared.match("retry", prompt + answer[:6], 4)
    # used from the old generation, the document was copied to the young one: it stays
    for i in range(3, 5):
        shared.add(list(range(300 + 20 * i, 320 + 20 * i)))
    m2 = shared.match("fresh", prompt + answer[:6], 4)
    if m is not None:
        assert m.tokens == answer[6:10]
        assert m2 is not None and m2.tokens == answer[6:10]
    assert shared.nbytes() > 0
