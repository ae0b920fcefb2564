"""A request's life: ``RequestStatus`` (its named states and their allowed edges),
``Request`` (one completion, engine side), its ``OutputState`` (text pipeline, delivery),
the ``Channel`` its deltas travel through, and ``RequestHandle`` (the caller's side of one
prompt's ``n`` completions).

The engine's thread is the only writer of a request's progress (``EngineCore``). A driver
(``LLM``'s thread, or ``LLMEngine.step()``) hands what each step produced to the callers;
``finish`` runs exactly once.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import queue
import threading
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from llamabatch.generate.detok import IncrementalDetokenizer, StopMatcher
from llamabatch.generate.image_cells import prompt_cells
from llamabatch.outputs import CompletionOutput, Delta, FinishReason, RequestOutput, Timings, Usage, slo_met
from llamabatch.params import SamplingParams
from llamabatch.status import STATUS_EDGES, InvalidTransition, RequestStatus

__all__ = [
    "END_OF_STREAM",
    "STATUS_EDGES",
    "Channel",
    "CoreOutput",
    "InvalidTransition",
    "OutputState",
    "Request",
    "RequestHandle",
    "RequestKind",
    "RequestStatus",
    "cells_to_compute",
    "request_output",
]

if TYPE_CHECKING:
    from llamabatch._ffi.sampler import SamplerChain

_ids = itertools.count(1)
_arrivals = itertools.count()
#: what a channel carries after a completion's last delta
END_OF_STREAM = object()


def next_request_id() -> int:
    return next(_ids)


def itl_figures(request: Request) -> tuple[float | None, float | None, float | None]:
    """``(p50, p99, max)`` of a request's inter-token latencies (seconds), None under 2 tokens."""
    times = request.token_times
    if len(times) < 2:
        return None, None, None
    gaps = np.diff(np.asarray(times))
    p50, p99 = np.percentile(gaps, (50, 99)).tolist()
    return float(p50), float(p99), float(gaps.max())


def slo_attainment(
    slo: tuple[float | None, float | None], ttft: float | None, itl_max: float | None, reason: str
) -> tuple[bool | None, bool | None, bool | None]:
    """``(ttft met, every gap met, both)`` of a request with SLOs ``slo`` (seconds; None:
    none, and then None); a request that failed or was cancelled met neither."""
    slo_ttft, slo_itl = slo
    ok = reason not in ("error", "cancelled")
    ttft_met = None if slo_ttft is None else ok and slo_met(ttft, None, slo_ttft, None)
    itl_met = None if slo_itl is None else ok and slo_met(None, itl_max, None, slo_itl)
    if ttft_met is None and itl_met is None:
        return None, None, None
    return ttft_met, itl_met, ttft_met is not False and itl_met is not False


class Channel:
    """Where the deltas of one prompt's completions go: a thread-safe queue for blocking
    readers, plus asyncio queues of the event loops that listen."""

    __slots__ = ("_loops", "queue")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loops: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = []

    def listen_from(self, loop: asyncio.AbstractEventLoop, aqueue: asyncio.Queue[Any]) -> None:
        """Mirror every item into ``aqueue`` on ``loop`` (before the request is submitted)."""
        self._loops.append((loop, aqueue))

    def put(self, item: Any) -> None:
        self.queue.put(item)
        for loop, aqueue in self._loops:
            try:
                loop.call_soon_threadsafe(aqueue.put_nowait, item)
            except RuntimeError:  # the loop is closed; the caller is gone
                pass


class RequestKind(enum.Enum):
    """What a request computes: a completion of its own, a parallel-sampling follower
    (``SamplingParams(n>1)``: it waits for its leader's prompt and copies its KV), or a
    prefix to pin (``LLM.register_prefix``: its prompt is computed, nothing is sampled)."""

    COMPLETION = "completion"
    FOLLOWER = "follower"
    PIN = "pin"


