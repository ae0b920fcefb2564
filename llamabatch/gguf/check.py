"""Check a GGUF model file before llama.cpp sees it.

llama.cpp parses GGUF headers carefully, but some files that parse yet are inconsistent make it
abort the whole process (``GGML_ASSERT``, ``std::terminate``) while loading, at the first
tokenization or at the first decode: duplicate token texts, a ``block_count`` of 0, a NaN RMS
epsilon, a WordPiece tokenizer declared over a SentencePiece vocabulary, and so on. A model file
is input from the internet, so :func:`check_gguf` reads it first and raises
:class:`~llamabatch.errors.ModelLoadError` naming the file, the key or tensor, and what is wrong.

What is checked:

* the container: magic, version, counts, string and array lengths, value and tensor types,
  tensor dimensions and data ranges all within the file (every length is bounded by the bytes
  left, so a hostile header costs nothing);
* hyper-parameters: present, integers where counts are expected, consistent with each other
  (head counts dividing the embedding length, per-layer arrays as long as ``block_count``,
  expert counts), finite and positive where llama.cpp divides by them or takes their root;
* the vocabulary: a known tokenizer model, unique and non-empty token texts, token/score/type
  arrays of equal length with valid token types and finite scores, special token ids in range,
  byte tokens where the tokenizer falls back on them, well-formed BPE merges;
* tensors (for ``llama``-like and ``bert`` files, the architectures llamabatch writes and
  serves): every tensor the architecture needs is present once with the shape the
  hyper-parameters imply and a type llama.cpp can compute with.

Other architectures get the generic checks only (container, hyper-parameters present and sane,
vocabulary, tensor bounds): llama.cpp knows their tensor layouts, llamabatch does not.

The container is read by ``gguf/reader.py``; the checks are split by subject:
``check_base.py`` (facts, typed reads), ``check_vocab.py``, ``check_tensors.py`` and, here, the
hyper-parameters.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType, Keys, PoolingType, RopeScalingType

from llamabatch.errors import ModelLoadError
from llamabatch.gguf.check_base import KNOWN_LAYOUTS, LLAMA_LIKE, MAX_EXPERTS, MAX_LAYERS
from llamabatch.gguf.check_tensors import TensorChecks
from llamabatch.gguf.check_vocab import VocabChecks
from llamabatch.gguf.reader import FLOAT_TYPES, read_header, tensor_names, type_name

__all__ = ["KNOWN_LAYOUTS", "LLAMA_LIKE", "GGUFReport", "check_gguf", "tensor_names"]


@dataclass(frozen=True)
class GGUFReport:
    """What :func:`check_gguf` read from a file that passed.

    ``n_vocab`` and ``tokenizer_model`` are None for files without a vocabulary; ``layout_checked``
    says whether the tensors were checked against the architecture (``llama`` and ``bert``),
    not only for bounds. ``notes`` lists what was accepted but looks unusual.
    """

    path: Path
    version: int
    architecture: str
    n_kv: int
    n_tensors: int
    n_vocab: int | None
    tokenizer_model: str | None
    layout_checked: bool
    notes: tuple[str, ...] = field(default=())


def check_gguf(path: str | os.PathLike[str], *, vocab_only: bool = False) -> GGUFReport:
    """Check that llama.cpp can load, tokenize with and run the GGUF at ``path``.

    ``vocab_only`` checks only what loading the vocabulary needs (the container and the
    vocabulary), as ``Model(vocab_only=True)`` loads no weights.

    Returns a :class:`GGUFReport`. Raises ``FileNotFoundError`` for a missing file and
    :class:`~llamabatch.errors.ModelLoadError` for anything wrong, naming the key or tensor.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(str(path), "not a regular file")
    header = read_header(path)
    return _Checker(path, header, vocab_only).run()


