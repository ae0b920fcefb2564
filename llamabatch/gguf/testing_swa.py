"""A random-weight sliding-window-attention test model: Gemma 3's architecture, small.

Gemma 3 (``gemma3`` in llama.cpp) interleaves layers that attend over a sliding window of
the last ``sliding_window`` positions with layers that attend over the whole context (one in
every six). llama.cpp then keeps two KV caches, the sliding one a ring of cells reused as the
window moves; :func:`make_swa_model` writes such a model for tests that need that path, with
a window small enough that short prompts cross it. The vocabulary is the Llama test models'
(``build_vocab``); the weights are Q8_0 (their products give a token the same row whatever
else the ubatch holds, as SmolLM2's do) and come from a seeded PCG64 stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamabatch.gguf.testing_llama import CHATML_TEMPLATE, built_once, cache_dir
from llamabatch.gguf.testing_vocab import add_test_vocab

__all__ = ["SWASpec", "make_swa_model", "write_swa_gguf"]


@dataclass(frozen=True)
class SWASpec:
    """The shape of a Gemma 3 test model; ``n_layer`` of 6 gives five sliding layers and one
    global one."""

    n_vocab: int = 1024
    n_embd: int = 128
    n_layer: int = 6
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff: int = 256
    sliding_window: int = 16
    n_ctx_train: int = 2048
    seed: int = 3

    @property
    def name(self) -> str:
        """The file's name: every field of the shape, so that changed shapes never collide."""
        return (
            f"swa-gemma3-v{self.n_vocab}-e{self.n_embd}-l{self.n_layer}-h{self.n_head}-kv{self.n_head_kv}"
            f"-d{self.head_dim}-f{self.n_ff}-w{self.sliding_window}-c{self.n_ctx_train}-s{self.seed}.gguf"
        )


def _tensors(spec: SWASpec) -> list[tuple[str, tuple[int, ...], float | None]]:
    """``(name, numpy shape, std)`` of every tensor; ``std is None``: a norm weight."""
    d, q, kv, ff = spec.n_embd, spec.head_dim * spec.n_head, spec.head_dim * spec.n_head_kv, spec.n_ff
    plan: list[tuple[str, tuple[int, ...], float | None]] = [
        ("token_embd.weight", (spec.n_vocab, d), d**-0.5),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (d,), None),
            (p + "attn_q.weight", (q, d), d**-0.5),
            (p + "attn_k.weight", (kv, d), d**-0.5),
            (p + "attn_v.weight", (kv, d), d**-0.5),
            (p + "attn_output.weight", (d, q), q**-0.5),
            (p + "attn_q_norm.weight", (spec.head_dim,), None),
            (p + "attn_k_norm.weight", (spec.head_dim,), None),
            (p + "post_attention_norm.weight", (d,), None),
            (p + "ffn_norm.weight", (d,), None),
            (p + "ffn_gate.weight", (ff, d), d**-0.5),
            (p + "ffn_up.weight", (ff, d), d**-0.5),
            (p + "ffn_down.weight", (d, ff), ff**-0.5),
            (p + "post_ffw_norm.weight", (d,), None),
        ]
    plan.append(("output_norm.weight", (d,), None))
    return plan


def write_swa_gguf(path: str | os.PathLike[str], spec: SWASpec | None = None) -> Path:
    """Write the Gemma 3 test model of ``spec`` (default :class:`SWASpec`) to ``path``."""
    import gguf
    from gguf.quants import quantize

    spec = spec or SWASpec()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    plan = _tensors(spec)
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    writer = gguf.GGUFWriter(str(tmp), arch="gemma3")
    try:
        writer.add_name(path.stem)
        writer.add_file_type(7)  # MOSTLY_Q8_0
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_vocab_size(spec.n_vocab)
        writer.add_context_length(spec.n_ctx_train)
        writer.add_embedding_length(spec.n_embd)
        writer.add_block_count(spec.n_layer)
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(10000.0)
        writer.add_sliding_window(spec.sliding_window)
        add_test_vocab(writer, spec.n_vocab)
        writer.add_chat_template(CHATML_TEMPLATE)
        f32, q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
        for name, shape, std in plan:
            if std is None:
                writer.add_tensor(name, np.ones(shape, dtype=np.float32), raw_dtype=f32)
            else:
                values = (rng.random(shape, dtype=np.float32) * 2 - 1) * np.float32(std * 3.0**0.5)
                writer.add_tensor(name, quantize(values, q8_0), raw_dtype=q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def make_swa_model(directory: str | os.PathLike[str] | None = None, spec: SWASpec | None = None) -> Path:
    """The path of the Gemma 3 test model of ``spec`` in ``directory`` (default: the test
    models' cache folder), written on first use (atomic, safe against concurrent builders)."""
    spec = spec or SWASpec()
    folder = Path(directory) if directory is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return built_once(folder / spec.name, lambda path: write_swa_gguf(path, spec))
