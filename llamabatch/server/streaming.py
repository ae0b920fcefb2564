"""The server's response plumbing: JSON and Server-Sent Events, and tying a request's work to
its client (a disconnect cancels the work: ``until_disconnect``, ``EventStream``).

Split from ``app.py`` (which imports these names back); no endpoint logic here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import operator
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from llamabatch import LLM, EngineClosed, PromptTooLong, QueueFull, SamplingParams, SLOUnmet
from llamabatch.server.protocol import (
    LOGPROB_FLOOR,
    APIError,
    TokenText,
    bad_request,
    completion_logprobs,
    param_of_error,
    request_field,
)

logger = logging.getLogger("llamabatch.server")

__all__ = ["ClientGone", "EventStream", "error_response", "until_disconnect"]

#: seconds a client is asked to wait after a 503 for a full queue
RETRY_AFTER_S = 1


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


#: tokens of log-probabilities per ``json.dumps`` call: one call holds the GIL while it runs
LOGPROB_SLICE = 64


class RawJSON:
    """JSON already encoded, spliced as is by :func:`dumps_json` (a big part of an answer,
    encoded in slices so that no single ``json.dumps`` call holds the GIL for long)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def dumps_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON; ``RawJSON`` values inside are spliced in as they are."""
    raws: list[bytes] = []
    mark = ""

    def splice(value: Any) -> str:
        nonlocal mark
        if not isinstance(value, RawJSON):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        if not mark:
            mark = f"\x00raw-{uuid.uuid4().hex}\x00"
        raws.append(value.data)
        return mark

    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=splice).encode()
    if not raws:
        return text
    parts = text.split(json.dumps(mark).encode())
    out = [parts[0]]
    for raw, part in zip(raws, parts[1:], strict=True):
        out += (raw, part)
    return b"".join(out)


def chat_logprobs_json(
    token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[Any], top_n: int
) -> RawJSON:
    """``choices[].logprobs`` of a chat answer (``{"content": [...]}``): the JSON of
    :func:`~llamabatch.server.protocol.chat_logprobs`, written directly: each token's text
    and bytes are encoded once per answer, not once per entry, and no dicts are built (an
    ``n`` 16 answer with ``top_logprobs`` 20 holds ten thousand entries; pure Python, so the
    GIL is given up at every switch interval)."""
    encoded: dict[int, tuple[str, str]] = {}  # token -> the JSON around its log-probability

    def pieces(token: int) -> tuple[str, str]:
        text, raw = token_text(token)
        entry = encoded[token] = (
            '{"token":' + json.dumps(text, ensure_ascii=False) + ',"logprob":',
            ',"bytes":[' + ",".join(map(str, raw)) + "]",
        )
        return entry

    content: list[str] = []
    for token, dist in zip(token_ids, logprobs, strict=False):
        head, tail = encoded.get(token) or pieces(token)
        top = []
        for t, v in sorted(dist.items(), key=_LOGPROB, reverse=True)[:top_n]:
            before, after = encoded.get(t) or pieces(t)
            top.append(before + _logprob_json(v) + after + "}")
        chosen = _logprob_json(dist.get(token, -math.inf))
        content.append(head + chosen + tail + ',"top_logprobs":[' + ",".join(top) + "]}")
    return RawJSON(('{"content":[' + ",".join(content) + "]}").encode())


#: a (token, log-probability) item's log-probability
_LOGPROB = operator.itemgetter(1)


def _logprob_json(value: float) -> str:
    """A log-probability as JSON writes it (``-inf``: ``LOGPROB_FLOOR``)."""
    value = float(value)
    return repr(value) if math.isfinite(value) else _FLOOR_JSON


_FLOOR_JSON = repr(LOGPROB_FLOOR)


def completion_logprobs_json(
    token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[Any], offset: int
) -> RawJSON:
    """The legacy completions ``logprobs`` object, built and encoded in slices (as
    :func:`chat_logprobs_json`)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    parts: dict[str, list[bytes]] = {key: [] for key in keys}
    for i in range(0, min(len(token_ids), len(logprobs)), LOGPROB_SLICE):
        lp = completion_logprobs(
            token_text, token_ids[i : i + LOGPROB_SLICE], logprobs[i : i + LOGPROB_SLICE], offset
        )
        offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        for key in keys:
            parts[key].append(dumps_json(lp[key])[1:-1])
    fields = (dumps_json(key) + b":[" + b",".join(parts[key]) + b"]" for key in keys)
    return RawJSON(b"{" + b",".join(fields) + b"}")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps_json(obj), status_code=status, headers=headers, media_type="application/json")


