"""Images from clients (``prompts/images.py``): sizes read from headers before decoding, the
limits, URLs, and hostile bytes (fuzzed in a child process, so that a decoder crash would fail
the test, not end the test run)."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from llamabatch.errors import ImageError
from llamabatch.prompts.images import (
    ImageLimits,
    decode_image,
    image_dimensions,
    image_key,
    image_parts,
    load_image,
)

PIL = pytest.importorskip("PIL.Image")


def _encoded(fmt: str, height: int = 17, width: int = 23) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(np.full((height, width, 3), 128, np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_header_dimensions_without_decoding(fmt):
    data = _encoded(fmt)
    assert image_dimensions(data) == (fmt, 23, 17)
    assert decode_image(data, ImageLimits()).shape == (17, 23, 3)


def test_huge_header_refused_before_decoding(monkeypatch):
    import PIL.Image

    def no_decoder(*args, **kwargs):
        raise AssertionError("the decoder was reached")

    monkeypatch.setattr(PIL.Image, "open", no_decoder)
    with pytest.raises(ImageError, match=r"part\[1\]: 30000 x 30000 pixels, more than"):
        decode_image(_png_header(30000, 30000), ImageLimits(), "part[1]")


def test_limits():
    data = _encoded("PNG")
    with pytest.raises(ImageError, match="bytes, more than the 10 allowed"):
        decode_image(data, ImageLimits(max_bytes=10))
    with pytest.raises(ImageError, match="more than the 100 allowed"):
        decode_image(data, ImageLimits(max_pixels=100))
    with pytest.raises(ImageError, match="3 images, more than the 2"):
        ImageLimits(max_images=2).check_count(3)
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


def test_truncated_and_not_images():
    data = _encoded("PNG")
    with pytest.raises(ImageError, match="cannot decode"):
        decode_image(data[: len(data) // 2], ImageLimits())
    with pytest.raises(ImageError, match="not a PNG, JPEG"):
        decode_image(b"<html>", ImageLimits())
    with pytest.raises(ImageError, match="header"):
        decode_image(b"\x89PNG\r\n\x1a\n", ImageLimits())


def test_urls():
    import base64

    data = _encoded("PNG")
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    np.testing.assert_array_equal(load_image(url, ImageLimits()), decode_image(data, ImageLimits()))
    with pytest.raises(ImageError, match="does not decode"):
        load_image("data:image/png;base64,@@@", ImageLimits())
    with pytest.raises(ImageError, match="not an image"):
        load_image("data:text/plain;base64,aGk=", ImageLimits())
    with pytest.raises(ImageError, match="remote image URLs are off"):
        load_image("http://example.com/a.png", ImageLimits())
    with pytest.raises(ImageError, match="not a public address"):
        load_image("http://127.0.0.1/a.png", ImageLimits(allow_remote=True))
    with pytest.raises(ImageError, match="data: URL"):
        load_image("file:///etc/passwd", ImageLimits())


def test_image_key_is_content():
    a = np.zeros((4, 5, 3), np.uint8)
    assert image_key(a) == image_key(a.copy())
    assert image_key(a) != image_key(np.zeros((5, 4, 3), np.uint8))


def test_image_parts_join_as_llama_server():
    """Text parts joined with newlines, none before or after a marker (llama.cpp's
    ``common_chat_msg::to_json_oaicompat``); a part of another kind keeps the list."""
    image = {"type": "image_url", "image_url": {"url": "data:a"}}
    text = [{"type": "text", "text": t} for t in ("a", "b", "c")]
    messages = [
        {"role": "system", "content": "plain"},
        {"role": "user", "content": [text[0], image, text[1], text[2], image, image]},
        {"role": "user", "content": [image, "d", text[0]]},
    ]
    out, images, parts = image_parts(messages, "<M>")
    assert out[0] is messages[0] and images == ["data:a"] * 4
    assert [m["content"] for m in out[1:]] == ["a<M>b\nc<M><M>", "<M>d\na"]
    assert parts == [
        "messages[1].content[1]",
        "messages[1].content[4]",
        "messages[1].content[5]",
        "messages[2].content[0]",
    ]
    (odd,), _, _ = image_parts([{"role": "user", "content": [image, {"type": "audio"}]}], "<M>")
    assert odd["content"] == [{"type": "text", "text": "<M>"}, {"type": "audio"}]


FUZZ = textwrap.dedent(
    """
    import io, sys
    import numpy as np
    from hypothesis import given, settings, strategies as st, HealthCheck
    from PIL import Image
    from llamabatch.errors import ImageError
    from llamabatch.prompts.images import ImageLimits, decode_image

    seeds = []
    for fmt in ("PNG", "JPEG", "GIF", "WEBP", "BMP"):
        buf = io.BytesIO()
        Image.fromarray(np.arange(16 * 12 * 3, dtype=np.uint8).reshape(16, 12, 3)).save(buf, format=fmt)
        seeds.append(buf.getvalue())
    limits = ImageLimits(max_pixels=4096)

    @st.composite
    def mutated(draw):
        data = bytearray(draw(st.sampled_from(seeds)))
        for _ in range(draw(st.integers(0, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        cut = draw(st.integers(1, len(data)))
        return bytes(data[:cut])

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.one_of(mutated(), st.binary(max_size=64)))
    def fuzz(data):
        try:
            pixels = decode_image(data, limits, "fuzz")
        except ImageError:
            return
        assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
        assert pixels.shape[0] * pixels.shape[1] <= limits.max_pixels

    fuzz()
    print("fuzz ok")
    """
)


def test_fuzz_image_bytes_in_a_child_process():
    done = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fuzz ok" in done.stdout