class OutputState:
    """The caller's side of one completion: the text pipeline (incremental detokenizer,
    stop strings, log-probabilities), the text so far, the delivery channel, the done
    event, and the finished ``CompletionOutput`` (vLLM's ``RequestState`` of its output
    processor). The engine feeds it; the driver publishes what it made."""

    __slots__ = (
        "_done",
        "channel",
        "detok",
        "logprobs",
        "output",
        "prompt_logprobs",
        "stop_matcher",
        "streaming",
        "text_parts",
    )

    def __init__(self, params: SamplingParams, *, streaming: bool, channel: Channel | None) -> None:
        self.detok = IncrementalDetokenizer()
        self.stop_matcher = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.text_parts: list[str] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        #: ``SamplingParams.prompt_logprobs``: one entry per prompt token, filled as the
        #: prompt is computed (set by ``Request`` for a prompt's first completion only)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        #: per-token deltas wanted (off for callers that only wait for the result)
        self.streaming = streaming
        self.channel = channel
        self.output: CompletionOutput | None = None
        self._done = threading.Event()

    def feed(self, piece: bytes) -> tuple[str, str | None]:
        """A token's bytes in: ``(text safe to emit, the stop string matched or None)``."""
        text = self.detok.feed(piece)
        if text:
            return self.stop_matcher.feed(text)
        return text, None

    def flush(self) -> tuple[str, str | None]:
        """At the end: the text held back, and a stop string it completes (or None)."""
        rest, matched = self.stop_matcher.feed(self.detok.flush())
        if matched is None:
            rest += self.stop_matcher.flush()
        return rest, matched

    def complete(self, request: Request, now: float) -> CompletionOutput:
        """Build (and keep) the ``CompletionOutput`` of ``request``, which has just ended."""
        queue_wait = (request.t_admitted if request.t_admitted is not None else now) - request.t_submitted
        ttft = None if request.t_first_token is None else request.t_first_token - request.t_submitted
        reason = request.finish_reason
        assert reason is not None
        itl = itl_figures(request)
        ttft_met, itl_met, slo_met = slo_attainment(request.slo, ttft, itl[2], reason)
        n_prompt, n_reused = prompt_usage(request)
        self.output = CompletionOutput(
            request_id=request.request_id,
            text="".join(self.text_parts),
            token_ids=list(request.output_tokens),
            finish_reason=reason,
            usage=Usage(n_prompt, len(request.output_tokens), n_reused),
            timings=Timings(
                queue_wait,
                ttft,
                now - request.t_submitted,
                request.n_preemptions,
                *itl,
                spec_draft_tokens=request.spec_counts[0],
                spec_accepted_tokens=request.spec_counts[1],
                slo_ttft_met=ttft_met,
                slo_itl_met=itl_met,
                slo_met=slo_met,
            ),
            prompt_token_ids=request.prompt_tokens,
            logprobs=self.logprobs,
            index=request.index,
            error=request.error,
            stop_reason=request.stop_reason,
            error_type=request.error_type,
            prompt_logprobs=self.prompt_logprobs,
        )
        return self.output

    def token_logprobs(self, token_ids: list[int]) -> list[dict[int, float]] | None:
        """The log-probabilities of the last ``len(token_ids)`` generated tokens, if asked for."""
        if self.logprobs is None or not token_ids:
            return None
        return self.logprobs[-len(token_ids) :]

    def publish(
        self, request_id: Any, index: int, text: str, token_ids: list[int], finish_reason: FinishReason | None
    ) -> None:
        """Hand a step's delta to the caller's channel (the last one ends the stream)."""
        channel = self.channel
        if finish_reason is None:
            if channel is not None:
                channel.put(
                    Delta(request_id, text, token_ids, None, None, index, self.token_logprobs(token_ids))
                )
            return
        if channel is not None:
            channel.put(Delta(request_id, text, token_ids, finish_reason, self.output, index))
            channel.put(END_OF_STREAM)
        self._done.set()

    @property
    def delivered(self) -> bool:
        """Whether the end was handed to the caller."""
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


