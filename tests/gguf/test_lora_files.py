"""LoRA adapter files: the test adapters (``make_lora``), the checks before llama.cpp reads a file
(``gguf/check_lora.py``) and the binding's owner (``_ffi/lora.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from llamabatch.errors import LoraLoadError, ModelLoadError
from llamabatch.gguf.check_lora import check_lora
from llamabatch.gguf.reader import read_header
from llamabatch.testing import lora_ranks, make_lora, model_path


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_path("tiny")


@pytest.fixture(scope="module")
def good(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(tiny, tmp_path_factory.mktemp("lora") / "good.gguf", rank=4, seed=1)


def _shapes(base: Path) -> dict[str, tuple[int, ...]]:
    return {t.name: t.dims for t in read_header(base).tensors}


def write_adapter(
    path: Path,
    tensors: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    kv: dict[str, object] | None = None,
    general_type: object = "adapter",
    adapter_type: object = "lora",
    alpha: object = 4.0,
) -> Path:
    """An adapter GGUF with exactly these keys and tensors (a bad value is written as given)."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in [
        (gguf.Keys.General.TYPE, general_type),
        (gguf.Keys.Adapter.TYPE, adapter_type),
        (gguf.Keys.Adapter.LORA_ALPHA, alpha),
        *(kv or {}).items(),
    ]:
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)  # type: ignore[arg-type]
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pair(base: Path, name: str, rank: int = 4) -> dict[str, np.ndarray]:
    n_in, n_out = _shapes(base)[name]
    return {
        f"{name}.lora_a": np.full((rank, n_in), 0.01, np.float32),
        f"{name}.lora_b": np.full((n_out, rank), 0.01, np.float32),
    }


# -- make_lora ---------------------------------------------------------------------------------


def test_make_lora_layout(tiny: Path, good: Path) -> None:
    header = read_header(good)
    assert header.kv[gguf.Keys.General.TYPE].value == b"adapter"
    assert header.kv[gguf.Keys.Adapter.TYPE].value == b"lora"
    assert header.kv[gguf.Keys.General.ARCHITECTURE].value == b"llama"
    assert header.kv[gguf.Keys.Adapter.LORA_ALPHA].type == gguf.GGUFValueType.FLOAT32
    base = _shapes(tiny)
    ranks = lora_ranks(good)
    assert ranks and set(ranks.values()) == {4}
    for t in header.tensors:
        stem = t.name.rsplit(".", 1)[0]
        n_in, n_out = base[stem]
        assert t.dims == ((n_in, 4) if t.name.endswith("lora_a") else (4, n_out))
    report = check_lora(good, tiny)
    assert report.n_pairs == len(ranks) and report.alpha == 4.0


def test_make_lora_is_deterministic(tiny: Path, tmp_path: Path) -> None:
    a = make_lora(tiny, tmp_path / "a.gguf", rank=2, seed=3).read_bytes()
    b = make_lora(tiny, tmp_path / "b.gguf", rank=2, seed=3).read_bytes()
    c = make_lora(tiny, tmp_path / "c.gguf", rank=2, seed=4).read_bytes()
    assert a == b != c