class _Checker(VocabChecks, TensorChecks):
    """Runs the checks on one header (the vocabulary's and the tensors' come from the mixins)."""

    # -- run -------------------------------------------------------------------------------

    def run(self) -> GGUFReport:
        arch = self.get_str(Keys.General.ARCHITECTURE, required=True)
        assert arch is not None
        if not arch:
            raise self.fail(Keys.General.ARCHITECTURE, "empty")
        self.arch = arch
        self.check_vocab()
        layout_checked = False
        n_splits = self.get_int(Keys.Split.LLM_KV_SPLIT_COUNT) or 1
        if not self.vocab_only:
            self.check_generic_hparams()
            if n_splits > 1:
                # a split model: this part holds some of the tensors; llama.cpp checks the set
                self.notes.append(f"{Keys.Split.LLM_KV_SPLIT_COUNT}: part of a {n_splits}-file model")
            elif arch in KNOWN_LAYOUTS:
                self.check_layout()
                layout_checked = True
        return GGUFReport(
            path=self.path,
            version=self.h.version,
            architecture=arch,
            n_kv=len(self.kv),
            n_tensors=len(self.h.tensors),
            n_vocab=self.n_vocab,
            tokenizer_model=self.tokenizer,
            layout_checked=layout_checked,
            notes=tuple(self.notes),
        )

    # -- hyper-parameters (every architecture) ----------------------------------------------

    def check_generic_hparams(self) -> None:
        ctx_len = self.get_int(self.k(Keys.LLM.CONTEXT_LENGTH), required=True)
        if ctx_len is not None and not 1 <= ctx_len < 1 << 32:
            raise self.fail(self.k(Keys.LLM.CONTEXT_LENGTH), f"{ctx_len} must be positive")
        n_embd = self.get_int(self.k(Keys.LLM.EMBEDDING_LENGTH), required=True)
        if n_embd is not None and not 1 <= n_embd < 1 << 31:
            raise self.fail(self.k(Keys.LLM.EMBEDDING_LENGTH), f"{n_embd} must be positive")
        n_layer = self.get_int(self.k(Keys.LLM.BLOCK_COUNT), required=True)
        assert n_layer is not None
        if not 1 <= n_layer <= MAX_LAYERS:
            raise self.fail(
                self.k(Keys.LLM.BLOCK_COUNT), f"{n_layer} layers: llama.cpp needs 1 to {MAX_LAYERS}"
            )
        nextn = self.get_int(self.k(Keys.LLM.NEXTN_PREDICT_LAYERS))
        if nextn is not None and not 0 <= nextn <= n_layer:
            raise self.fail(self.k(Keys.LLM.NEXTN_PREDICT_LAYERS), f"{nextn} exceeds block_count {n_layer}")

        n_vocab_key = self.get_int(self.k(Keys.LLM.VOCAB_SIZE))
        if n_vocab_key is not None and self.n_vocab is not None and n_vocab_key != self.n_vocab:
            raise self.fail(
                self.k(Keys.LLM.VOCAB_SIZE),
                f"{n_vocab_key} but {Keys.Tokenizer.LIST} holds {self.n_vocab} tokens",
            )

        self.check_experts(n_layer)
        for key in (Keys.LLM.FEED_FORWARD_LENGTH, Keys.Attention.HEAD_COUNT, Keys.Attention.HEAD_COUNT_KV):
            self.get_per_layer(self.k(key), n_layer)

        scaling = self.get_str(self.k(Keys.Rope.SCALING_TYPE))
        known = [t.value for t in RopeScalingType]
        if scaling is not None and scaling not in known:
            raise self.fail(
                self.k(Keys.Rope.SCALING_TYPE), f"unknown RoPE scaling {scaling!r} (known: {known})"
            )

        pooling = self.get_int(self.k(Keys.LLM.POOLING_TYPE))
        if pooling is not None and pooling not in {int(t) for t in PoolingType}:
            raise self.fail(
                self.k(Keys.LLM.POOLING_TYPE),
                f"unknown pooling type {pooling} (known: {[f'{int(t)}={t.name}' for t in PoolingType]})",
            )
        causal = self.kv.get(self.k(Keys.Attention.CAUSAL))
        if causal is not None and causal.type != GGUFValueType.BOOL:
            raise self.fail(self.k(Keys.Attention.CAUSAL), f"must be a bool, is {type_name(causal)}")

        self.check_floats()

    def check_experts(self, n_layer: int) -> None:
        n_expert = self.get_int(self.k(Keys.LLM.EXPERT_COUNT)) or 0
        if not 0 <= n_expert <= MAX_EXPERTS:
            raise self.fail(
                self.k(Keys.LLM.EXPERT_COUNT), f"{n_expert} experts: llama.cpp allows 0 to {MAX_EXPERTS}"
            )
        used = self.get_per_layer(self.k(Keys.LLM.EXPERT_USED_COUNT), n_layer) or [0]
        groups = self.get_int(self.k(Keys.LLM.EXPERT_GROUP_COUNT)) or 0
        group_used = self.get_int(self.k(Keys.LLM.EXPERT_GROUP_USED_COUNT)) or 0
        key_used = self.k(Keys.LLM.EXPERT_USED_COUNT)
        if max(used) > n_expert:
            raise self.fail(key_used, f"{max(used)} experts used per token, but only {n_expert} experts")
        if n_expert > 0:
            if max(used) == 0:
                raise self.fail(key_used, f"missing or 0, with {n_expert} experts")
            key_groups = self.k(Keys.LLM.EXPERT_GROUP_COUNT)
            if not 0 <= groups < n_expert:
                raise self.fail(key_groups, f"{groups} groups for {n_expert} experts")
            if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
                raise self.fail(
                    key_groups,
                    f"{groups} groups of {n_expert} experts with {group_used} used is inconsistent",
                )
        elif groups:
            raise self.fail(self.k(Keys.LLM.EXPERT_GROUP_COUNT), f"{groups} expert groups without experts")

    def check_floats(self) -> None:
        prefix = f"{self.arch}."
        for key, entry in self.kv.items():
            if not key.startswith(prefix):
                continue
            if entry.type in FLOAT_TYPES:
                if not math.isfinite(entry.value):
                    raise self.fail(key, f"{entry.value:.7g} is not a finite number")
            elif entry.type == GGUFValueType.ARRAY and entry.item_type in FLOAT_TYPES:
                if not np.isfinite(entry.value).all():
                    raise self.fail(key, "holds values that are not finite numbers")
        for template in (
            Keys.Attention.LAYERNORM_EPS,
            Keys.Attention.LAYERNORM_RMS_EPS,
            Keys.Attention.GROUPNORM_EPS,
            Keys.Rope.FREQ_BASE,
            Keys.Rope.FREQ_BASE_SWA,
        ):
            value = self.get_float(self.k(template))
            if value is not None and not value > 0:
                raise self.fail(self.k(template), f"{value:.7g} must be positive")
        for template in (Keys.Rope.SCALING_FACTOR, Keys.Rope.SCALING_ATTN_FACTOR):
            value = self.get_float(self.k(template))
            if value is not None and value < 0:
                raise self.fail(self.k(template), f"{value:.7g} must not be negative")

    # -- vocabulary --------------------------------------------------------------------------
