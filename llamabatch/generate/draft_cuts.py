"""Drafts cut where the tokens after a point could never be used: at an image's stand-in ids,
and before a token that would end the request."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from llamabatch.generate.draft_model import Draft

if TYPE_CHECKING:
    from llamabatch.generate.request import Request

__all__ = ["cut_at_ends", "text_drafts"]


def cut_at_ends(
    drafts: dict[Hashable, Draft], requests: Iterable[Request], eog: bytes | bytearray | None
) -> dict[Hashable, Draft]:
    """``drafts`` each cut before the first token that would end its request (``requests``,
    by ``arrival``): an end-of-generation token (``eog``: flags by token id; unless
    ``ignore_eos``) or one of its ``stop_token_ids``. Nothing after that token could be
    emitted, and the token itself needs no row of its own: the last draft's row samples it
    (a draft that starts with it is dropped). A lookup runs on past a quoted text's end into
    the chat template and the answer so far: SmolLM2 copying a paragraph drafted 62 tokens
    where 17 were left to emit, a 269 ms tick where 18 rows take about 70 ms."""
    out = drafts
    for request in requests:
        draft = drafts.get(request.arrival)
        if draft is None:
            continue
        stop_ids = request.stop_ids
        flags = None if request.params.ignore_eos else eog
        for i, token in enumerate(draft.tokens):
            if (flags is not None and flags[token]) or token in stop_ids:
                if out is drafts:
                    out = dict(drafts)
                if i:
                    q = draft.q[:i] if draft.q is not None else None
                    out[request.arrival] = Draft(draft.tokens[:i], draft.rule, q)
                else:
                    del out[request.arrival]
                break
    return out


def text_drafts(drafts: dict[Hashable, Draft]) -> dict[Hashable, Draft]:
    """``drafts`` cut before their first image stand-in id (negative, ``vision.py``): a history
    lookup that runs into a prompt's image would otherwise draft its positions as tokens.
    Without images (every tick of a text model) this is one ``min`` per draft."""
    if all(min(draft.tokens, default=0) >= 0 for draft in drafts.values()):
        return drafts
    out = {}
    for key, draft in drafts.items():
        cut = next((i for i, token in enumerate(draft.tokens) if token < 0), None)
        if cut is None:
            out[key] = draft
        elif cut:
            q = draft.q[:cut] if draft.q is not None else None
            out[key] = Draft(draft.tokens[:cut], draft.rule, q)
    return out
