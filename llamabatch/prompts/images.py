"""Images from clients, checked before anything large is allocated.

An image arrives as bytes (a ``data:`` URL's payload, a file, or, when ``allow_remote_images``
is on, an http(s) URL). :func:`image_dimensions` reads the width and height from the file's
header itself (PNG, JPEG, GIF, WebP, BMP): a header claiming more than ``max_image_pixels`` is
refused before any decoder sees it. Only then does Pillow decode it, to RGB. Every refusal is
an :class:`~llamabatch.errors.ImageError` naming the part at fault (``messages[0].content[1]``),
which the server answers with a 400.

:func:`image_key` is an image's content hash: the encoder cache's key, and the seed of the
positions' stand-in ids in the prefix cache (``generate/vision.py``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import os
import socket
import struct
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamabatch.errors import ImageError

__all__ = [
    "DEFAULT_MAX_IMAGES_PER_REQUEST",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageLimits",
    "check_image_options",
    "decode_image",
    "image_dimensions",
    "image_key",
    "image_parts",
    "limits_of",
    "load_image",
]

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGES_PER_REQUEST = 8
#: seconds a remote image may take to arrive
REMOTE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be: ``max_bytes`` each (encoded), ``max_pixels`` each
    (width x height, read from the header before decoding), ``max_images`` per request;
    ``allow_remote`` lets http(s) URLs through (public addresses only)."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    allow_remote: bool = False

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_images"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.allow_remote, bool):
            raise ValueError(f"allow_remote must be True or False, got {self.allow_remote!r}")

    def check_count(self, n: int, part: str = "images") -> None:
        """Refuse more than ``max_images`` images in one request."""
        if n > self.max_images:
            raise ImageError(part, f"{n} images, more than the {self.max_images} allowed per request")


# -- headers ------------------------------------------------------------------------------


def _png(data: bytes) -> tuple[int, int]:
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ValueError("a PNG without its IHDR header")
    return struct.unpack(">II", data[16:24])


def _gif(data: bytes) -> tuple[int, int]:
    if len(data) < 10:
        raise ValueError("a truncated GIF header")
    return struct.unpack("<HH", data[6:10])


def _bmp(data: bytes) -> tuple[int, int]:
    if len(data) < 26:
        raise ValueError("a truncated BMP header")
    width, height = struct.unpack("<ii", data[18:26])
    return abs(width), abs(height)


def _webp(data: bytes) -> tuple[int, int]:
    kind = data[12:16]
    if kind == b"VP8X" and len(data) >= 30:
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if kind == b"VP8 " and len(data) >= 30:
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    raise ValueError("a WebP header of an unknown or truncated kind")


# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic...): not DHT, JPG, DAC
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(data: bytes) -> tuple[int, int]:
    i = 2
    n = len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise ValueError("a JPEG whose segments do not follow each other")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            raise ValueError("a JPEG segment of length < 2")
        if marker in _SOF:
            if i + 9 > n:
                break
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return width, height
        i += 2 + length
    raise ValueError("a JPEG with no frame header")


_FORMATS = (
    (b"\x89PNG\r\n\x1a\n", "PNG", _png),
    (b"\xff\xd8", "JPEG", _jpeg),
    (b"GIF87a", "GIF", _gif),
    (b"GIF89a", "GIF", _gif),
    (b"BM", "BMP", _bmp),
)


def image_dimensions(data: bytes) -> tuple[str, int, int]:
    """``(format, width, height)`` read from the header of ``data``, decoding nothing.
    Raises ValueError for bytes that are not a PNG, JPEG, GIF, WebP or BMP file, or whose
    header is truncated."""
    for magic, name, read in _FORMATS:
        if data.startswith(magic):
            width, height = read(data)
            return name, int(width), int(height)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        width, height = _webp(data)
        return "WEBP", width, height
    raise ValueError("not a PNG, JPEG, GIF, WebP or BMP image")


# -- decoding -----------------------------------------------------------------------------


def decode_image(data: bytes, limits: ImageLimits, part: str = "image") -> np.ndarray:
    """The RGB pixels ``(height, width, 3)`` uint8 of the encoded image ``data``.

    Raises ImageError (naming ``part``) for more than ``limits.max_bytes`` bytes, an unknown
    format, a header claiming more than ``limits.max_pixels`` pixels (before decoding), or
    bytes the decoder rejects."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(part, f"expected image bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > limits.max_bytes:
        raise ImageError(part, f"{len(data)} bytes, more than the {limits.max_bytes} allowed per image")
    try:
        kind, width, height = image_dimensions(data)
    except ValueError as exc:
        raise ImageError(part, str(exc)) from None
    if width < 1 or height < 1:
        raise ImageError(part, f"a {kind} header with a {width} x {height} size")
    if width * height > limits.max_pixels:
        raise ImageError(
            part, f"{width} x {height} pixels, more than the {limits.max_pixels} allowed per image"
        )
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency of the vision extra
        raise ImageError(part, "decoding images needs Pillow (pip install 'llamabatch[vision]')") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.size != (width, height) or image.format != kind:
                raise ImageError(part, "the decoder read another size or format than the header says")
            image.load()
            rgb = image.convert("RGB")
    except ImageError:
        raise
    except Exception as exc:  # Pillow raises many types for corrupt data
        raise ImageError(part, f"cannot decode the {kind} image: {exc}") from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    if pixels.shape != (height, width, 3):
        raise ImageError(part, "the decoded image has an unexpected shape")
    return pixels


