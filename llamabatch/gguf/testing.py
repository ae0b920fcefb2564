"""The test models, in one place (the README's ``llamabatch.testing`` is this module): the
random-weight Llama models and English sentences (``testing_llama.py``), draft/target pairs and
the loop model for speculative decoding (``testing_draft.py``), a sliding-window model
(``testing_swa.py``), vision projectors (``testing_vision.py``, ``testing_gemma3_vision.py``),
LoRA adapters (``testing_lora.py``), the real SmolLM2-135M-Instruct (``real_model.py``); and
:func:`loop_prompts`, which runs a loop model through llama.cpp to find its prompts.
"""

from __future__ import annotations

import os

from llamabatch.gguf.real_model import real_model_path
from llamabatch.gguf.testing_draft import PAIR_PRESETS, DraftPair, draft_pair, loop_model
from llamabatch.gguf.testing_llama import (
    BOS_ID,
    BYTE_TOKEN_OFFSET,
    CHATML_TEMPLATE,
    EOS_ID,
    FIM_IDS,
    FORMAT_VERSION,
    IM_END_ID,
    IM_START_ID,
    N_SPECIAL_TOKENS,
    PRESETS,
    UNK_ID,
    ModelSpec,
    build_vocab,
    built_once,
    cache_dir,
    english_sentences,
    model_path,
    spec_hash,
    write_llama_gguf,
)
from llamabatch.gguf.testing_lora import LORA_TARGETS, lora_ranks, make_lora
from llamabatch.gguf.testing_swa import SWASpec, make_swa_model
from llamabatch.gguf.testing_vision import GEMMA3_TEXT, QWEN2VL_TEXT, VisionSpec, make_vision_model

__all__ = [
    "BOS_ID",
    "BYTE_TOKEN_OFFSET",
    "CHATML_TEMPLATE",
    "EOS_ID",
    "FIM_IDS",
    "FORMAT_VERSION",
    "GEMMA3_TEXT",
    "IM_END_ID",
    "IM_START_ID",
    "LORA_TARGETS",
    "N_SPECIAL_TOKENS",
    "PAIR_PRESETS",
    "PRESETS",
    "QWEN2VL_TEXT",
    "UNK_ID",
    "DraftPair",
    "ModelSpec",
    "SWASpec",
    "VisionSpec",
    "build_vocab",
    "built_once",
    "cache_dir",
    "draft_pair",
    "english_sentences",
    "loop_model",
    "loop_prompts",
    "lora_ranks",
    "make_lora",
    "make_swa_model",
    "make_vision_model",
    "model_path",
    "real_model_path",
    "spec_hash",
    "write_llama_gguf",
]


def loop_prompts(path: str | os.PathLike[str], n: int, n_tokens: int) -> list[list[int]]:
    """``n`` prompts of ``n_tokens`` tokens for the :func:`loop_model` at ``path``: each the
    greedy walk from its own first token, kept when it closed a cycle of tokens within
    ``n_tokens``, so that its greedy continuation repeats the prompt's own text."""
    import numpy as np

    from llamabatch._ffi.context import Context
    from llamabatch._ffi.model import Model

    out: list[list[int]] = []
    with Model(path) as model, Context(model, n_ctx=max(256, n_tokens + 1), n_seq_max=1) as ctx:
        start = model.n_vocab // 3
        while len(out) < n and start < model.n_vocab:
            walk = [start]
            ctx.memory_clear()
            ctx.decode_tokens([start])
            while len(walk) < n_tokens:
                walk.append(int(np.argmax(ctx.logits_ith(0))))
                ctx.decode_tokens([walk[-1]], pos0=len(walk) - 1)
            start += 1
            if walk[-1] in walk[:-1]:  # the walk is in its cycle: what follows is in the prompt
                out.append(walk)
    return out
