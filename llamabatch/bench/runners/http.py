"""A running OpenAI-compatible server as a runner: concurrent streaming clients over HTTP.

Every request is ``POST /v1/completions`` with the prompt as token ids (so every server
computes the same prompt, whatever its tokenizer does with text), ``max_tokens`` = the
request's ``ntg``, greedy, ``ignore_eos: true`` (the llama.cpp and vLLM extension that keeps
generating to ``max_tokens``), ``stream: true`` and ``stream_options.include_usage``.
Served by ``llamabatch serve``, llama.cpp's ``llama-server`` and vLLM alike.

Times are the client's: the time to first token is the first streamed chunk (from the
request's arrival), the inter-token latency the gaps between streamed chunks. The generated
token count is the usage the server reports in its last chunk, or the number of chunks when
it reports none; a request that does not get exactly ``ntg`` tokens fails the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from llamabatch.bench.report import RunResult, result_from_times
from llamabatch.bench.runners.base import HTTP
from llamabatch.bench.workloads import BenchRequest

__all__ = ["HTTPRunner"]


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ImportError(
            "bench-serve needs httpx, part of the server extra: pip install 'llamabatch[server]'"
        ) from None
    return httpx


class HTTPRunner:
    """Clients of the OpenAI-compatible server at ``url`` (e.g. ``http://127.0.0.1:8000``).

    Args:
        url: the server's base URL (``/v1/...`` is appended).
        model: the ``model`` field of the requests; default: the first model of ``GET /v1/models``.
        api_key: sent as ``Authorization: Bearer KEY``.
        timeout: seconds one request may take.
        max_concurrency: the most requests in flight on the mixed workload (default: no
            limit, every request is sent at its arrival time). On the batched workload the
            number of concurrent clients is the point's ``npl``: each client sends its next
            request when its last one ends.
        name: the ``runner`` column.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        max_concurrency: int | None = None,
        name: str = HTTP,
    ) -> None:
        self._httpx = _import_httpx()
        self.name = name
        self.url = url.rstrip("/")
        self.max_concurrency = max_concurrency
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = asyncio.new_event_loop()
        self._client = self._httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=timeout,
            limits=self._httpx.Limits(max_connections=None, max_keepalive_connections=1024),
        )
        try:
            self.model = model or self._call(self._first_model())
        except BaseException:
            self.close()
            raise

    def _call(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the runner's event loop (kept across runs, with its connections)."""
        try:
            return self._loop.run_until_complete(coroutine)
        except self._httpx.TransportError as exc:
            raise ConnectionError(
                f"cannot reach the server at {self.url}: {exc or type(exc).__name__}"
            ) from exc

    async def _first_model(self) -> str:
        response = await self._client.get("/v1/models")
        if response.status_code != 200:
            raise RuntimeError(
                f"GET {self.url}/v1/models answered {response.status_code}: {response.text[:300]}"
            )
        models = response.json().get("data") or []
        if not models:
            raise RuntimeError(f"{self.url}/v1/models lists no model")
        return str(models[0]["id"])

    async def _complete(self, request: BenchRequest) -> tuple[list[float], int]:
        """One streamed completion: the time of every chunk that carries a token, and the
        generated token count."""
        body = {
            "model": self.model,
            "prompt": list(request.prompt),
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        stamps: list[float] = []
        usage: int | None = None
        response = await self._send_stream(body)
        try:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")[:300]
                raise RuntimeError(f"POST {self.url}/v1/completions answered {response.status_code}: {text}")
            lines = response.aiter_lines()
            try:
                async for line in lines:
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        continue  # read the stream to its end: its generators then finish here
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise RuntimeError(f"{self.url} streamed an error: {chunk['error']}")
                    for choice in chunk.get("choices") or ():
                        # The closing chunk may carry only the finish reason: not a token.
                        if choice.get("text") or choice.get("finish_reason") is None:
                            stamps.append(now)
                    if chunk.get("usage"):
                        usage = int(chunk["usage"]["completion_tokens"])
            finally:
                await lines.aclose()  # now, on this loop, not when collected
        finally:
            await response.aclose()
        return stamps, len(stamps) if usage is None else usage

    async def _send_stream(self, body: dict[str, Any]) -> Any:
        """The streamed POST's response (the caller closes it). A pooled keep-alive connection
        that the server closed just as it was reused fails before any response byte: the
        request never reached the server, so it is sent once more on a fresh connection."""

        def send() -> Any:
            request = self._client.build_request("POST", "/v1/completions", json=body)
            return self._client.send(request, stream=True)

        try:
            return await send()
        except self._httpx.RemoteProtocolError:
            return await send()

    async def _serve(
        self, requests: Sequence[BenchRequest], concurrency: int | None
    ) -> tuple[list[float], list[float], list[int], list[float], float, list[list[float]]]:
        n = len(requests)
        first, end, counts = [0.0] * n, [0.0] * n, [0] * n
        all_stamps: list[list[float]] = [[] for _ in range(n)]
        itl: list[float] = []
        slots = asyncio.Semaphore(concurrency) if concurrency else None
        start = time.perf_counter()

        async def one(i: int) -> None:
            request = requests[i]
            delay = start + request.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                stamps, count = await self._complete(request)
            else:
                async with slots:
                    stamps, count = await self._complete(request)
            end[i] = time.perf_counter()
            if count != request.max_tokens or not stamps:
                raise RuntimeError(
                    f"the server generated {count} tokens for request {i}, expected {request.max_tokens} "
                    "(does it honour ignore_eos?)"
                )
            first[i] = stamps[0]
            counts[i] = count
            all_stamps[i] = stamps
            itl.extend(np.diff(stamps).tolist())

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return first, end, counts, itl, start, all_stamps

    def warmup(self, tokens: Sequence[int]) -> None:
        """Two tokens from a short prompt (opens a connection too)."""
        self._call(self._complete(BenchRequest(tuple(tokens[:8]), 2)))

    def run(
        self, requests: Sequence[BenchRequest], workload: str, npl: int, rate: float | None = None
    ) -> RunResult:
        """Serve ``requests`` over HTTP: ``npl`` clients when they all arrive at once,
        otherwise each sent at its arrival time (at most ``max_concurrency`` in flight)."""
        concurrency = npl if all(r.arrival == 0 for r in requests) else self.max_concurrency
        first, end, counts, itl, start, stamps = self._call(self._serve(requests, concurrency))
        return result_from_times(
            self.name, workload, requests, first, end, counts, itl, start, npl, rate, stamps=stamps
        )

    def close(self) -> None:
        """Close the connections and the event loop."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()
