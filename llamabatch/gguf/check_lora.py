"""Check a LoRA adapter GGUF against its base model before llama.cpp reads it.

llama.cpp's adapter loader reads ``general.type``, ``general.architecture`` and ``adapter.type``
with ``gguf_get_val_str`` and ``adapter.lora.alpha`` with ``gguf_get_val_f32``, which abort the
process (``GGML_ASSERT``) when the key holds another type; the rest it refuses with an exception
it turns into a NULL return and a log line. :func:`check_lora` refuses all of it first, with a
:class:`~llamabatch.errors.LoraLoadError` naming the adapter file and what is wrong:

* the container (``gguf/reader.py``: magic, version, counts, tensor types and data in bounds);
* ``general.type == "adapter"``, ``adapter.type == "lora"`` (strings), ``adapter.lora.alpha``
  a finite FLOAT32 when present, ``general.architecture`` equal to the base model's;
* no ``adapter.alora.invocation_tokens`` (activated LoRA is not supported here);
* every tensor named ``X.lora_a`` / ``X.lora_b`` (or a ``*_norm.weight``, which llama.cpp
  ignores), in complete pairs, 2-D, of a type the matrix product takes, with finite values;
  ``X`` a 2-D tensor of the base model, and the shapes llama.cpp requires: for a base ``[n_in,
  n_out]`` (ggml order), ``lora_a`` is ``[n_in, r]`` and ``lora_b`` ``[r, n_out]``; for
  ``token_embd.weight`` (``[n_embd, n_vocab]``), ``lora_a`` is ``[r, n_vocab]`` and ``lora_b``
  ``[r, n_embd]``.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType, Keys

from llamabatch.errors import LoraLoadError, ModelLoadError
from llamabatch.gguf.reader import Header, read_header, type_name

__all__ = ["LoraReport", "check_lora"]

_Q = GGMLQuantizationType
#: tensor types an adapter may use (ggml's CPU matrix product takes them as its first operand)
LORA_TYPES = frozenset({_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0})
#: float types whose values are checked to be finite (a NaN makes every logit NaN)
_FLOAT_DTYPES = {_Q.F32: "<f4", _Q.F16: "<f2"}
_ALORA_KEY = "adapter.alora.invocation_tokens"


@dataclass(frozen=True)
class LoraReport:
    """What :func:`check_lora` read from an adapter that passed."""

    path: Path
    architecture: str
    alpha: float
    #: base tensor name -> rank
    ranks: dict[str, int]

    @property
    def n_pairs(self) -> int:
        return len(self.ranks)


def check_lora(path: str | os.PathLike[str], base: str | os.PathLike[str] | Header) -> LoraReport:
    """Check the adapter at ``path`` against the base model ``base`` (a path, or its header).

    Raises ``FileNotFoundError`` for a missing file, :class:`~llamabatch.errors.LoraLoadError`
    (a ``ModelLoadError``) naming the adapter file for anything llama.cpp would refuse or abort on.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"LoRA adapter file not found: {str(path)!r}")
    if not path.is_file():
        raise LoraLoadError(str(path), "not a regular file")
    try:
        header = read_header(path)
    except ModelLoadError as exc:
        raise LoraLoadError(str(path), _reason(exc, path)) from None
    base_header = base if isinstance(base, Header) else read_header(Path(base))
    return _LoraChecker(path, header, base_header).run()


def _reason(exc: ModelLoadError, path: Path) -> str:
    prefix = f"cannot load model {str(path)!r}: "
    text = str(exc)
    return text[len(prefix) :] if text.startswith(prefix) else text


