"""The KV cells of images beyond their positions.

An M-RoPE model (Qwen-VL) places an image's ``n_tokens`` embeddings at ``n_pos`` positions
(the longer side of its grid, fewer than ``n_tokens``), all its cells at the image's first
temporal position. The slot table counts positions (what ``seq_rm``/``seq_cp`` address), so
it sees fewer cells than llama.cpp holds. Here is what it does not see, in cells: a prompt's
(:func:`prompt_cells`, what usage reports: llama-server counts an image's ``n_tokens``), what
admitting one takes beyond its positions (:func:`surcharge`), and what the sequences hold
beyond their positions (:class:`ImageCells`, from the stand-in ids that start such images).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["MAX_IMAGES", "ImageCells", "MediaPrompt", "prompt_cells", "surcharge"]

#: images remembered by their first stand-in id (LRU beyond it: a forgotten one still cached
#: in the KV cache is counted by its positions only, and a full cache evicts for it as before)
MAX_IMAGES = 65536


class MediaPrompt(Protocol):
    """A tokenized prompt with images (``vision.MediaPrompt``): one id per position, and
    each image's first position and chunk (``n_pos``, ``n_tokens``)."""

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def images(self) -> Sequence[tuple[int, Any]]: ...


def _grid(chunk: Any) -> bool:
    """Whether the image holds more cells than positions (M-RoPE)."""
    return bool(chunk.n_tokens > chunk.n_pos)


def prompt_cells(media: MediaPrompt, n: int) -> int:
    """The KV cells of the first ``n`` positions of ``media``'s prompt: ``n``, and for each
    M-RoPE image whose first position is among them its embeddings beyond the positions
    counted (its cells all sit at that first position, so they come and go together)."""
    cells = n
    for first, chunk in media.images:
        if first < n and _grid(chunk):
            cells += chunk.n_tokens - min(chunk.n_pos, n - first)
    return cells


def surcharge(media: MediaPrompt, kept: int) -> int:
    """The cells computing ``media``'s prompt from position ``kept`` takes beyond its
    ``len(tokens) - kept`` positions; an M-RoPE image that ``kept`` falls inside is computed
    again from its first position (as ``Vision.prefill`` does)."""
    start = kept
    for first, chunk in media.images:
        if first < kept < first + chunk.n_pos and _grid(chunk):
            start = first
    n = len(media.tokens)
    return prompt_cells(media, n) - prompt_cells(media, start) - (n - kept)


class ImageCells:
    """The M-RoPE images prompts have carried, by the stand-in id at their first position:
    what the slot table's sequences hold beyond their positions (:meth:`resident`)."""

    def __init__(self, limit: int = MAX_IMAGES) -> None:
        self.limit = limit
        self._images: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (n_pos, n_tokens)

    def note(self, media: MediaPrompt) -> None:
        """Remember ``media``'s M-RoPE images."""
        for first, chunk in media.images:
            if _grid(chunk):
                stand_in = media.tokens[first]
                self._images[stand_in] = (chunk.n_pos, chunk.n_tokens)
                self._images.move_to_end(stand_in)
        while len(self._images) > self.limit:
            self._images.popitem(last=False)

    def in_tokens(self, tokens: Sequence[int] | np.ndarray, seen: set[tuple[int, int]] | None = None) -> int:
        """The cells a sequence holding ``tokens`` holds beyond their positions: each known
        image whose first position is among them adds its embeddings less the positions of
        it held (an image already in ``seen``, by position and stand-in, adds nothing)."""
        array = np.asarray(tokens, dtype=np.int64)
        extra = 0
        for pos in np.flatnonzero(array < 0).tolist():
            stand_in = int(array[pos])
            image = self._images.get(stand_in)
            if image is None or (seen is not None and (pos, stand_in) in seen):
                continue
            if seen is not None:
                seen.add((pos, stand_in))
            n_pos, n_tokens = image
            extra += n_tokens - min(n_pos, len(array) - pos)
        return extra

    def resident(self, table: Any) -> int:
        """The cells ``table``'s sequences hold beyond the positions it counts. The same
        image at the same position in several sequences counts once: a copied prefix
        shares its cells (a lower bound where two were computed apart)."""
        if not self._images:
            return 0
        seen: set[tuple[int, int]] = set()
        return sum(self.in_tokens(table.seq_tokens(seq), seen) for seq in range(table.n_seq))

    def beyond_positions(
        self, table: Any, held: Iterable[tuple[MediaPrompt, int]], media: MediaPrompt | None, kept: int
    ) -> int:
        """The cells admission adds to the positions it counts: those the sequences hold
        (:meth:`resident`), those the ``held`` prompts (each with the position its slot
        table entry starts from) take beyond their pending positions, and ``media``'s
        beyond its positions from ``kept`` (None: a prompt without images)."""
        extra = self.resident(table) + sum(surcharge(m, start) for m, start in held)
        return extra + (surcharge(media, kept) if media is not None else 0)
