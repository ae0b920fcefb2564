"""What a cross-encoder (reranker) adds to a BERT conversion, and the converter's weight types.

A ``BertForSequenceClassification`` (the layout of sentence-transformers' ``CrossEncoder``,
e.g. the ms-marco MiniLM rerankers) is a BERT encoder plus a head on the ``[CLS]`` token:
``pooler.dense`` + tanh, then ``classifier`` (one row per label). llama.cpp's rank pooling
computes exactly that from the tensors ``cls`` (the pooler) and ``cls.output`` (the
classifier); the number of labels comes from ``<arch>.classifier.output_labels``. These facts
are the GGUF format's (shared with llama.cpp's own converter); the code is this project's.

The activation sentence-transformers applies to the logits (``CrossEncoder``'s
``activation_fn``: stored in ``config.json``) is recorded under :data:`ACTIVATION_KEY`, so
:class:`llamabatch.Reranker` applies the same one by default.

Weight types (``dtype``): ``"auto"`` picks by the CPU's native arithmetic and the model's size
(see :func:`auto_dtype`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACTIVATION_KEY",
    "DTYPES",
    "HEAD_TENSORS",
    "XLMR_HEAD_TENSORS",
    "ClassifierHead",
    "auto_dtype",
    "cpu_flags",
    "head_shapes",
    "read_head",
    "resolve_dtype",
]

#: ``dtype`` values the converter takes (``auto``: :func:`resolve_dtype`).
DTYPES = ("auto", "f32", "f16", "bf16", "q8_0")

#: Encoders up to this many parameters get f32 weights from ``dtype="auto"``.
AUTO_F32_MAX_PARAMS = 350_000_000

#: The GGUF key (this project's) holding the activation sentence-transformers applies.
ACTIVATION_KEY = "llamabatch.reranker.activation_fn"

#: Hugging Face head tensors (after dropping ``bert.``) -> GGUF names (llama.cpp's ``cls``).
HEAD_TENSORS = {
    "pooler.dense.weight": "cls.weight",
    "pooler.dense.bias": "cls.bias",
    "classifier.weight": "cls.output.weight",
    "classifier.bias": "cls.output.bias",
}
#: the same for XLM-RoBERTa's head (``RobertaClassificationHead``: dense + tanh, out_proj)
XLMR_HEAD_TENSORS = {
    "classifier.dense.weight": "cls.weight",
    "classifier.dense.bias": "cls.bias",
    "classifier.out_proj.weight": "cls.output.weight",
    "classifier.out_proj.bias": "cls.output.bias",
}

# sentence-transformers' recorded activation (a torch class path) -> our name
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Softmax": "softmax", "Tanh": "tanh"}

#: CPU features that decide which weight type runs fastest (names as /proc/cpuinfo spells them).
CPU_FEATURES = ("avx2", "f16c", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class ClassifierHead:
    """A sequence-classification head: its labels (one per output) and recorded activation."""

    labels: list[str]
    activation: str | None


def read_head(
    raw_config: dict[str, Any], tensor_names: set[str], st_config: dict[str, Any] | None = None
) -> ClassifierHead | None:
    """The head of a ``*ForSequenceClassification`` checkpoint, or None for a plain encoder.

    ``tensor_names`` are the checkpoint's tensor names with any ``bert.`` prefix removed;
    ``st_config`` is sentence-transformers' ``config_sentence_transformers.json``, if any.
    Raises ``ValueError`` for a classifier without the pooler llama.cpp's rank pooling needs.
    """
    archs = [str(a) for a in raw_config.get("architectures") or []]
    names = XLMR_HEAD_TENSORS if "classifier.out_proj.weight" in tensor_names else HEAD_TENSORS
    has_classifier = "classifier.weight" in tensor_names or "classifier.out_proj.weight" in tensor_names
    if not has_classifier:
        if any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(
                f"config.json names {archs} but the weights hold no classifier.weight: "
                "the classification head is missing"
            )
        return None
    missing = [n for n in names if n not in tensor_names]
    if missing:
        raise ValueError(
            f"the classification head lacks {missing}: llama.cpp's rank pooling applies the pooler "
            "(dense + tanh) then the classifier, so both are needed"
        )
    labels = _labels(raw_config)
    return ClassifierHead(labels=labels, activation=_activation(raw_config, st_config))


def _labels(raw: dict[str, Any]) -> list[str]:
    id2label = raw.get("id2label")
    n = raw.get("num_labels")
    if isinstance(id2label, dict) and id2label:
        try:
            items = sorted((int(k), str(v)) for k, v in id2label.items())
        except ValueError:
            raise ValueError(f"config.json: id2label keys must be integers, got {list(id2label)}") from None
        if [k for k, _ in items] != list(range(len(items))):
            raise ValueError(f"config.json: id2label ids must be 0..n-1, got {[k for k, _ in items]}")
        return [v for _, v in items]
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return [f"LABEL_{i}" for i in range(n)]
    return ["LABEL_0"]


def _activation(raw: dict[str, Any], st_config: dict[str, Any] | None) -> str | None:
    """The activation sentence-transformers recorded (v6+: ``activation_fn`` in
    ``config_sentence_transformers.json``; v4-5: ``sentence_transformers.activation_fn`` in
    ``config.json``; earlier: ``sbert_ce_default_activation_function``), or None."""
    st = raw.get("sentence_transformers")
    path = st.get("activation_fn") if isinstance(st, dict) else None
    path = path or raw.get("sbert_ce_default_activation_function")
    path = path or (st_config or {}).get("activation_fn")  # config_sentence_transformers.json (>= 6)
    if not isinstance(path, str) or not path:
        return None
    name = _ACTIVATIONS.get(path.rsplit(".", 1)[-1])
    if name is None:
        raise ValueError(
            f"config.json records the activation {path!r}; supported: "
            f"{sorted('torch.nn.' + k for k in _ACTIVATIONS)}"
        )
    return name


def head_shapes(hidden_size: int, n_labels: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape of the head tensors."""
    return {
        "cls.weight": (hidden_size, hidden_size),
        "cls.bias": (hidden_size,),
        "cls.output.weight": (n_labels, hidden_size),
        "cls.output.bias": (n_labels,),
    }


