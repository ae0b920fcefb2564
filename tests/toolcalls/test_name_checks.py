"""Names and ids a client or a file sends are checked whole (``re.fullmatch``): a trailing
newline, which ``$`` lets through with ``re.match``, is refused."""

from __future__ import annotations

import pytest

from llamabatch.gguf.convert import _gguf_name
from llamabatch.toolcalls.base import normalize_tools


@pytest.mark.parametrize("name", ["a\n", "get_weather\n", "\na", "a\nb", "a" * 65])
def test_tool_names_are_checked_whole(name):
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        normalize_tools([{"type": "function", "function": {"name": name}}])


def test_a_good_tool_name_passes():
    (spec,) = normalize_tools([{"type": "function", "function": {"name": "ns.get-weather_2"}}])
    assert spec.name == "ns.get-weather_2"


def test_converted_tensor_names_are_matched_whole():
    good = "encoder.layer.0.attention.self.query.weight"
    assert _gguf_name(good, None) is not None
    with pytest.raises(ValueError, match="unsupported tensor"):
        _gguf_name(good + "\n", None)
