"""The byte bound on text prompts (issue 26): a text whose UTF-8 bytes exceed the context's
tokens times the longest token's bytes cannot fit, so it is refused before tokenizing.

The bound must be sound: it never refuses a text that would fit. For the SentencePiece and
byte-level BPE vocabularies it is used with, every token stands for at most the longest
token's bytes, so n tokens cover at most n times that many bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch import LLM, PromptTooLong, SamplingParams
from llamabatch.generate.llm_engine import prompt_bytes_bound
from llamabatch.gguf.testing import model_path


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model_path("tiny"), n_ctx=1024, n_parallel=2, n_threads=1) as llm:
        yield llm


def test_the_bound_is_the_context_times_the_longest_token(llm):
    longest = max(len(llm.model.token_to_piece(t, special=True)) for t in range(llm.model.n_vocab))
    assert llm.max_prompt_bytes == llm.n_ctx_seq * max(longest, 4)
    assert prompt_bytes_bound(llm.model, 10) == 10 * max(longest, 4)


def test_a_text_over_the_bound_is_refused_before_tokenizing(llm):
    per_token = llm.max_prompt_bytes // llm.n_ctx_seq
    max_tokens = 16
    room = llm.n_ctx_seq - max_tokens
    with pytest.raises(PromptTooLong, match="refused before tokenizing"):
        llm.submit("a" * (room * per_token + 1), SamplingParams(max_tokens=max_tokens))
    with pytest.raises(PromptTooLong, match="refused before tokenizing"):
        llm.check_prompt_bytes("é" * (llm.max_prompt_bytes // 2 + 1))  # 2 bytes a character
    llm.check_prompt_bytes("a" * llm.max_prompt_bytes)  # at the bound: tokenizing decides
    # truncate=True keeps the prompt's end, so the bound does not apply
    out = llm.generate(
        "a" * (room * per_token + 1), SamplingParams(max_tokens=2, truncate=True), use_tqdm=False
    )[0]
    assert out.outputs[0].usage.prompt_tokens == llm.n_ctx_seq - 2


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=400))
def test_the_bound_is_sound(llm, text):
    """No text takes fewer tokens than its bytes over the longest token's bytes."""
    per_token = llm.max_prompt_bytes // llm.n_ctx_seq
    try:
        tokens = llm.tokenize(text, parse_special=True)
    except ValueError:  # lone surrogates: not valid Unicode
        return
    assert len(tokens) * per_token >= len(text.encode("utf-8"))
