"""Drafts cut where the tokens after a point could never be used: at an image's stand-in ids,
and before a token that would end the request."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable
from itertools import accumulate
from typing import TYPE_CHECKING

from llamabatch.generate.draft_model import Draft

if TYPE_CHECKING:
    from llamabatch.generate.request import Request

__all__ = ["cut_at_ends", "first_end", "text_drafts"]


def cut_at_ends(
    drafts: dict[Hashable, Draft], requests: Iterable[Request], end: Callable[[Request, list[int]], int]
) -> dict[Hashable, Draft]:
    """``drafts`` each cut before the first token that would end its request (``requests``,
    by ``arrival``; ``end``: ``TickContext.draft_end``, see :func:`first_end`). Nothing after
    that token could be emitted, and the token itself needs no row of its own: the last
    draft's row samples it (a draft that starts with it is dropped). A lookup runs on past a
    quoted text's end into the chat template and the answer so far: SmolLM2 copying a
    paragraph drafted 62 tokens where 17 were left to emit, a 269 ms tick where 18 rows take
    about 70 ms."""
    out = drafts
    for request in requests:
        draft = drafts.get(request.arrival)
        if draft is None:
            continue
        i = end(request, draft.tokens)
        if i < len(draft.tokens):
            if out is drafts:
                out = dict(drafts)
            if i:
                q = draft.q[:i] if draft.q is not None else None
                out[request.arrival] = Draft(draft.tokens[:i], draft.rule, q)
            else:
                del out[request.arrival]
    return out


def first_end(
    tokens: list[int], request: Request, eog: bytes | bytearray, piece: Callable[[int, bool], bytes]
) -> int:
    """The index of the first of ``tokens`` (drafted after ``request``'s output) that would end
    ``request``, else ``len(tokens)``: an end-of-generation token (``eog``: flags by token id;
    unless ``ignore_eos``), one of its ``stop_token_ids``, or the token that completes one of
    its ``stop`` strings (``piece``: a token's bytes, special tokens rendered or not), counted
    from the output's last bytes. A few-shot prompt's next ``Q:`` is a stop string a lookup
    drafts through. Bytes, not text: a stop string's UTF-8 bytes stand in the output's bytes
    where it stands in the text (a false match would only shorten a draft). Each stop string
    is searched for once, over the output's tail and the whole draft: 64 stop strings of
    1,024 characters cost what the emission of one token costs, not that per drafted token."""
    params = request.params
    flags = None if params.ignore_eos else eog
    stop_ids = request.stop_ids
    end = len(tokens)
    for i, token in enumerate(tokens):
        if (flags is not None and flags[token]) or token in stop_ids:
            end = i
            break
    if not params.stop or not end:
        return end
    stops = [s.encode() for s in params.stop]
    special = not params.skip_special_tokens
    longest = max(len(s) for s in stops)
    tail: list[bytes] = []  # the output's last bytes, where a stop string could begin
    size = 0
    for token in reversed(request.output_tokens[-longest:]):
        if size >= longest:
            break
        tail.append(piece(token, special))
        size += len(tail[-1])
    head = b"".join(reversed(tail))[-(longest - 1) :] if longest > 1 else b""
    pieces = [piece(t, special) for t in tokens[:end]]
    ends = list(accumulate(map(len, pieces), initial=len(head)))  # each token's end in text
    text = head + b"".join(pieces)
    for stop in stops:
        at = text.find(stop, max(0, len(head) - len(stop) + 1))
        if at >= 0:  # the draft token whose bytes hold the stop string's last byte
            end = min(end, bisect_left(ends, at + len(stop), 1) - 1)
    return end


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
