"""``llamabatch bench-serve --images N``: chat requests with images against a running server.

Every request is ``POST /v1/chat/completions`` with one OpenAI ``image_url`` part (a ``data:``
URL of a PNG generated here, ``--image-size`` pixels of seeded noise, so every server gets the
same files), greedy, ``ignore_eos`` and ``stream: true``: ``llamabatch serve --mmproj`` and
llama.cpp's ``llama-server --mmproj`` accept the same requests. Three phases, in this order,
each with images of its own (none seen by an earlier phase):

1. **repeat** (one request at a time): ``--ttft-images`` images, each asked three times: first,
   the same request again (a prompt cache may serve it), and a new question put *before* the
   image (no prefix matches past it: only an image encoder cache helps). Reported: the time to
   first token (TTFT) p50 of each, and the repeats' ratios over the first.
2. **bulk** (captioning): ``--images`` distinct images, each sent ``--image-repeats`` times (all
   first sends, then the repeats), ``--image-concurrency`` clients. Reported: images/s (requests
   answered per second of the phase) and their TTFT p50.
3. **gaps**: ``--text-streams`` text-only streams start; once each has streamed a few tokens (8),
   ``--gap-images`` image requests are sent at once. Reported: the text streams' largest gap
   between two tokens while the images are in flight (from the first sent to the last
   answered), the same before they arrive, and the streams' gap p50. A stream that ends before
   the last image is answered is reported in ``notes`` (raise ``--text-tokens``).

Times are the client's. A token is a streamed chunk whose ``delta.content`` is not empty; an
answer whose reported usage is not ``max_tokens`` tokens fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamabatch.bench import options
from llamabatch.bench.report import Column, Report

__all__ = [
    "IMAGE_COLUMNS",
    "ImageWorkload",
    "add_image_arguments",
    "data_url",
    "main",
    "make_png",
    "run_image_workload",
]

#: the columns of the image workload's one row
IMAGE_COLUMNS: tuple[Column, ...] = (
    Column("runner", "runner"),
    Column("images_per_s", "images/s", ".2f"),
    Column("bulk_ttft_p50_ms", "bulk TTFT p50 ms", ".1f"),
    Column("ttft_first_ms", "TTFT first ms", ".1f"),
    Column("ttft_same_ms", "TTFT same ms", ".1f"),
    Column("ttft_new_question_ms", "TTFT new question ms", ".1f"),
    Column("same_over_first", "same/first", ".2f", "x"),
    Column("new_question_over_first", "new q/first", ".2f", "x"),
    Column("text_gap_max_ms", "text gap max ms (images)", ".1f"),
    Column("text_gap_max_before_ms", "text gap max ms (before)", ".1f"),
    Column("text_gap_p50_ms", "text gap p50 ms", ".1f"),
    Column("gap_image_ttft_p50_ms", "image TTFT p50 ms (gaps)", ".1f"),
)

#: the question of every image request (``first``/``same``/bulk/gaps)
QUESTION = "What is in the image?"
#: the text-only streams' prompt
TEXT_PROMPT = "Tell me a long story about a lighthouse keeper."


@dataclass(frozen=True)
class ImageWorkload:
    """The image workload's shape (see the module docstring for the phases)."""

    n_images: int = 8
    repeats: int = 2
    width: int = 256
    height: int = 256
    concurrency: int = 8
    max_tokens: int = 16
    ttft_images: int = 3
    text_streams: int = 4
    text_tokens: int = 128
    gap_images: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_images", "repeats", "width", "height", "concurrency", "max_tokens", "text_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("ttft_images", "text_streams", "gap_images"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def image(self, phase: int, index: int) -> str:
        """The data URL of image ``index`` of ``phase`` (0 repeat, 1 bulk, 2 gaps): distinct
        across phases and seeds."""
        return data_url(make_png(self.width, self.height, seed=(self.seed * 3 + phase) * 1_000_003 + index))


def make_png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG of ``width`` x ``height`` pixels of seeded noise (written without Pillow)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + row.tobytes() for row in pixels)  # filter type 0 on every row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 1))
        + chunk(b"IEND", b"")
    )