class _LoraChecker:
    def __init__(self, path: Path, header: Header, base: Header) -> None:
        self.path = path
        self.h = header
        self.base = base

    def fail(self, where: str, what: str) -> LoraLoadError:
        return LoraLoadError(str(self.path), f"{where}: {what}")

    def string(self, header: Header, key: str, *, base: bool = False) -> str:
        entry = header.kv.get(key)
        if entry is None:
            if base:
                raise LoraLoadError(str(self.path), f"the base model has no {key}")
            raise self.fail(key, "missing (required)")
        if entry.type != GGUFValueType.STRING:
            raise self.fail(key, f"must be a string, is {type_name(entry)}")
        return bytes(entry.value).decode("utf-8", "replace")

    def run(self) -> LoraReport:
        kind = self.string(self.h, Keys.General.TYPE)
        if kind != "adapter":
            raise self.fail(
                Keys.General.TYPE, f"{kind!r}, expected 'adapter' (is this a model, not an adapter?)"
            )
        adapter_type = self.string(self.h, Keys.Adapter.TYPE)
        if adapter_type != "lora":
            raise self.fail(Keys.Adapter.TYPE, f"{adapter_type!r}, expected 'lora'")
        arch = self.string(self.h, Keys.General.ARCHITECTURE)
        base_arch = self.string(self.base, Keys.General.ARCHITECTURE, base=True)
        if arch != base_arch:
            raise self.fail(
                Keys.General.ARCHITECTURE,
                f"{arch!r}, but the base model is {base_arch!r} (wrong base model?)",
            )
        alpha = 0.0
        entry = self.h.kv.get(Keys.Adapter.LORA_ALPHA)
        if entry is not None:
            if entry.type != GGUFValueType.FLOAT32:
                raise self.fail(Keys.Adapter.LORA_ALPHA, f"must be a FLOAT32, is {type_name(entry)}")
            alpha = float(entry.value)
            if not math.isfinite(alpha):
                raise self.fail(Keys.Adapter.LORA_ALPHA, f"{alpha} is not finite")
        if _ALORA_KEY in self.h.kv:
            raise self.fail(_ALORA_KEY, "activated LoRA (aLoRA) adapters are not supported")
        ranks = self.check_tensors()
        return LoraReport(self.path, arch, alpha, ranks)

    def check_tensors(self) -> dict[str, int]:
        pairs: dict[str, dict[str, tuple[int, ...]]] = {}
        for t in self.h.tensors:
            where = f"tensor {t.name!r}"
            for suffix in (".lora_a", ".lora_b"):
                if t.name.endswith(suffix):
                    pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = t.dims
                    break
            else:
                if t.name.endswith("_norm.weight"):
                    continue  # llama.cpp skips norm tensors of an adapter
                raise self.fail(where, "unexpected name: adapter tensors end in '.lora_a' or '.lora_b'")
            if t.type not in LORA_TYPES:
                names = ", ".join(sorted(q.name for q in LORA_TYPES))
                raise self.fail(where, f"type {t.type.name}: adapter tensors must be one of {names}")
            if len(_strip(t.dims)) > 2 or not t.dims or min(t.dims) < 1:
                raise self.fail(where, f"shape {list(t.dims)}: adapter tensors are 2-D and non-empty")
        if not pairs:
            raise self.fail("tensors", "no '.lora_a' / '.lora_b' pairs: the adapter changes nothing")
        base_tensors = {t.name: t.dims for t in self.base.tensors}
        ranks: dict[str, int] = {}
        for name, pair in pairs.items():
            if len(pair) != 2:
                missing = ".lora_b" if ".lora_a" in pair else ".lora_a"
                raise self.fail(f"tensor {name + missing!r}", "missing: its pair is incomplete")
            target = base_tensors.get(name)
            if target is None:
                raise self.fail(
                    f"tensor {name + '.lora_a'!r}", f"the base model has no tensor {name!r} (wrong base?)"
                )
            w = _dims2(target)
            a, b = _dims2(pair[".lora_a"]), _dims2(pair[".lora_b"])
            if len(_strip(target)) > 2:
                raise self.fail(
                    f"tensor {name!r}", f"base shape {list(target)}: only 2-D weights take a LoRA"
                )
            if name.endswith("token_embd.weight"):
                ok, rank = w[0] == b[1] and w[1] == a[1] and a[0] == b[0], a[0]
                want = f"lora_a [r, {w[1]}] and lora_b [r, {w[0]}]"
            else:
                ok, rank = w[0] == a[0] and w[1] == b[1] and a[1] == b[0], a[1]
                want = f"lora_a [{w[0]}, r] and lora_b [r, {w[1]}]"
            if not ok:
                raise self.fail(
                    f"tensor {name!r}",
                    f"lora_a {list(a)} and lora_b {list(b)} do not fit the base's {list(w)} "
                    f"(ggml order; expected {want}; wrong base model?)",
                )
            ranks[name] = int(rank)
        self.check_values()
        return ranks

    def check_values(self) -> None:
        """Float tensors hold finite values (one NaN would make every logit NaN)."""
        with self.path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for t in self.h.tensors:
                dtype = _FLOAT_DTYPES.get(t.type)
                if dtype is None:
                    continue
                start = self.h.data_offset + t.offset
                values = np.frombuffer(
                    buf, dtype=dtype, count=t.nbytes // np.dtype(dtype).itemsize, offset=start
                )
                finite = bool(np.isfinite(values).all())
                del values  # the mapping cannot close while a view of it lives
                if not finite:
                    raise self.fail(f"tensor {t.name!r}", "holds NaN or infinite values")


def _strip(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Dims without trailing ones (ggml pads shapes with ones)."""
    out = list(dims)
    while len(out) > 1 and out[-1] == 1:
        out.pop()
    return tuple(out)


def _dims2(dims: tuple[int, ...]) -> tuple[int, int]:
    return (dims[0] if dims else 1, dims[1] if len(dims) > 1 else 1)