def sse_chunk(
    kind: str, rid: str, created: int, model: str | None, choice: dict[str, Any], include_usage: bool
) -> bytes:
    """One streamed chunk of a completion (``kind``: its OpenAI object type) with one choice;
    ``usage`` is null on every chunk but the last when the client asked for it."""
    obj: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        obj["usage"] = None
    return sse_event(obj)


def sse_event(obj: Any) -> bytes:
    return b"data: " + dumps_json(obj) + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


async def _wait_disconnect(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]], work: Awaitable[Any]
) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        raise ClientGone
    return task.result()


class EventStream:
    """An ASGI response sending Server-Sent Events from ``events``; a client disconnect
    cancels the iteration (and with it the generation)."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )

        async def pump() -> None:
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception as exc:  # after the headers: the error becomes the last event
                if isinstance(exc, (QueueFull, EngineClosed)):
                    error = APIError(503, str(exc), type="server_error")
                elif isinstance(exc, (ValueError, TypeError)):
                    error = bad_request(str(exc), param=param_of_error(str(exc)))
                else:
                    logger.exception("llamabatch server: a stream failed")
                    error = APIError(500, f"internal error: {exc}", type="server_error")
                await send(
                    {
                        "type": "http.response.body",
                        "body": sse_event(error.body()) + DONE_EVENT,
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, pump())
        except ClientGone:
            pass
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]


async def generate_all(
    llm: LLM, prompts: Sequence[Any], params: SamplingParams, priority: int = 0, client: str | None = None
) -> AsyncIterator[tuple[int, Any]]:
    """``(prompt index, Delta)`` of every prompt's generation, as they come (``priority``:
    lower runs first; ``client``: whose turn, ``client_policy.client_key``)."""
    if len(prompts) == 1:
        stream = llm.astream(prompts[0], params, priority=priority, client=client)
        try:
            async for delta in stream:
                yield 0, delta
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, prompt: Any) -> None:
        stream = llm.astream(prompt, params, priority=priority, client=client)
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
            queue.put_nowait((i, done))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def primed(gen: AsyncIterator[Any], receive: Any) -> AsyncIterator[Any]:
    """``gen`` with its first item already awaited, so submit errors (a full queue, a bad
    parameter) become HTTP errors before the stream's headers are sent."""
    try:
        first = await until_disconnect(receive, anext(gen))
    except BaseException:
        await gen.aclose()  # type: ignore[attr-defined]
        raise

    async def chain() -> AsyncIterator[Any]:
        try:
            yield first
            async for item in gen:
                yield item
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    return chain()


def error_response(request: Request, exc: Exception) -> Response:
    """The answer to an endpoint that raised ``exc``: OpenAI's error JSON with its status.
    A 500 (with the traceback logged) only for what no request should be able to cause."""
    if isinstance(exc, APIError):
        return json_response(exc.body(), exc.status, exc.headers)
    if isinstance(exc, (ClientGone, ClientDisconnect)):
        return Response(status_code=499)  # nobody is listening
    if isinstance(exc, PromptTooLong):
        return json_response(bad_request(str(exc), param=None, code="context_length_exceeded").body(), 400)
    if isinstance(exc, SLOUnmet):  # predicted late: retry once the queue ahead has drained
        error = APIError(503, f"the server is busy: {exc}", type="server_error", code="slo_unmet")
        return json_response(error.body(), 503, {"Retry-After": str(max(1, math.ceil(exc.retry_after)))})
    if isinstance(exc, QueueFull):  # waiting helps: a 503 with Retry-After
        error = APIError(
            503, f"the server is busy: {exc}; retry later", type="server_error", code="queue_full"
        )
        return json_response(error.body(), 503, {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineClosed):
        return json_response(APIError(503, str(exc), type="server_error").body(), 503)
    if isinstance(exc, (ValueError, TypeError)):  # a grammar llama.cpp refused at submit, ...
        param = param_of_error(str(exc))
        body = getattr(request.state, "body", None)
        if body is not None:
            param = request_field(body, param)
        return json_response(bad_request(str(exc), param=param).body(), 400)
    if isinstance(exc, RecursionError):  # a request nested too deeply for some check: its fault
        logger.warning("llamabatch server: %s: a request nested too deeply", request.url.path)
        return json_response(bad_request("the request is nested too deeply").body(), 400)
    logger.error("llamabatch server: %s failed", request.url.path, exc_info=exc)
    return json_response(APIError(500, f"internal error: {exc}", type="server_error").body(), 500)
