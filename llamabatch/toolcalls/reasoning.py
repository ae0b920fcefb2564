"""Reasoning content: the ``<think>...</think>`` block of thinking models (DeepSeek R1, Qwen 3,
QwQ) split from the answer.

A model either opens the block itself (``<think>`` at the start of its answer) or the chat
template opens it in the prompt (DeepSeek R1's ``<｜Assistant｜><think>\\n``): then the answer
starts inside the block. Text up to ``</think>`` is reasoning, the rest content. An answer
that ends inside the block is all reasoning. Markers split across deltas are held back until
resolved, so none leaks into either stream.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: ``--reasoning-format``: "auto" splits ``<think>`` blocks out of the content, "none" leaves them
REASONING_FORMATS = ("auto", "none")


def check_reasoning_format(value: object, *, what: str = "reasoning_format") -> str:
    """``value`` if it is one of ``REASONING_FORMATS``, else ``ValueError``."""
    if value not in REASONING_FORMATS:
        raise ValueError(f"{what} must be one of {', '.join(REASONING_FORMATS)}; got {value!r}")
    return value  # type: ignore[return-value]


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could begin one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = "reasoning_start" if in_reasoning else "start"
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content that ``text`` (the next piece of the answer) resolves;
        with ``final``, everything held back is resolved too."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf, state = self._buf, self._state
            if state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf, self._state = stripped[len(THINK_OPEN) :], "reasoning_start"
                    continue
                if not final and THINK_OPEN.startswith(stripped):
                    return "".join(reasoning), "".join(content)  # maybe the opening marker
                self._state = "content"
                continue
            if state in ("reasoning_start", "content_start"):
                stripped = buf.lstrip()
                if not stripped and not final:
                    self._buf = ""
                    return "".join(reasoning), "".join(content)
                self._buf = stripped
                self._state = "reasoning" if state == "reasoning_start" else "content"
                continue
            if state == "reasoning":
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(buf[:end])
                    self._buf, self._state = buf[end + len(THINK_CLOSE) :], "content_start"
                    continue
                keep = 0 if final else held_suffix(buf, (THINK_CLOSE,))
                reasoning.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return "".join(reasoning), "".join(content)
            content.append(buf)  # state == "content"
            self._buf = ""
            return "".join(reasoning), "".join(content)