def test_make_lora_refuses_bad_arguments(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank"):
        make_lora(tiny, tmp_path / "x.gguf", rank=0)
    with pytest.raises(ValueError, match="seed"):
        make_lora(tiny, tmp_path / "x.gguf", seed=-1)


# -- check_lora: broken files ------------------------------------------------------------------


def _cases(base: Path, d: Path) -> dict[str, tuple[Path, str]]:
    q = "blk.0.attn_q.weight"
    ok = _pair(base, q)
    n_in, n_out = _shapes(base)[q]
    nan = dict(ok)
    nan[f"{q}.lora_a"] = ok[f"{q}.lora_a"].copy()
    nan[f"{q}.lora_a"][0, 0] = np.nan
    cases = {
        "model": (base, "general.type: missing"),
        "type_not_adapter": (write_adapter(d / "t.gguf", ok, general_type="model"), "expected 'adapter'"),
        "type_not_string": (
            write_adapter(d / "t2.gguf", ok, general_type=7),
            "general.type: must be a string",
        ),
        "not_lora": (write_adapter(d / "c.gguf", ok, adapter_type="control_vector"), "expected 'lora'"),
        "no_adapter_type": (write_adapter(d / "n.gguf", ok, adapter_type=None), "adapter.type: missing"),
        "alpha_not_float": (
            write_adapter(d / "al.gguf", ok, alpha="8"),
            "adapter.lora.alpha: must be a FLOAT32",
        ),
        "alpha_nan": (write_adapter(d / "an.gguf", ok, alpha=float("nan")), "not finite"),
        "arch": (write_adapter(d / "ar.gguf", ok, arch="qwen2"), "'qwen2', but the base model is 'llama'"),
        "alora": (
            write_adapter(d / "alo.gguf", ok, kv={"adapter.alora.invocation_tokens": [1, 2]}),
            "aLoRA",
        ),
        "no_tensors": (write_adapter(d / "e.gguf", {}), "no '.lora_a' / '.lora_b' pairs"),
        "half_pair": (write_adapter(d / "h.gguf", {f"{q}.lora_a": ok[f"{q}.lora_a"]}), "lora_b': missing"),
        "suffix": (write_adapter(d / "s.gguf", {f"{q}.delta": ok[f"{q}.lora_a"]}), "unexpected name"),
        "not_in_base": (
            write_adapter(d / "nb.gguf", _rename(ok, q, "blk.99.attn_q.weight")),
            "has no tensor",
        ),
        "shape": (
            write_adapter(
                d / "sh.gguf",
                {f"{q}.lora_a": np.zeros((4, n_in + 1), np.float32), f"{q}.lora_b": ok[f"{q}.lora_b"]},
            ),
            "do not fit the base",
        ),
        "not_transposed": (
            write_adapter(
                d / "tr.gguf",
                {
                    f"{q}.lora_a": np.zeros((4, n_in), np.float32),
                    f"{q}.lora_b": np.zeros((n_out, 3), np.float32),
                },
            ),
            "do not fit the base",
        ),
        "three_d": (
            write_adapter(
                d / "3d.gguf",
                {f"{q}.lora_a": np.zeros((2, 4, n_in), np.float32), f"{q}.lora_b": ok[f"{q}.lora_b"]},
            ),
            "2-D",
        ),
        "int_type": (
            write_adapter(
                d / "i.gguf", {f"{q}.lora_a": np.zeros((4, n_in), np.int32), f"{q}.lora_b": ok[f"{q}.lora_b"]}
            ),
            "type I32",
        ),
        "nan": (write_adapter(d / "nan.gguf", nan), "NaN"),
    }
    good = write_adapter(d / "g.gguf", ok)
    data = good.read_bytes()
    (d / "trunc.gguf").write_bytes(data[: len(data) - 100])
    cases["truncated"] = (d / "trunc.gguf", "outside the file")
    (d / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    cases["magic"] = (d / "magic.gguf", "not a GGUF file")
    (d / "empty.gguf").write_bytes(b"")
    cases["empty"] = (d / "empty.gguf", "too small")
    return cases


def _rename(tensors: dict[str, np.ndarray], old: str, new: str) -> dict[str, np.ndarray]:
    return {k.replace(old, new): v for k, v in tensors.items()}


def test_broken_adapters_are_refused_naming_the_file(tiny: Path, tmp_path: Path) -> None:
    for case, (path, message) in _cases(tiny, tmp_path).items():
        with pytest.raises(LoraLoadError) as info:
            check_lora(path, tiny)
        text = str(info.value)
        assert str(path) in text, case
        assert message in text, (case, text)
        assert isinstance(info.value, ModelLoadError)


def test_missing_adapter_file(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        check_lora(tmp_path / "nope.gguf", tiny)
    with pytest.raises(LoraLoadError, match="not a regular file"):
        check_lora(tmp_path, tiny)


def test_adapter_for_another_shape_is_refused(tiny: Path, tmp_path: Path) -> None:
    other = model_path("small")
    adapter = make_lora(other, tmp_path / "other.gguf", rank=2)
    with pytest.raises(LoraLoadError, match="do not fit the base"):
        check_lora(adapter, tiny)


def test_good_file_with_a_norm_tensor_passes(tiny: Path, tmp_path: Path) -> None:
    tensors = _pair(tiny, "blk.0.attn_v.weight", rank=2)
    tensors["blk.0.attn_norm.weight"] = np.ones(8, np.float32)  # llama.cpp skips these
    assert check_lora(write_adapter(tmp_path / "n.gguf", tensors), tiny).ranks == {"blk.0.attn_v.weight": 2}


# -- the binding -------------------------------------------------------------------------------


def test_adapter_loads_and_is_freed_once(tiny: Path, good: Path) -> None:
    from llamabatch._ffi.context import Context
    from llamabatch._ffi.lora import LoraAdapter, set_adapters
    from llamabatch._ffi.model import Model

    model = Model(tiny)
    context = Context(model, n_ctx=64, n_batch=16, n_seq_max=1)
    adapter = LoraAdapter(model, good)
    assert adapter.report is not None and adapter.report.n_pairs == len(lora_ranks(good))
    set_adapters(context, [adapter], [0.5])
    assert context.adapters == (adapter,) and context.adapter_scales == (0.5,)
    adapter.close()  # cleared from the context first
    assert context.adapters == () and adapter.closed
    adapter.close()
    second = LoraAdapter(model, good)
    set_adapters(context, [second], None)
    model.close()  # closes the context, then frees the adapter before the model
    assert second.closed and context.closed
    second.close()


def test_binding_refuses_bad_files_and_the_process_lives(tiny: Path, tmp_path: Path) -> None:
    from llamabatch._ffi.lora import LoraAdapter
    from llamabatch._ffi.model import Model

    model = Model(tiny)
    try:
        for case, (path, _message) in _cases(tiny, tmp_path).items():
            with pytest.raises(LoraLoadError, match="cannot load LoRA adapter"):
                LoraAdapter(model, path)
            assert not model.closed, case
    finally:
        model.close()


def test_unchecked_alpha_type_would_abort_llama_cpp(tiny: Path, tmp_path: Path) -> None:
    """Why the check exists: llama.cpp reads adapter.lora.alpha with an assertion on its type."""
    path = write_adapter(tmp_path / "al.gguf", _pair(tiny, "blk.0.attn_q.weight"), alpha="8")
    script = textwrap.dedent(
        f"""
        from llamabatch._ffi.lora import LoraAdapter
        from llamabatch._ffi.model import Model
        LoraAdapter(Model({str(tiny)!r}), {str(path)!r}, validate=False)
        print("survived")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "survived" not in run.stdout
    assert "GGML_ASSERT" in run.stderr