class Request:
    """One completion being served, engine side: its prompt, parameters, sampler, progress
    (generated tokens, preemptions, timings) and :class:`RequestStatus`; what the caller
    sees is its :class:`OutputState` (``request.state``)."""

    __slots__ = (
        "admitted_order",
        "arrival",
        "client",
        "error",
        "error_type",
        "fast_greedy",
        "index",
        "kind",
        "leader",
        "media",
        "n_preemptions",
        "output_tokens",
        "params",
        "pin",
        "priority",
        "prompt",
        "prompt_tokens",
        "request_id",
        "reused_tokens",
        "sampler",
        "shared_tokens",
        "slo",
        "spec_counts",
        "state",
        "status",
        "stop_ids",
        "stop_reason",
        "t_admitted",
        "t_first_token",
        "t_submitted",
        "token_times",
        "wait_stamp",
    )

    def __init__(
        self,
        prompt_tokens: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        request_id: Any = None,
        prompt: str | None = None,
        streaming: bool = True,
        channel: Channel | None = None,
        leader: Request | None = None,
        pin: Any = None,
        priority: int = 0,
        client: Hashable | None = None,
    ) -> None:
        self.request_id = next_request_id() if request_id is None else request_id
        #: submission order (unique): the engine's key for the request, and who is preempted first
        self.arrival = next(_arrivals)
        #: lower runs first (``generate/priority.py``); 0 for all: first come, first served
        self.priority = priority
        #: when the request was last admitted (the core's admission count): the latest
        #: admitted of a lower priority is preempted first
        self.admitted_order = -1
        #: who the request is for (``None``: the caller): at one priority, clients take turns,
        #: and each has its share of the RAM tier (``RamCache``)
        self.client = client
        #: the request's turn (``ClientTurns``): the core's admission count when it was first
        #: queued, later for a client with requests queued before (-1 before queueing); its
        #: priority ages from there (``generate/priority.py``)
        self.wait_stamp = -1
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.params = params
        self.index = index
        self.status = RequestStatus.WAITING
        #: the first completion of a parallel-sampling group (``kind`` FOLLOWER)
        self.leader = leader
        #: the ``PinnedPrefix`` this request computes (``kind`` PIN; ``LLM.register_prefix``)
        self.pin = pin
        self.kind = (
            RequestKind.PIN
            if pin is not None
            else (RequestKind.FOLLOWER if leader is not None else RequestKind.COMPLETION)
        )
        self.output_tokens: list[int] = []
        #: a prompt with images (``generate/vision.py``'s ``MediaPrompt``): its image
        #: positions are computed from embeddings when it is admitted
        self.media: Any = None
        self.stop_ids = frozenset(params.stop_token_ids)
        self.sampler: SamplerChain | None = None
        self.reused_tokens = 0  # prompt tokens reused from the KV cache at the first admission
        self.shared_tokens = 0  # of those, the prefix another sequence held too (``Placement``)
        self.n_preemptions = 0
        #: speculative decoding: [draft tokens verified, draft tokens accepted]
        self.spec_counts = [0, 0]
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        #: the class of the exception that ended the request (``GrammarDeadEnd``: its own doing)
        self.error_type: type[Exception] | None = None
        self.state = OutputState(params, streaming=streaming, channel=channel)
        if params.prompt_logprobs is not None and self.kind is RequestKind.COMPLETION:
            self.state.prompt_logprobs = [None] * len(prompt_tokens)  # (followers copy its KV)
        #: plain greedy, no other sampler stage on (no state in the chain): the engine takes
        #: the argmax of the row itself
        self.fast_greedy = params.active_stages == ("greedy",)
        self.t_submitted = time.perf_counter()
        #: its SLOs in seconds, (time to first token, inter-token gap); None: none (the
        #: engine's SLO policy fills in the engine's own at queueing)
        self.slo: tuple[float | None, float | None] = (
            None if params.slo_ttft_ms is None else params.slo_ttft_ms / 1000.0,
            None if params.slo_itl_ms is None else params.slo_itl_ms / 1000.0,
        )
        self.t_admitted: float | None = None
        self.t_first_token: float | None = None
        #: when each generated token was sampled (its inter-token latencies)
        self.token_times: list[float] = []

    def transition(self, status: RequestStatus) -> None:
        """Move to ``status``; ``InvalidTransition`` unless :data:`STATUS_EDGES` allows it."""
        if status not in STATUS_EDGES[self.status]:
            raise InvalidTransition(
                f"request {self.request_id!r} (completion {self.index}): {self.status.name} -> {status.name}"
            )
        self.status = status

    @property
    def done(self) -> bool:
        """Whether the request has ended (its ``output`` is set)."""
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def output(self) -> CompletionOutput | None:
        """The finished result (None until the request ends)."""
        return self.state.output

    @property
    def channel(self) -> Channel | None:
        return self.state.channel

    @property
    def streaming(self) -> bool:
        return self.state.streaming

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.state.logprobs

    @property
    def follower_waits(self) -> bool:
        """A follower waits until its leader's prompt is computed (its first token), to copy
        its KV; not once the leader has ended."""
        leader = self.leader
        return leader is not None and not leader.done and leader.t_first_token is None

    def tokens_to_compute(self) -> list[int]:
        """The sequence to prefill at admission: the prompt, plus what was generated before a
        preemption (its last token is the next decode input)."""
        if self.output_tokens:
            return self.prompt_tokens + self.output_tokens
        return self.prompt_tokens

    def finish(
        self,
        reason: FinishReason,
        error: str | Exception | None = None,
        stop_reason: str | int | None = None,
    ) -> str | None:
        """End the request exactly once; returns the text released at the end, or None when
        it had already ended. ``error``: why it failed, a message or the exception (whose class
        becomes the output's ``error_type``).

        Text still held back (an incomplete character, a possible stop-string start) is
        released unless a stop string ended the request."""
        if self.status.finished:
            return None
        now = time.perf_counter()
        state = self.state
        rest = ""
        if not isinstance(stop_reason, str):
            rest, matched = state.flush()
            if matched is not None:
                reason, stop_reason = "stop", matched
            if rest:
                state.text_parts.append(rest)
        self.transition(RequestStatus.finished_with(reason))
        if self.sampler is not None:
            self.sampler.close()
        if isinstance(error, Exception):
            self.error_type = type(error)
            error = str(error)
        self.error = error
        self.stop_reason = stop_reason
        state.complete(self, now)
        return rest

    def publish(self, text: str, token_ids: list[int], finish_reason: FinishReason | None) -> None:
        """Hand a step's delta to the caller (see :meth:`OutputState.publish`)."""
        self.state.publish(self.request_id, self.index, text, token_ids, finish_reason)

    def token_logprobs(self, token_ids: list[int]) -> list[dict[int, float]] | None:
        return self.state.token_logprobs(token_ids)

    def wait(self, timeout: float | None) -> bool:
        return self.state.wait(timeout)


