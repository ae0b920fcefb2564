"""A request's life: ``Request`` (engine side) and ``RequestHandle`` (caller side).

The engine thread is the only writer of a request's progress. Callers read deltas from a
thread-safe queue and wait on the final output; ``finish`` runs exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from llamabatch.detok import IncrementalDetokenizer, StopMatcher
from llamabatch.errors import RequestCancelled
from llamabatch.outputs import CompletionOutput, Delta, FinishReason, Timings, Usage
from llamabatch.params import SamplingParams

if TYPE_CHECKING:
    from llamabatch._ffi.sampler import SamplerChain

_ids = itertools.count(1)
_END = object()


class Request:
    """One completion being served (one slot's worth of work)."""

    __slots__ = (
        "_done",
        "_listeners",
        "_loop_queues",
        "cancel_requested",
        "detok",
        "error",
        "fast_greedy",
        "finish_reason",
        "group",
        "index",
        "logprobs",
        "n_reused",
        "output",
        "output_tokens",
        "params",
        "pin",
        "prompt_tokens",
        "request_id",
        "sampler",
        "slot",
        "stop_matcher",
        "stop_reason",
        "stream",
        "streaming",
        "t_admitted",
        "t_first_token",
        "t_submitted",
        "text_parts",
    )

    def __init__(self, prompt_tokens: list[int], params: SamplingParams, index: int = 0) -> None:
        self.request_id = next(_ids)
        self.prompt_tokens = prompt_tokens
        self.params = params
        self.index = index
        self.output_tokens: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.detok = IncrementalDetokenizer()
        self.stop_matcher = StopMatcher(params.stop)
        self.sampler: SamplerChain | None = None
        self.slot = -1
        self.n_reused = 0
        self.group: Request | None = None  # the leader of a parallel-sampling group (n > 1)
        self.pin: Any = None  # a PinnedPrefix this request computes (LLM.register_prefix)
        self.cancel_requested = False
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.output: CompletionOutput | None = None
        self.stream: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: deliver per-token deltas (off for callers that only wait for the result)
        self.streaming = True
        #: plain greedy with no state in the sampler chain: the engine takes the argmax
        self.fast_greedy = (
            params.greedy
            and not params.logit_bias
            and params.grammar is None
            and params.repeat_penalty == 1.0
            and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0
        )
        self._done = threading.Event()
        self._listeners: list[Any] = []
        self._loop_queues: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = []
        self.t_submitted = time.perf_counter()
        self.t_admitted: float | None = None
        self.t_first_token: float | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def push(self, text: str, tokens: list[int]) -> None:
        """Deliver a delta (engine thread)."""
        if text:
            self.text_parts.append(text)
        if self.streaming:
            self._deliver(Delta(self.request_id, text, tokens, None, None, self.index))

    def finish(
        self, reason: FinishReason, error: str | None = None, stop_reason: str | int | None = None
    ) -> bool:
        """End the request exactly once; returns False when it had already ended.

        Text still held back (an incomplete character, a possible stop-string start) is
        released unless a stop string ended the request."""
        if self.output is not None:
            return False
        now = time.perf_counter()
        rest = ""
        if not isinstance(stop_reason, str):
            rest, matched = self.stop_matcher.feed(self.detok.flush())
            if matched is None:
                rest += self.stop_matcher.flush()
            else:
                reason, stop_reason = "stop", matched
            if rest:
                self.text_parts.append(rest)
        self.finish_reason = reason
        self.error = error
        self.stop_reason = stop_reason
        queue_wait = (self.t_admitted if self.t_admitted is not None else now) - self.t_submitted
        ttft = None if self.t_first_token is None else self.t_first_token - self.t_submitted
        self.output = CompletionOutput(
            request_id=self.request_id,
            text="".join(self.text_parts),
            token_ids=list(self.output_tokens),
            finish_reason=reason,
            usage=Usage(len(self.prompt_tokens), len(self.output_tokens), self.n_reused),
            timings=Timings(queue_wait, ttft, now - self.t_submitted),
            prompt_token_ids=self.prompt_tokens,
            logprobs=self.logprobs,
            index=self.index,
            error=error,
            stop_reason=stop_reason,
        )
        self._deliver(Delta(self.request_id, rest, [], reason, self.output, index=self.index))
        self._deliver(_END)
        self._done.set()
        return True

    def _deliver(self, item: Any) -> None:
        self.stream.put(item)
        for loop, aqueue in self._loop_queues:
            try:
                loop.call_soon_threadsafe(aqueue.put_nowait, item)
            except RuntimeError:  # the loop is closed; the caller is gone
                pass

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


class RequestHandle:
    """The caller's view of a submitted request: wait, cancel, or iterate over deltas.

    Usable from any thread. Iterating yields :class:`Delta` objects until the request
    ends; the last one carries ``finish_reason`` and the complete ``output``.
    """

    def __init__(self, requests: list[Request], engine: Any) -> None:
        self._requests = requests
        self._engine = engine

    @property
    def request_id(self) -> int:
        return self._requests[0].request_id

    @property
    def done(self) -> bool:
        return all(r.done for r in self._requests)

    def cancel(self) -> None:
        """Ask the engine to stop this request; it then ends as ``"cancelled"``."""
        for request in self._requests:
            self._engine.cancel(request)

    def result(self, timeout: float | None = None) -> CompletionOutput:
        """Wait for the (first) completion; ``TimeoutError`` after ``timeout`` seconds."""
        return self.results(timeout)[0]

    def results(self, timeout: float | None = None) -> list[CompletionOutput]:
        """All ``n`` completions (parallel sampling), in index order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for request in self._requests:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not request.wait(left):
                raise TimeoutError(f"request {request.request_id} did not finish within {timeout} s")
        return [r.output for r in self._requests]  # type: ignore[misc]

    def __iter__(self) -> Iterator[Delta]:
        if len(self._requests) != 1:
            raise TypeError("iterate over a single completion; use results() when n > 1")
        request = self._requests[0]
        while True:
            item = request.stream.get()
            if item is _END:
                return
            yield item

    def raise_for_status(self) -> CompletionOutput:
        """The result, raising ``RequestCancelled`` for a cancelled request."""
        out = self.result()
        if out.finish_reason == "cancelled":
            raise RequestCancelled(f"request {out.request_id} was cancelled")
        return out
