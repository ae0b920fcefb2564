"""What a generation returns: ``RequestOutput`` per prompt, holding one ``CompletionOutput``
per completion (vLLM's shape), the streamed ``Delta`` and ``LLMEngine.step()``'s ``StepOutput``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llamabatch.status import FinishReason, RequestStatus


@dataclass(frozen=True)
class ToolCall:
    """One function call read from a chat answer (``LLM.chat(..., tools=...)``): its ``id``,
    the function's ``name`` and its ``arguments`` as a JSON string, as OpenAI's."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, object]:
        """OpenAI's shape, for an assistant message's ``tool_calls``."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class Usage:
    """Token counts of one completion (``reused_tokens`` of the prompt came from the prefix
    cache instead of being computed)."""

    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Seconds: waiting in the queue, from submit to the first token, and in all.
    ``preemptions``: how often the request was preempted and recomputed (under KV pressure,
    or for a request of a higher priority). ``itl_p50`` / ``itl_p99`` / ``itl_max``: the
    request's own inter-token latencies (the gaps between its tokens; None under 2 tokens).
    ``spec_draft_tokens`` / ``spec_accepted_tokens``: speculative decoding's draft tokens
    verified for this request and those accepted (0 without ``speculative_config``).
    ``slo_ttft_met`` / ``slo_itl_met``: whether its first token came within its
    ``slo_ttft_ms`` and no gap exceeded its ``slo_itl_ms``; ``slo_met``: both (None: no SLO;
    a failed or cancelled request met none)."""

    queue_wait: float
    time_to_first_token: float | None
    total: float
    preemptions: int = 0
    itl_p50: float | None = None
    itl_p99: float | None = None
    itl_max: float | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    slo_ttft_met: bool | None = None
    slo_itl_met: bool | None = None
    slo_met: bool | None = None


def slo_met(ttft: float | None, itl_max: float | None, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """Whether a request met an SLO (seconds; a bound of None always holds): its first token
    within ``slo_ttft`` (a request without one missed it) and no gap between its tokens over
    ``slo_itl`` (``itl_max``, its largest gap; None or NaN: under 2 tokens, no gap). The one
    definition of ``Timings.slo_met`` and of the benchmarks' goodput."""
    if slo_ttft is not None and (ttft is None or not ttft <= slo_ttft):
        return False
    return slo_itl is None or itl_max is None or math.isnan(itl_max) or itl_max <= slo_itl


@dataclass(frozen=True)
class CompletionOutput:
    """The finished result of one completion.

    ``finish_reason`` is ``"stop"`` (end-of-generation token or a stop string),
    ``"length"`` (``max_tokens`` or the sequence's context is full), ``"cancelled"`` or
    ``"error"`` (then ``error`` says why, and ``error_type`` is the class of the exception
    that ended it: a ``GrammarDeadEnd`` is the request's own doing), or, for a chat answer
    that ends in tool calls, ``"tool_calls"``. ``tool_calls`` are the calls read from a chat
    answer (its ``text`` is then the content before them) and ``reasoning`` its ``<think>``
    block, when the model thinks.
    ``logprobs``, when asked for, holds one dict
    per generated token mapping token id to log-probability (the sampled token and the N
    most likely ones); ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``, on the first
    completion of a prompt) one per prompt token, ``None`` for the first.
    """

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    error: str | None = None
    stop_reason: str | int | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    error_type: type[Exception] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """Everything one prompt produced: its ``n`` completions (``outputs[i].index == i``).

    ``prompt`` is the prompt text (``None`` for a token-id prompt); ``metrics`` are the
    timings of the first completion; ``finished`` is True once every completion ended.
    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``): one dict per prompt token
    (token id to log-probability: the prompt's token and the N most likely), ``None`` for the
    first, as vLLM's.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: Timings | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)  # not frozen: one is made per streamed token, and frozen init is slow
class Delta:
    """One streamed piece of a completion: new text and tokens; the last one carries
    ``finish_reason`` and the full ``output``. ``index`` tells the completions of ``n > 1``
    apart."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    output: CompletionOutput | None = None
    index: int = 0
    #: with ``SamplingParams(logprobs=N)``: one dict per token of ``token_ids``
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class StepOutput:
    """What one completion produced in one ``LLMEngine.step()``: its new tokens and text;
    once ``finished``, its ``finish_reason`` and full ``output``."""

    request_id: int
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    output: CompletionOutput | None = None
    index: int = 0
    #: with ``SamplingParams(logprobs=N)``: one dict per token of ``new_token_ids``
    logprobs: list[dict[int, float]] | None = None
    #: a chat request's (``add_request(messages, tools=...)``): new reasoning text, and the tool
    #: calls completed in this step (``text`` is then the new content only)
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: the request's status after the step (``RUNNING``, ``FINISHED_LENGTH``, ...; for a chat
    #: answer ending in tool calls, ``FINISHED_TOOL_CALLS``)
    status: RequestStatus = RequestStatus.RUNNING
