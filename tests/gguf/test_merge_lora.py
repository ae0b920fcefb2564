"""``gguf/merge_lora.py``: a base model with one LoRA adapter merged into its weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from llamabatch.errors import LoraLoadError
from llamabatch.gguf.merge_lora import ADAPTER_KEY, SCALE_KEY, lora_scale, merge_lora
from llamabatch.testing import make_lora, model_path

RANK, ALPHA = 4, 6.0


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_path("tiny")


def with_embedding_pair(base: Path, adapter: Path, out: Path, seed: int = 3) -> Path:
    """``adapter``'s tensors plus a ``token_embd.weight`` pair (llama.cpp's layout for it:
    ``lora_a`` numpy ``(n_vocab, r)``, ``lora_b`` numpy ``(n_embd, r)``)."""
    src = gguf.GGUFReader(str(adapter))
    base_reader = gguf.GGUFReader(str(base))
    embd = next(t for t in base_reader.tensors if t.name == "token_embd.weight")
    n_embd, n_vocab = (int(d) for d in embd.shape)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch="llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    for t in src.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.add_tensor("token_embd.weight.lora_a", rng.normal(0, 0.3, (n_vocab, RANK)).astype(np.float32))
    writer.add_tensor("token_embd.weight.lora_b", rng.normal(0, 0.3, (n_embd, RANK)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def adapter(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("merge")
    plain = make_lora(tiny, d / "plain.gguf", rank=RANK, seed=1, alpha=ALPHA)
    return with_embedding_pair(tiny, plain, d / "adapter.gguf")


def test_merged_tensors_are_base_plus_scaled_delta(tiny: Path, adapter: Path, tmp_path: Path) -> None:
    report = merge_lora(tiny, adapter, tmp_path / "merged.gguf", scale=0.75)
    factor = lora_scale(ALPHA, RANK, 0.75)
    assert factor == pytest.approx(0.75 * ALPHA / RANK)
    assert all(f == pytest.approx(factor) for f in report.factors.values())
    base, lora, merged = (gguf.GGUFReader(str(p)) for p in (tiny, adapter, report.path))
    pairs = {t.name: np.array(t.data, dtype=np.float32) for t in lora.tensors}
    merged_tensors = {t.name: t for t in merged.tensors}
    assert [t.name for t in merged.tensors] == [t.name for t in base.tensors]
    n_adapted = 0
    for t in base.tensors:
        w, m = np.array(t.data, dtype=np.float32), merged_tensors[t.name]
        assert m.tensor_type == t.tensor_type == gguf.GGMLQuantizationType.F32  # float bases keep it
        a, b = pairs.get(t.name + ".lora_a"), pairs.get(t.name + ".lora_b")
        if a is None or b is None:
            np.testing.assert_array_equal(np.array(m.data), w)
            continue
        n_adapted += 1
        delta = a @ b.T if t.name == "token_embd.weight" else b @ a
        np.testing.assert_allclose(np.array(m.data), w + factor * delta, rtol=1e-5, atol=1e-6)
    assert n_adapted == len(report.factors) and "token_embd.weight" in report.factors
    assert "output.weight" not in report.factors
    base_keys = {f for f in base.fields if not f.startswith("GGUF.")}
    merged_keys = {f for f in merged.fields if not f.startswith("GGUF.")}
    assert merged_keys == base_keys | {ADAPTER_KEY, SCALE_KEY}
    for key in base_keys:
        assert merged.fields[key].parts[-1].tobytes() == base.fields[key].parts[-1].tobytes(), key


def test_merge_refuses_bad_inputs_and_leaves_nothing(tiny: Path, adapter: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "merged.gguf"
    with pytest.raises(ValueError, match="out_type"):
        merge_lora(tiny, adapter, out, out_type="q2_k")
    with pytest.raises(ValueError, match="scale"):
        merge_lora(tiny, adapter, out, scale=float("nan"))
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        merge_lora(tiny, tmp_path / "missing.gguf", out)
    with pytest.raises(LoraLoadError, match=r"tiny.*general\.type"):
        merge_lora(tiny, tiny, out)  # a model, not an adapter
    other = model_path("small")
    with pytest.raises(LoraLoadError, match=r"adapter\.gguf"):
        merge_lora(other, adapter, out)  # shapes of another model
    assert not out.exists() and not list(tmp_path.rglob("*.tmp"))


def test_embedding_adapter_on_tied_output_is_refused(tmp_path: Path) -> None:
    """SmolLM2's output layer is its token embeddings: merging a ``token_embd`` delta would
    change the output layer, which llama.cpp's adapter leaves alone."""
    from llamabatch.testing import real_model_path

    smol = Path("/tmp/smollm2.gguf")
    if not smol.exists():
        try:
            smol = real_model_path()
        except Exception as exc:  # no network, no cache
            pytest.skip(f"SmolLM2 not available: {exc}")
    plain = make_lora(smol, tmp_path / "plain.gguf", rank=RANK, seed=1)
    adapter = with_embedding_pair(smol, plain, tmp_path / "embd.gguf")
    with pytest.raises(LoraLoadError, match="shares the token embeddings"):
        merge_lora(smol, adapter, tmp_path / "merged.gguf")
    assert not (tmp_path / "merged.gguf").exists()