def cpu_flags(path: str = "/proc/cpuinfo") -> dict[str, bool]:
    """Which of :data:`CPU_FEATURES` this CPU has (all False where /proc/cpuinfo is unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return dict.fromkeys(CPU_FEATURES, False)
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    return {name: name in flags for name in CPU_FEATURES}


def auto_dtype(n_params: int, flags: dict[str, bool] | None = None) -> str:
    """The weight type ``dtype="auto"`` gives a model of ``n_params`` parameters on the CPU with
    ``flags`` (default: this one's, :func:`cpu_flags`).

    Encoders embed packs of hundreds of tokens, so their matrix products are compute-bound:
    the arithmetic the CPU does natively decides, not the bytes per weight.

    - With AVX512-BF16 (or AMX-BF16) the CPU multiplies bf16 natively: bf16 (measured with
      all-MiniLM-L6-v2 on such an AMD EPYC: 1.45x sentence-transformers' texts/s, f16 1.07x).
    - Elsewhere f16 / bf16 weights are converted on the fly, while ggml's f32 kernels run at full
      speed on every x86 CPU: f32 (measured on an AVX2-only EPYC: f32 100 texts/s, bf16 61,
      f16 57, sentence-transformers 69) for models up to :data:`AUTO_F32_MAX_PARAMS`
      (BERT-large size, 1.4 GB in f32); f16 above, where memory starts to matter.
    """
    flags = cpu_flags() if flags is None else flags
    if flags.get("avx512_bf16") or flags.get("amx_bf16"):
        return "bf16"
    return "f32" if n_params <= AUTO_F32_MAX_PARAMS else "f16"


def resolve_dtype(dtype: str, n_params: int) -> str:
    """``dtype`` itself, or :func:`auto_dtype`'s choice for ``"auto"``; ValueError if unknown."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return auto_dtype(n_params) if dtype == "auto" else dtype