def cells_to_compute(request: Request, n: int) -> int:
    """The KV cells of the first ``n`` positions of ``request``'s sequence (its prompt, then
    what it generated before a preemption): an M-RoPE image takes its embeddings' cells, not
    its positions (``image_cells.py``); what admission and its tick cost model weigh."""
    media = request.media
    if media is None:
        return n
    n_media = len(media.tokens)
    return prompt_cells(media, min(n, n_media)) + max(0, n - n_media)


def prompt_usage(request: Request) -> tuple[int, int]:
    """The prompt's tokens and those reused, as usage reports them: an M-RoPE image counts
    its embeddings (its KV cells, as llama-server counts it), not its positions."""
    n, reused = len(request.prompt_tokens), request.reused_tokens
    media = request.media
    if media is None or len(media.tokens) != n:
        return n, reused
    return prompt_cells(media, n), prompt_cells(media, reused)


def request_output(requests: list[Request]) -> RequestOutput:
    """The ``RequestOutput`` of one prompt's completions (all finished)."""
    first = requests[0]
    outputs = [r.output for r in requests]
    assert all(o is not None for o in outputs)
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_tokens,
        outputs=outputs,  # type: ignore[arg-type]
        finished=True,
        metrics=outputs[0].timings,  # type: ignore[union-attr]
        prompt_logprobs=first.state.prompt_logprobs,
    )


class RequestHandle:
    """The caller's view of a submitted prompt: wait, cancel, or iterate over deltas.

    Usable from any thread. Iterating yields :class:`Delta` objects of all ``n``
    completions (``.index`` tells them apart) until every one has ended; each
    completion's last delta carries ``finish_reason`` and its complete ``output``.
    """

    def __init__(self, requests: list[Request], cancel: Any) -> None:
        self._requests = requests
        self._cancel = cancel

    @property
    def request_id(self) -> Any:
        return self._requests[0].request_id

    @property
    def done(self) -> bool:
        return all(r.state.delivered for r in self._requests)

    def cancel(self) -> None:
        """Ask the engine to stop this request; its completions then end as ``"cancelled"``."""
        for request in self._requests:
            if not request.done:
                self._cancel(request)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for every completion; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for request in self._requests:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not request.wait(left):
                raise TimeoutError(f"request {request.request_id} did not finish within {timeout} s")
        return request_output(self._requests)

    def __iter__(self) -> Iterator[Delta]:
        channel = self._requests[0].channel
        if channel is None:
            raise TypeError("this request was submitted without streaming")
        ends = 0
        while ends < len(self._requests):
            item = channel.queue.get()
            if item is END_OF_STREAM:
                ends += 1
                continue
            yield item


@dataclass(slots=True)
class CoreOutput:
    """What one step produced for one completion: its new text and tokens, or its end
    (``finish_reason`` set: then ``text`` is the text released at the end)."""

    request: Request
    text: str
    token_ids: list[int]
    #: the request's status when this was produced (``RUNNING``, or its end)
    status: RequestStatus
    finish_reason: FinishReason | None = None
