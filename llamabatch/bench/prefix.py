"""Prefix-reuse workloads (issue 6 targets), each run with reuse on and off side by side.

- ``shared_system_prompt``: requests that share a long system prompt, each with a few
  unique tokens, all submitted at once: total time and median time to first token.
- ``multi_turn_chat``: conversations whose every turn resends the whole history (as a
  chat client does): prompt tokens actually computed, with and without reuse.

Conversations are built from token ids (prompt + the reply's tokens + the next user turn)
so that a history is a token prefix of the next turn, as it is for a real model whose
replies re-tokenize the same way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from llamabatch.llm import LLM
from llamabatch.params import SamplingParams
from llamabatch.testing import english_sentences


@dataclass(frozen=True)
class PrefixRun:
    """One workload run with reuse on or off."""

    prefix_cache: bool
    wall_s: float
    median_ttft_s: float
    prompt_tokens: int
    computed_prompt_tokens: int
    reused_prompt_tokens: int


def _tokens_of(llm: LLM, text: str, n: int, add_special: bool = False) -> list[int]:
    tokens = llm.tokenize(text, add_special=add_special)
    while len(tokens) < n:
        tokens += tokens
    return tokens[:n]


def shared_system_prompt(
    model_path: str,
    *,
    n_requests: int = 16,
    system_tokens: int = 512,
    unique_tokens: int = 32,
    new_tokens: int = 32,
    n_parallel: int = 8,
    prefix_cache: bool = True,
    **llm_kwargs: Any,
) -> PrefixRun:
    """``n_requests`` prompts = one system prompt + unique tokens each, submitted at once."""
    sentences = english_sentences(n_requests + 200)
    n_ctx = n_parallel * (system_tokens + unique_tokens + new_tokens) + 512
    with LLM(model_path, n_ctx=n_ctx, n_parallel=n_parallel, prefix_cache=prefix_cache, **llm_kwargs) as llm:
        system = [llm.model.bos, *_tokens_of(llm, " ".join(sentences[:200]), system_tokens - 1)]
        prompts = [
            system + _tokens_of(llm, " " + sentences[200 + i], unique_tokens) for i in range(n_requests)
        ]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate([[llm.model.bos, 100, 200]], SamplingParams(max_tokens=2))  # warm up
        if prefix_cache:
            llm.clear_prefix_cache()
        before = llm.stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        after = llm.stats()
    return PrefixRun(
        prefix_cache,
        wall,
        statistics.median(o.timings.time_to_first_token or 0.0 for o in outs),
        sum(o.usage.prompt_tokens for o in outs),
        after["computed_prompt_tokens"] - before["computed_prompt_tokens"],
        after["reused_prompt_tokens"] - before["reused_prompt_tokens"],
    )


def multi_turn_chat(
    model_path: str,
    *,
    n_conversations: int = 8,
    n_turns: int = 4,
    system_tokens: int = 128,
    user_tokens: int = 48,
    reply_tokens: int = 48,
    n_parallel: int = 8,
    prefix_cache: bool = True,
    **llm_kwargs: Any,
) -> PrefixRun:
    """Conversations advancing in lockstep; each turn sends the whole history again."""
    sentences = english_sentences(n_conversations * n_turns + 100)
    per_conversation = system_tokens + n_turns * (user_tokens + reply_tokens)
    n_ctx = n_parallel * per_conversation + 512
    with LLM(model_path, n_ctx=n_ctx, n_parallel=n_parallel, prefix_cache=prefix_cache, **llm_kwargs) as llm:
        system = [llm.model.bos, *_tokens_of(llm, " ".join(sentences[:100]), system_tokens - 1)]
        histories = [list(system) for _ in range(n_conversations)]
        params = SamplingParams(max_tokens=reply_tokens, temperature=0, ignore_eos=True)
        before = llm.stats()
        ttfts, prompt_tokens = [], 0
        start = time.perf_counter()
        for turn in range(n_turns):
            for c, history in enumerate(histories):
                history += _tokens_of(llm, " " + sentences[100 + c * n_turns + turn], user_tokens)
            outs = llm.generate(histories, params)
            for history, out in zip(histories, outs, strict=True):
                prompt_tokens += out.usage.prompt_tokens
                ttfts.append(out.timings.time_to_first_token or 0.0)
                history += out.token_ids
        wall = time.perf_counter() - start
        after = llm.stats()
    return PrefixRun(
        prefix_cache,
        wall,
        statistics.median(ttfts),
        prompt_tokens,
        after["computed_prompt_tokens"] - before["computed_prompt_tokens"],
        after["reused_prompt_tokens"] - before["reused_prompt_tokens"],
    )


def compare(model_path: str, **llm_kwargs: Any) -> dict[str, Any]:
    """Both workloads with reuse off and on, side by side, with the issue's ratios."""
    shared_off = shared_system_prompt(model_path, prefix_cache=False, **llm_kwargs)
    shared_on = shared_system_prompt(model_path, prefix_cache=True, **llm_kwargs)
    chat_off = multi_turn_chat(model_path, prefix_cache=False, **llm_kwargs)
    chat_on = multi_turn_chat(model_path, prefix_cache=True, **llm_kwargs)
    return {
        "shared_system_prompt": {
            "off": asdict(shared_off),
            "on": asdict(shared_on),
            "total_time_ratio": shared_off.wall_s / shared_on.wall_s,
            "median_ttft_ratio": shared_off.median_ttft_s / shared_on.median_ttft_s,
        },
        "multi_turn_chat": {
            "off": asdict(chat_off),
            "on": asdict(chat_on),
            "computed_prompt_share": chat_on.computed_prompt_tokens / chat_off.computed_prompt_tokens,
            "total_time_ratio": chat_off.wall_s / chat_on.wall_s,
        },
    }