def data_url(png: bytes) -> str:
    """``data:image/png;base64,...``."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _image_message(url: str, before: str | None = None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if before:
        parts.append({"type": "text", "text": before})
    parts.append({"type": "image_url", "image_url": {"url": url}})
    parts.append({"type": "text", "text": QUESTION})
    return [{"role": "user", "content": parts}]


@dataclass
class _Stream:
    """One streamed answer: when it was sent, when each token came, when it ended."""

    sent: float
    stamps: list[float]
    end: float

    @property
    def ttft(self) -> float:
        return (self.stamps[0] if self.stamps else self.end) - self.sent


class _ChatClient:
    """Streaming chat requests over one httpx connection pool (one event loop)."""

    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float) -> None:
        try:
            import httpx
        except ImportError:
            raise ImportError(
                "bench-serve needs httpx, part of the server extra: pip install 'llamabatch[server]'"
            ) from None
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.model = model

    async def first_model(self) -> str:
        response = await self._client.get("/v1/models")
        if response.status_code != 200:
            raise RuntimeError(
                f"GET {self.url}/v1/models answered {response.status_code}: {response.text[:300]}"
            )
        models = response.json().get("data") or []
        if not models:
            raise RuntimeError(f"{self.url}/v1/models lists no model")
        return str(models[0]["id"])

    async def chat(
        self, messages: list[dict[str, Any]], max_tokens: int, stamps: list[float] | None = None
    ) -> _Stream:
        """Stream one greedy answer of ``max_tokens`` tokens (``ignore_eos``); its token times
        go into ``stamps`` as they come (a list the caller watches)."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        stamps = [] if stamps is None else stamps
        async with self._client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")[:300]
                raise RuntimeError(
                    f"POST {self.url}/v1/chat/completions answered {response.status_code}: {text}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):
                    raise RuntimeError(f"{self.url} streamed an error: {chunk['error']}")
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens", max_tokens) != max_tokens:
                    raise RuntimeError(
                        f"{self.url} generated {usage['completion_tokens']} tokens, expected {max_tokens} "
                        "(does it honour ignore_eos?)"
                    )
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
        return _Stream(sent, stamps, time.perf_counter())

    async def close(self) -> None:
        await self._client.aclose()


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _p50_ms(streams: Sequence[_Stream]) -> float:
    return _ms(statistics.median(s.ttft for s in streams)) if streams else float("nan")


async def _repeat_phase(client: _ChatClient, w: ImageWorkload) -> dict[str, Any]:
    first: list[_Stream] = []
    same: list[_Stream] = []
    new_question: list[_Stream] = []
    for i in range(w.ttft_images):
        url = w.image(0, i)
        first.append(await client.chat(_image_message(url), w.max_tokens))
        same.append(await client.chat(_image_message(url), w.max_tokens))
        before = f"Question {i + 1}, asked again about the same picture."
        new_question.append(await client.chat(_image_message(url, before), w.max_tokens))
    if not first:
        return {}
    row = {
        "ttft_first_ms": _p50_ms(first),
        "ttft_same_ms": _p50_ms(same),
        "ttft_new_question_ms": _p50_ms(new_question),
    }
    row["same_over_first"] = row["ttft_same_ms"] / row["ttft_first_ms"]
    row["new_question_over_first"] = row["ttft_new_question_ms"] / row["ttft_first_ms"]
    return row


async def _bulk_phase(client: _ChatClient, w: ImageWorkload) -> dict[str, Any]:
    urls = [w.image(1, i) for i in range(w.n_images)]
    queue = [urls[i] for _ in range(w.repeats) for i in range(w.n_images)]  # first sends, then repeats
    streams: list[_Stream] = []

    async def client_loop() -> None:
        while queue:
            url = queue.pop(0)
            streams.append(await client.chat(_image_message(url), w.max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(w.concurrency)))
    elapsed = time.perf_counter() - start
    return {
        "image_requests": len(streams),
        "bulk_s": elapsed,
        "images_per_s": len(streams) / elapsed,
        "bulk_ttft_p50_ms": _p50_ms(streams),
    }


def _gaps(stamps: Sequence[float]) -> list[float]:
    return np.diff(np.asarray(stamps)).tolist() if len(stamps) > 1 else []


async def _all_streaming(
    stamps: Sequence[list[float]], texts: Sequence[asyncio.Future[Any]], tokens: int
) -> None:
    """Wait until every text stream has streamed ``tokens`` tokens (or ended); a failed one raises."""
    while not all(len(s) >= tokens or t.done() for s, t in zip(stamps, texts, strict=True)):
        await asyncio.sleep(0.002)
    for task in texts:
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


async def _gap_phase(client: _ChatClient, w: ImageWorkload) -> tuple[dict[str, Any], list[str]]:
    if not w.text_streams or not w.gap_images:
        return {}, []
    live: list[list[float]] = [[] for _ in range(w.text_streams)]
    text_messages = [{"role": "user", "content": TEXT_PROMPT}]
    texts = [asyncio.ensure_future(client.chat(text_messages, w.text_tokens, s)) for s in live]
    try:
        # a few gaps first: the streams' pace before the images arrive
        await _all_streaming(live, texts, min(8, w.text_tokens // 4 + 1))
    except BaseException:
        for task in texts:
            task.cancel()
        await asyncio.gather(*texts, return_exceptions=True)
        raise
    images_sent = time.perf_counter()
    image_streams = await asyncio.gather(
        *(client.chat(_image_message(w.image(2, i)), w.max_tokens) for i in range(w.gap_images))
    )
    images_done = max(s.end for s in image_streams)
    text_streams = await asyncio.gather(*texts)
    during: list[float] = []
    before: list[float] = []
    every: list[float] = []
    notes = []
    for k, stream in enumerate(text_streams):
        stamps = stream.stamps
        every += _gaps(stamps)
        before += _gaps([t for t in stamps if t <= images_sent])
        # the gaps that overlap the images' window, the one spanning its start included
        lo = max((j for j, t in enumerate(stamps) if t <= images_sent), default=0)
        hi = next((j for j, t in enumerate(stamps) if t >= images_done), len(stamps) - 1)
        during += _gaps(stamps[lo : hi + 1])
        if not stamps or stamps[-1] < images_done:
            notes.append(f"text stream {k} ended before the last image was answered: raise --text-tokens")
    row = {
        "text_gap_max_ms": _ms(max(during, default=float("nan"))),
        "text_gap_max_before_ms": _ms(max(before, default=float("nan"))),
        "text_gap_p50_ms": _ms(statistics.median(every)) if every else float("nan"),
        "gap_image_ttft_p50_ms": _p50_ms(image_streams),
    }
    return row, notes


async def _run(client: _ChatClient, w: ImageWorkload, warmup: bool) -> tuple[dict[str, Any], list[str]]:
    if client.model is None:
        client.model = await client.first_model()
    if warmup:  # a text request: opens a connection and warms the text model, no image seen
        await client.chat([{"role": "user", "content": "Hi"}], 2)
    row: dict[str, Any] = {}
    row.update(await _repeat_phase(client, w))
    row.update(await _bulk_phase(client, w))
    gaps, notes = await _gap_phase(client, w)
    row.update(gaps)
    return row, notes


def run_image_workload(
    url: str,
    workload: ImageWorkload,
    *,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    warmup: bool = True,
) -> tuple[dict[str, Any], list[str]]:
    """Run the three phases against the server at ``url``: the result row (the
    :data:`IMAGE_COLUMNS` keys, plus ``image_requests`` and ``bulk_s``) and notes."""
    client = _ChatClient(url, model, api_key, timeout)
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_run(client, workload, warmup))
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT (e.g. 256x256), got {text!r}") from None
    if width <= 0 or height <= 0:
        raise argparse.ArgumentTypeError(f"width and height must be positive, got {text!r}")
    return width, height


def add_image_arguments(p: argparse.ArgumentParser) -> None:
    """The image workload's arguments (``bench-serve --images N``)."""
    g = p.add_argument_group("images (--images N: chat requests with images; see 'llamabatch.bench.images')")
    g.add_argument(
        "--images",
        type=options.positive_int,
        default=None,
        metavar="N",
        help="run the image workload instead: N distinct images in the bulk phase (-m not needed)",
    )
    g.add_argument("--image-size", type=_size, default=(256, 256), metavar="WxH", help="default 256x256")
    g.add_argument(
        "--image-repeats", type=options.positive_int, default=2, help="bulk: sends of each image (default 2)"
    )
    g.add_argument(
        "--image-concurrency",
        type=options.positive_int,
        default=8,
        help="bulk: concurrent clients (default 8)",
    )
    g.add_argument(
        "--image-max-tokens",
        type=options.positive_int,
        default=16,
        help="tokens per image answer (default 16)",
    )
    g.add_argument(
        "--ttft-images",
        type=options.non_negative_int,
        default=3,
        help="repeat phase: images asked first, again, and with a new question (default 3)",
    )
    g.add_argument(
        "--text-streams",
        type=options.non_negative_int,
        default=4,
        help="gaps phase: text streams (default 4)",
    )
    g.add_argument(
        "--text-tokens",
        type=options.positive_int,
        default=128,
        help="gaps phase: tokens per text stream (default 128)",
    )
    g.add_argument(
        "--gap-images",
        type=options.non_negative_int,
        default=4,
        help="gaps phase: image requests sent at once while the text streams decode (default 4)",
    )


def main(args: argparse.Namespace) -> int:
    """``llamabatch bench-serve --images N``: run the image workload, print its row."""
    width, height = args.image_size
    workload = ImageWorkload(
        n_images=args.images,
        repeats=args.image_repeats,
        width=width,
        height=height,
        concurrency=args.image_concurrency,
        max_tokens=args.image_max_tokens,
        ttft_images=args.ttft_images,
        text_streams=args.text_streams,
        text_tokens=args.text_tokens,
        gap_images=args.gap_images,
        seed=args.seed,
    )
    row, notes = run_image_workload(
        args.url,
        workload,
        model=args.served_model,
        api_key=args.api_key,
        timeout=args.timeout,
        warmup=not args.no_warmup,
    )
    settings = {
        "url": args.url.rstrip("/"),
        "workload": "images",
        "image_size": f"{width}x{height}",
        "images": workload.n_images,
        "image_repeats": workload.repeats,
        "image_concurrency": workload.concurrency,
        "image_max_tokens": workload.max_tokens,
        "text_streams": workload.text_streams,
        "gap_images": workload.gap_images,
    }
    row = {"runner": "http", **row}
    Report(settings, [row], IMAGE_COLUMNS, notes=notes).print(as_json=args.json)
    return 0
