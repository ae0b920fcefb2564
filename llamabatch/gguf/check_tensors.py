"""The tensor checks of ``check_gguf``: for the architectures whose layout llamabatch knows
(``llama`` and ``bert``), every tensor present once, with the shape the hyper-parameters imply and
a type llama.cpp can compute with."""

from __future__ import annotations

from gguf.constants import Keys

from llamabatch.gguf.check_base import (
    ADDED_AS_IS,
    INTERMEDIATE_TYPES,
    LLAMA_LIKE,
    NON_WEIGHT_TYPES,
    VECTOR_TYPES,
    CheckerBase,
)


class TensorChecks(CheckerBase):
    """``check_layout`` and its parts."""

    def check_layout(self) -> None:
        arch = self.arch
        n_layer = self.get_int(self.k(Keys.LLM.BLOCK_COUNT))
        n_embd = self.get_int(self.k(Keys.LLM.EMBEDDING_LENGTH))
        assert n_layer is not None and n_embd is not None
        heads = self.get_per_layer(self.k(Keys.Attention.HEAD_COUNT), n_layer, required=True)
        heads_kv = self.get_per_layer(self.k(Keys.Attention.HEAD_COUNT_KV), n_layer) or heads
        n_ff = self.get_per_layer(self.k(Keys.LLM.FEED_FORWARD_LENGTH), n_layer, required=True)
        assert heads is not None and heads_kv is not None and n_ff is not None
        key_heads, key_heads_kv = self.k(Keys.Attention.HEAD_COUNT), self.k(Keys.Attention.HEAD_COUNT_KV)
        key_ff = self.k(Keys.LLM.FEED_FORWARD_LENGTH)
        if self.n_vocab is None:
            raise self.fail(Keys.Tokenizer.LIST, f"missing: a {arch} model needs a vocabulary")
        for il in range(n_layer):
            h, hkv = heads[il], heads_kv[il]
            if h < 1:
                raise self.fail(key_heads, f"layer {il} has {h} attention heads")
            if hkv < 1:
                raise self.fail(key_heads_kv, f"layer {il} has {hkv} key-value heads")
            if h % hkv:
                raise self.fail(key_heads_kv, f"layer {il}: {hkv} key-value heads do not divide {h} heads")
            if n_ff[il] < 1:
                raise self.fail(key_ff, f"layer {il} has a feed-forward length of {n_ff[il]}")
        if len(set(heads)) > 1 or len(set(heads_kv)) > 1:
            raise self.fail(
                key_heads, "per-layer head counts that vary are not supported for this architecture"
            )
        n_head, n_head_kv = heads[0], heads_kv[0]
        head_k = self.get_int(self.k(Keys.Attention.KEY_LENGTH))
        head_v = self.get_int(self.k(Keys.Attention.VALUE_LENGTH))
        if n_embd % n_head and (head_k is None or head_v is None):
            raise self.fail(key_heads, f"{n_head} heads do not divide embedding_length {n_embd}")
        head_k = n_embd // n_head if head_k is None else head_k
        head_v = n_embd // n_head if head_v is None else head_v
        if head_k < 1 or head_v < 1:
            raise self.fail(
                self.k(Keys.Attention.KEY_LENGTH), f"head sizes {head_k}, {head_v} must be positive"
            )
        if head_k != head_v:
            raise self.fail(
                self.k(Keys.Attention.VALUE_LENGTH), f"key length {head_k} and value length {head_v} differ"
            )
        n_rot = self.get_int(self.k(Keys.Rope.DIMENSION_COUNT))
        if arch in LLAMA_LIKE:
            if n_rot is not None and n_rot != head_k:
                raise self.fail(
                    self.k(Keys.Rope.DIMENSION_COUNT), f"{n_rot}, but llama needs the head size {head_k}"
                )
            if head_k % 2:
                raise self.fail(
                    self.k(Keys.Attention.HEAD_COUNT), f"head size {head_k} must be even for RoPE"
                )
            self.get_float(self.k(Keys.Attention.LAYERNORM_RMS_EPS), required=True)
            n_expert = self.get_int(self.k(Keys.LLM.EXPERT_COUNT)) or 0
            expected = self.llama_tensors(n_layer, n_embd, n_head, n_head_kv, head_k, n_ff[0], n_expert)
        else:
            self.get_float(self.k(Keys.Attention.LAYERNORM_EPS), required=True)
            if n_head_kv != n_head:
                raise self.fail(key_heads_kv, f"bert needs as many key-value heads as heads ({n_head})")
            n_types = self.get_int(Keys.Tokenizer.TOKEN_TYPE_COUNT)
            if not n_types:
                raise self.fail(Keys.Tokenizer.TOKEN_TYPE_COUNT, "missing or 0: bert needs token types")
            ctx_len = self.get_int(self.k(Keys.LLM.CONTEXT_LENGTH))
            assert ctx_len is not None
            expected = self.bert_tensors(n_layer, n_embd, head_k * n_head, n_ff[0], n_types, ctx_len)
        self.check_tensors(expected)

    def llama_tensors(
        self, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head: int, n_ff: int, n_expert: int
    ) -> dict[str, tuple[tuple[int, ...], bool]]:
        """Tensor name -> (ggml shape, required), as llama.cpp's llama graph uses them."""
        v = self.n_vocab
        assert v is not None
        q, kv = head * n_head, head * n_head_kv
        out: dict[str, tuple[tuple[int, ...], bool]] = {
            "token_embd.weight": ((n_embd, v), True),
            "output_norm.weight": ((n_embd,), True),
            "output.weight": ((n_embd, v), False),
            "rope_freqs.weight": ((head // 2,), False),
        }
        for i in range(n_layer):
            p = f"blk.{i}."
            out |= {
                p + "attn_norm.weight": ((n_embd,), True),
                p + "attn_output.weight": ((q, n_embd), True),
                p + "attn_output.bias": ((n_embd,), False),
                p + "ffn_norm.weight": ((n_embd,), True),
            }
            if p + "attn_qkv.weight" in self.tensor_map:
                out[p + "attn_qkv.weight"] = ((n_embd, q + 2 * kv), True)
                out[p + "attn_qkv.bias"] = ((q + 2 * kv,), False)
            else:
                for part, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                    out[p + part + ".weight"] = ((n_embd, size), True)
                    out[p + part + ".bias"] = ((size,), False)
            if n_expert == 0:
                out |= {
                    p + "ffn_gate.weight": ((n_embd, n_ff), True),
                    p + "ffn_up.weight": ((n_embd, n_ff), True),
                    p + "ffn_down.weight": ((n_ff, n_embd), True),
                    p + "ffn_gate.bias": ((n_ff,), False),
                    p + "ffn_up.bias": ((n_ff,), False),
                    p + "ffn_down.bias": ((n_embd,), False),
                }
            else:
                out |= {
                    p + "ffn_gate_inp.weight": ((n_embd, n_expert), True),
                    p + "ffn_gate_exps.weight": ((n_embd, n_ff, n_expert), False),
                    p + "ffn_up_exps.weight": ((n_embd, n_ff, n_expert), True),
                    p + "ffn_down_exps.weight": ((n_ff, n_embd, n_expert), True),
                }
        return out

    def bert_tensors(
        self, n_layer: int, n_embd: int, q: int, n_ff: int, n_types: int, ctx_len: int
    ) -> dict[str, tuple[tuple[int, ...], bool]]:
        v = self.n_vocab
        assert v is not None
        out: dict[str, tuple[tuple[int, ...], bool]] = {
            "token_embd.weight": ((n_embd, v), True),
            "token_types.weight": ((n_embd, n_types), False),
            "position_embd.weight": ((n_embd, ctx_len), True),
            "token_embd_norm.weight": ((n_embd,), True),
            "token_embd_norm.bias": ((n_embd,), True),
        }
        for i in range(n_layer):
            p = f"blk.{i}."
            for part in ("attn_q", "attn_k", "attn_v"):
                out[p + part + ".weight"] = ((n_embd, q), True)
                out[p + part + ".bias"] = ((q,), False)
            out |= {
                p + "attn_output.weight": ((q, n_embd), True),
                p + "attn_output.bias": ((n_embd,), False),
                p + "attn_output_norm.weight": ((n_embd,), True),
                p + "attn_output_norm.bias": ((n_embd,), True),
                p + "ffn_up.weight": ((n_embd, n_ff), True),
                p + "ffn_up.bias": ((n_ff,), False),
                p + "ffn_down.weight": ((n_ff, n_embd), True),
                p + "ffn_down.bias": ((n_embd,), False),
                p + "layer_output_norm.weight": ((n_embd,), True),
                p + "layer_output_norm.bias": ((n_embd,), True),
            }
        # -- a reranker's classification head: llama.cpp's rank pooling asserts that
        # the pooler (cls) is there when any head is; the classifier (cls.output) is optional.
        if any(name.startswith("cls.") for name in self.tensor_map):
            labels = self.kv.get(self.k("{arch}.classifier.output_labels"))
            n_cls = labels.count if labels is not None and labels.count else 1
            out |= {
                "cls.weight": ((n_embd, n_embd), True),
                "cls.bias": ((n_embd,), True),
                "cls.output.weight": ((n_embd, n_cls), False),
                "cls.output.bias": ((n_cls,), False),
            }
        return out

    def check_tensors(self, expected: dict[str, tuple[tuple[int, ...], bool]]) -> None:
        tensors = self.tensor_map
        for name, (shape, required) in expected.items():
            t = tensors.get(name)
            if t is None:
                if required:
                    raise self.fail(f"tensor {name!r}", f"missing (a {self.arch} model needs it)")
                continue
            if _strip_ones(t.dims) != _strip_ones(shape):
                raise self.fail(
                    f"tensor {name!r}", f"has shape {list(t.dims)}, the hyper-parameters imply {list(shape)}"
                )
            if len(shape) == 1 or name in ADDED_AS_IS:
                if t.type not in VECTOR_TYPES:
                    raise self.fail(
                        f"tensor {name!r}",
                        f"type {t.type.name}: llama.cpp needs F32 for norm weights, biases and token types",
                    )
            elif t.type in NON_WEIGHT_TYPES or t.type in INTERMEDIATE_TYPES:
                raise self.fail(f"tensor {name!r}", f"type {t.type.name} cannot be a weight matrix")
        unknown = [name for name in tensors if name not in expected]
        if unknown:
            raise self.fail(
                f"tensor {unknown[0]!r}",
                f"not part of a {self.arch} model with these hyper-parameters "
                f"({len(unknown)} unexpected tensor(s))",
            )


def _strip_ones(dims: tuple[int, ...]) -> tuple[int, ...]:
    """ggml pads shapes with 1s: (64,) and (64, 1) are the same tensor shape."""
    out = list(dims)
    while len(out) > 1 and out[-1] == 1:
        out.pop()
    return tuple(out)
