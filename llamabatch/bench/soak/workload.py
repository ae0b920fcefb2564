"""The soak's requests: random prompts and sampling parameters of every kind."""

from __future__ import annotations

import random
from typing import Any

from llamabatch.bench.soak.config import GRAMMAR, LONG_MAX_TOKENS, MAX_PROMPT, MAX_SEQ_TOKENS, MAX_TOKENS

# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class Workload:
    """Prompts (text and token ids, mixed lengths) and sampling parameters, drawn at random."""

    def __init__(self, model_path: str) -> None:
        from llamabatch import Model
        from llamabatch.gguf.testing import english_sentences

        model = Model(model_path)
        try:
            sentences = english_sentences(400)
            #: (text, its token count), short enough to be a prompt
            self.texts: list[tuple[str, int]] = []
            self.tokens: list[int] = []
            for text in sentences:
                ids = model.tokenize(text, add_special=True, parse_special=True)
                if len(ids) <= MAX_PROMPT:
                    self.texts.append((text, len(ids)))
                self.tokens += model.tokenize(" " + text, add_special=False)
            self.bos = model.bos
        finally:
            model.close()
        if not self.texts or len(self.tokens) < 4 * MAX_PROMPT:
            raise ValueError(f"{model_path}: its vocabulary gives too few prompt tokens for a soak")

    def prompt(self, rng: random.Random, max_tokens: int) -> Any:
        """A text or token-id prompt that leaves room for ``max_tokens`` in ``MAX_SEQ_TOKENS``."""
        room = min(MAX_PROMPT, MAX_SEQ_TOKENS - max_tokens)
        if rng.random() < 0.4:
            text, n = rng.choice(self.texts)
            if n <= room:
                return text
        r = rng.random()
        length = rng.randint(1, 16) if r < 0.7 else rng.randint(17, 48) if r < 0.95 else rng.randint(49, 95)
        length = min(length, room - 1)  # + BOS
        start = rng.randrange(len(self.tokens) - length)
        return [self.bos, *self.tokens[start : start + length]]

    @staticmethod
    def params(rng: random.Random) -> Any:
        from llamabatch import SamplingParams

        kw: dict[str, Any] = {
            # a few long generations fill a tight unified KV cache: preemption
            "max_tokens": rng.choice(MAX_TOKENS) if rng.random() < 0.9 else rng.choice(LONG_MAX_TOKENS),
            "ignore_eos": rng.random() < 0.5,
        }
        if rng.random() < 0.4:
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=rng.uniform(0.5, 1.2), top_k=rng.choice([0, 20, 40]), top_p=0.95)
            if rng.random() < 0.6:
                kw["seed"] = rng.randrange(2**31)
        r = rng.random()
        if r < 0.06:
            kw["n"] = 3
        elif r < 0.15:
            kw["n"] = 2
        if rng.random() < 0.1:
            kw["stop"] = [rng.choice(["e", "th", "s ", "\n", "a"])]
        if rng.random() < 0.04:
            kw["grammar"] = GRAMMAR
        if rng.random() < 0.05:
            kw["logprobs"] = 2
        if rng.random() < 0.05:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        if rng.random() < 0.1:
            kw["repeat_penalty"] = 1.1
        return SamplingParams(**kw)