def image_key(pixels: np.ndarray) -> str:
    """The content hash of decoded pixels (shape and bytes): equal images, equal keys."""
    digest = hashlib.sha256(np.asarray(pixels.shape, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()


# -- URLs ---------------------------------------------------------------------------------


def _data_url(url: str, limits: ImageLimits, part: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError(part, "a data URL with no ',' before its payload")
    media = header[5:].split(";")
    if media[0] and not media[0].startswith("image/"):
        raise ImageError(part, f"a data URL of type {media[0]!r}, not an image")
    if len(payload) > limits.max_bytes * 4 // 3 + 8:
        raise ImageError(part, f"more than the {limits.max_bytes} bytes allowed per image")
    if "base64" not in media[1:]:
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(part, "a data URL whose base64 payload does not decode") from None


def _public_address(host: str, part: str) -> str:
    """The first address of ``host``, refused unless it is a public unicast address (no
    loopback, private, link-local, multicast or reserved range: no requests into the
    server's own network)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        raise ImageError(part, f"cannot resolve the image URL's host {host!r}") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global or address.is_multicast:
            raise ImageError(part, f"the image URL's host {host!r} is not a public address")
    return str(infos[0][4][0])


def _fetch(url: str, limits: ImageLimits, part: str) -> bytes:
    import http.client
    import ssl

    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    address = _public_address(host, part)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    conn: Any
    if parsed.scheme == "https":
        context = ssl.create_default_context()
        conn = http.client.HTTPSConnection(address, port, timeout=REMOTE_TIMEOUT_S, context=context)
        # the certificate is checked against the URL's host name, the connection goes to the
        # address that was checked (no second lookup that could answer differently)
        conn._tunnel_host = None
        conn.sock = context.wrap_socket(
            socket.create_connection((address, port), timeout=REMOTE_TIMEOUT_S), server_hostname=host
        )
    else:
        conn = http.client.HTTPConnection(address, port, timeout=REMOTE_TIMEOUT_S)
    try:
        path = parsed.path or "/"
        if parsed.query:
            path += "?" + parsed.query
        conn.request("GET", path, headers={"Host": parsed.netloc.rpartition("@")[2], "Accept": "image/*"})
        response = conn.getresponse()
        if response.status != 200:  # redirects are not followed: they could point inside
            raise ImageError(part, f"the image URL answered HTTP {response.status}")
        data = response.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageError(part, f"cannot fetch the image URL: {exc}") from None
    finally:
        conn.close()
    if len(data) > limits.max_bytes:
        raise ImageError(part, f"more than the {limits.max_bytes} bytes allowed per image")
    return data


def load_image(source: Any, limits: ImageLimits, part: str = "image") -> np.ndarray:
    """Decoded RGB pixels of ``source``: encoded bytes, a ``data:`` URL, an http(s) URL (only
    with ``limits.allow_remote``), or an array already decoded (``(h, w, 3)`` uint8, checked
    against ``max_pixels``)."""
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[2] != 3 or 0 in source.shape:
            raise ImageError(part, "an image array must be uint8 RGB, (height, width, 3)")
        if source.shape[0] * source.shape[1] > limits.max_pixels:
            raise ImageError(part, f"more than the {limits.max_pixels} pixels allowed per image")
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits, part)
    if not _is_pil_image(source) and not isinstance(source, str):
        raise ImageError(part, f"an image must be bytes, a URL or an RGB array, not {type(source).__name__}")
    if _is_pil_image(source):
        width, height = source.size
        if width * height > limits.max_pixels:
            raise ImageError(part, f"more than the {limits.max_pixels} pixels allowed per image")
        return np.asarray(source.convert("RGB"), dtype=np.uint8)
    url = source.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url(url, limits, part), limits, part)
    if scheme in ("http", "https"):
        if not limits.allow_remote:
            raise ImageError(part, "remote image URLs are off (allow_remote_images / --allow-remote-images)")
        return decode_image(_fetch(url, limits, part), limits, part)
    raise ImageError(part, "an image URL must be a data: URL (or http(s) when remote images are allowed)")


def _is_pil_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "convert") and hasattr(value, "size")


def check_image_options(config: Any) -> None:
    """Check an ``EngineConfig``'s (or ``EmbedderConfig``'s) image options (``mmproj`` and
    the limits), and what they cannot be combined with: a draft model (``speculative_config``
    method ``draft_model``) would draft without seeing the images (the ``ngram`` and ``suffix``
    methods draft text only: their drafts stop at an image's stand-in ids,
    ``draft_cuts.text_drafts``). With ``prefix_cache=False`` every prompt's images are
    computed anew into its own slot."""
    for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(config.allow_remote_images, bool):
        raise ValueError(f"allow_remote_images must be True or False, got {config.allow_remote_images!r}")
    mmproj = config.mmproj
    if mmproj is None:
        return
    if not isinstance(mmproj, (str, os.PathLike)) or not str(mmproj):
        raise ValueError(f"mmproj must be a path (str), got {mmproj!r}")
    spec = getattr(config, "speculative_config", None)
    if spec is not None and spec.get("method") == "draft_model":
        raise ValueError(
            "mmproj cannot be combined with speculative_config method 'draft_model' (the draft model "
            "does not see the images); the 'ngram' and 'suffix' methods can"
        )


def limits_of(config: Any) -> ImageLimits:
    """The :class:`ImageLimits` of an ``EngineConfig`` (or ``EmbedderConfig``)."""
    return ImageLimits(
        max_bytes=config.max_image_bytes,
        max_pixels=config.max_image_pixels,
        max_images=config.max_images_per_request,
        allow_remote=config.allow_remote_images,
    )


def image_parts(
    messages: Sequence[Mapping[str, Any]], marker: str
) -> tuple[list[Mapping[str, Any]], list[Any], list[str]]:
    """OpenAI chat ``messages`` with each ``image_url`` content part replaced by ``marker``
    (where the chat template then renders it), the parts' images (their URLs, in order) and
    the parts' names (``messages[i].content[j]``). A message with image parts gets its parts
    joined into one string as llama-server joins them (``common_chat_msg``): text parts with
    newlines, none before or after a marker; one with a part of another kind keeps its parts
    (the marker as a text part) for the template's check to reject. Messages without image
    parts are passed through as they are. Raises ImageError for an image part without a URL."""
    out: list[Mapping[str, Any]] = []
    images: list[Any] = []
    parts: list[str] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
            out.append(message)
            continue
        new_content: list[Any] = []
        joined: str | None = ""
        after_marker = False
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "image_url"):
                new_content.append(part)
                text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else part
                if joined is not None and isinstance(text, str):
                    joined += ("\n" if joined and not after_marker else "") + text
                    after_marker = False
                else:
                    joined = None
                continue
            name = f"messages[{i}].content[{j}]"
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            if not isinstance(url, str) or not url:
                raise ImageError(name, "an image_url part needs its URL: {'image_url': {'url': ...}}")
            images.append(url)
            parts.append(name)
            new_content.append({"type": "text", "text": marker})
            if joined is not None:
                joined, after_marker = joined + marker, True
        had_images = any(isinstance(p, Mapping) and p.get("type") == "image_url" for p in content)
        if had_images:
            out.append({**message, "content": new_content if joined is None else joined})
        else:
            out.append(message)
    return out, images, parts
