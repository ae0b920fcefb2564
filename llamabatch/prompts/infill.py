"""Fill-in-the-middle prompts (llama-server's ``/infill``, for code editors): the code before
and after the cursor, and other files as context, laid out in the repository-level FIM
pattern of code models (Qwen2.5-Coder and others; arXiv 2409.12186)::

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n text0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

as llama-server lays it out at our llama.cpp commit (``format_prompt_infill``): the prefix
keeps its last ``3/4`` of ``n_batch`` tokens, the suffix its first ``n_batch/4 - 2 - len(prompt)``,
and the other files fill what the context leaves (``n_ctx - n_batch - 2 n_predict``), the
latest first. A model without the prefix, suffix and middle tokens cannot fill in
(``InfillUnsupported``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

__all__ = ["InfillUnsupported", "infill_tokens"]

#: llama-server's chunk separator for a model without a file separator token
_SNIPPET = "\n\n--- snippet ---\n\n"


class InfillUnsupported(ValueError):
    """The model has no fill-in-the-middle tokens."""


def infill_tokens(
    fim: Mapping[str, int],
    tokenize: Callable[[str], list[int]],
    prefix: str,
    suffix: str,
    *,
    extra: Sequence[tuple[str, str]] = (),
    prompt: str = "",
    bos: int = -1,
    n_batch: int = 2048,
    n_predict: int = 0,
    n_ctx: int = 4096,
) -> list[int]:
    """The prompt's tokens. ``fim``: the model's FIM token ids (``Model.fim``; -1: none);
    ``tokenize``: text to tokens, no BOS, special tokens not parsed (code is not markup);
    ``extra``: other files as ``(filename, text)``; ``bos``: prepended when >= 0."""
    missing = [name for name in ("pre", "suf", "mid") if fim.get(name, -1) < 0]
    if missing:
        raise InfillUnsupported(f"the model has no fill-in-the-middle tokens ({', '.join(missing)} missing)")
    context: list[int] = []
    if fim.get("rep", -1) >= 0:
        context += [fim["rep"], *tokenize("myproject\n")]
    for filename, text in extra:
        if fim.get("sep", -1) >= 0:
            context += [fim["sep"], *tokenize(filename + "\n")]
        else:
            context += tokenize(_SNIPPET)
        context += tokenize(text)
    if fim.get("sep", -1) >= 0:
        context += [fim["sep"], *tokenize("filename\n")]
    before, after, asked = tokenize(prefix), tokenize(suffix), tokenize(prompt)
    n_prefix = min(len(before), 3 * (n_batch // 4))
    n_suffix = min(len(after), max(0, n_batch // 4 - (2 + len(asked))))
    n_context = min(max(0, n_ctx - n_batch - 2 * n_predict), len(context))
    head = [bos] if bos >= 0 else []
    return [
        *(context[len(context) - n_context :] if n_context else []),
        *head,
        fim["pre"],
        *before[len(before) - n_prefix :],
        *asked,
        fim["suf"],
        *after[:n_suffix],
        fim["mid"],
    ]
