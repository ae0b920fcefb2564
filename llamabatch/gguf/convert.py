"""Convert BERT-family Hugging Face / sentence-transformers models to GGUF.

The output is a GGUF that llama.cpp loads as architecture ``bert``: a non-causal encoder whose
pooled output (mean, CLS or last token, as the sentence-transformers pooling config says) is the
sentence embedding; or, for a cross-encoder (``BertForSequenceClassification``, sentence-transformers'
``CrossEncoder`` layout), a reranker: rank pooling over its classification head
(:mod:`llamabatch.gguf.convert_head`). Only the facts of the format are shared with llama.cpp (key
names, tensor names, the WordPiece convention below); the code is this project's own.

WordPiece in llama.cpp: its WPM tokenizer splits text into words, prefixes each word with the
phantom space ``"\u2581"`` and then matches the longest vocabulary entries from the left. So a
word-start piece ``"play"`` is stored as ``"\u2581play"`` and a continuation piece ``"##ing"`` as
``"ing"``; special and reserved tokens (``[CLS]``, ``[unused0]``) are stored unchanged.

Public API: :func:`convert_bert`, :func:`cached_conversion`, :func:`default_cache_dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from llamabatch.gguf.convert_head import (
    ACTIVATION_KEY,
    DTYPES,
    HEAD_TENSORS,
    XLMR_HEAD_TENSORS,
    ClassifierHead,
    head_shapes,
    read_head,
    resolve_dtype,
)
from llamabatch.gguf.convert_vocab import HFVocab, read_vocab
from llamabatch.gguf.convert_xlmr import MODEL_TYPE as XLMR
from llamabatch.gguf.convert_xlmr import (
    UnigramVocab,
    position_offset,
    read_unigram_vocab,
    write_unigram_metadata,
)

__all__ = [
    "CONVERTER_VERSION",
    "BertConfig",
    "cached_conversion",
    "chosen_dtype",
    "convert_bert",
    "default_cache_dir",
]

#: Bumped whenever the bytes :func:`convert_bert` writes change; part of the cache key.
CONVERTER_VERSION = 2

_DTYPES = DTYPES

# GGUF pooling types (gguf.PoolingType / enum llama_pooling_type).
_POOLING_IDS = {"mean": 1, "cls": 2, "last": 3, "rank": 4}
# sentence-transformers Pooling config flags, and which GGUF pooling each maps to (None: unsupported).
_ST_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}
# the single-string ``pooling_mode`` spelling -> the flag it stands for
_ST_POOLING_NAMES = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "lasttoken": "pooling_mode_lasttoken",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
}
_ST_ALLOWED_MODULES = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",  # llama.cpp's consumers normalise themselves
    # sentence-transformers >= 6 names them by where they live (its CrossEncoder saves a modules.json too)
    "sentence_transformers.base.modules.transformer.Transformer",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    "sentence_transformers.base.modules.normalize.Normalize",
}
_GELU_ACTIVATIONS = {"gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"}

# Hugging Face BertModel tensor names (after dropping a "bert." prefix) -> GGUF names.
_EMBEDDING_TENSORS = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
_LAYER_TENSORS = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_LAYER_RE = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)")
# Tensors of heads sentence embeddings do not use (a cross-encoder's pooler and classifier
# are kept: HEAD_TENSORS).
_IGNORED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")
# q8_0 quantizes the matrices of the layers and the head; the lookup tables stay f16.
_Q8_PREFIXES = ("blk.", "cls.")
# Kept in float32 whatever ``dtype`` says: llama.cpp adds a row of it to the f32 activations.
_ALWAYS_F32 = {"token_types.weight"}

# safetensors dtype -> (numpy dtype of the stored bytes); BF16 is widened by hand.
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class BertConfig:
    """The hyperparameters of a BERT encoder that the GGUF needs, read from ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    base_model: str | None
    #: "bert", or "xlm-roberta" (llamabatch.gguf.convert_xlmr)
    model_type: str = "bert"
    #: rows of the checkpoint's position table before position 0 (RoBERTa: pad_token_id + 1)
    position_offset: int = 0


# --------------------------------------------------------------------------- public API


def convert_bert(
    model_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    dtype: str = "auto",
    name: str | None = None,
) -> Path:
    """Convert a BERT-family model directory to a GGUF file that llama.cpp loads as ``bert``.

    ``model_dir`` is a Hugging Face / sentence-transformers directory with ``config.json``,
    ``model.safetensors`` (or a sharded ``model.safetensors.index.json``), ``vocab.txt`` (or
    ``tokenizer.json``) and optionally ``modules.json`` + ``1_Pooling/config.json``, whose pooling
    mode (mean, CLS or last token) becomes the GGUF's ``bert.pooling_type`` (mean when absent).

    A ``BertForSequenceClassification`` checkpoint (a cross-encoder) keeps its pooler and
    classifier as llama.cpp's ``cls`` / ``cls.output`` tensors, its labels as
    ``bert.classifier.output_labels`` and ``bert.pooling_type`` rank: a reranker for
    :class:`llamabatch.Reranker`. ``model_type`` ``"xlm-roberta"`` (e.g. the bge-reranker
    shape, ``XLMRobertaForSequenceClassification``, with a Unigram ``tokenizer.json``) is
    converted too (:mod:`llamabatch.gguf.convert_xlmr`).

    ``dtype`` is ``"auto"`` (default: what runs fastest on this CPU: bf16 where it multiplies
    bf16 natively (AVX512-BF16, AMX), else f32 for encoders up to 350M parameters, whose matrix
    products are compute-bound, and f16 above; see
    :func:`llamabatch.gguf.convert_head.auto_dtype`), ``"f32"``, ``"f16"`` (2-D weights in
    float16), ``"bf16"`` (bfloat16: fast on CPUs with AVX512-BF16, within 1e-4 cosine of f32)
    or ``"q8_0"`` (the layers' matrices in 8-bit blocks, the lookup
    tables in f16: a quarter of f32's size); 1-D tensors (norms, biases) are always float32.
    ``name`` is the GGUF's ``general.name`` (default: the directory's name, or
    its parent's when the directory is called ``model``). The file is written to a temporary
    name beside ``out_path`` and renamed into place, so ``out_path`` never holds a partial file.
    Returns ``Path(out_path)``.

    Raises ``FileNotFoundError`` for a missing directory or required file and ``ValueError``
    naming what is unsupported (a non-BERT ``model_type``, max pooling, a Dense module, ...).
    """
    resolve_dtype(dtype, 0)  # a bad value fails before any file is read
    model_dir = _check_model_dir(model_dir)
    out_path = Path(out_path)

    config = _read_config(model_dir)
    head, found = _read_tensors(model_dir, config)
    pooling = "rank" if head is not None else _read_pooling(model_dir)
    vocab = (
        read_unigram_vocab(model_dir, config.vocab_size)
        if config.model_type == XLMR
        else read_vocab(model_dir, config.vocab_size)
    )
    dtype = resolve_dtype(dtype, sum(int(a.size) for a in found.values()))

    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - gguf is a declared extra
        raise ImportError("convert_bert needs the 'gguf' package: pip install 'llamabatch[models]'") from exc

    out_path.parent.mkdir(parents=True, exist_ok=True)
    # a unique sibling name (same filesystem, so the final rename is atomic); created by the
    # writer with the usual umask-governed permissions
    tmp = out_path.parent / f".{out_path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        writer = gguf.GGUFWriter(tmp, "bert")
        _write_metadata(writer, gguf, config, pooling, vocab, dtype, name or _model_name(model_dir))
        if head is not None:
            writer.add_array("bert.classifier.output_labels", head.labels)
            if head.activation is not None:
                writer.add_string(ACTIVATION_KEY, head.activation)
        for tensor_name, array in found.items():
            _add_tensor(writer, gguf, tensor_name, array, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out_path


def chosen_dtype(model_dir: str | os.PathLike[str], dtype: str = "auto") -> str:
    """The weight type :func:`convert_bert` writes for ``model_dir`` given ``dtype``
    (``"auto"`` resolved for this CPU and the checkpoint's parameter count)."""
    resolve_dtype(dtype, 0)
    return resolve_dtype(dtype, _count_params(_check_model_dir(model_dir))) if dtype == "auto" else dtype


def default_cache_dir() -> Path:
    """The directory :func:`cached_conversion` uses: ``$LLAMABATCH_CACHE_DIR`` or
    ``~/.cache/llamabatch/models``."""
    env = os.environ.get("LLAMABATCH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "llamabatch" / "models"


def cached_conversion(
    model_dir: str | os.PathLike[str],
    dtype: str = "auto",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Return a GGUF converted from ``model_dir``, converting only on a cache miss.

    The cache key hashes the content of every input file the converter reads, the ``dtype`` and
    :data:`CONVERTER_VERSION`, so a changed model or converter gives a new file. The file lives in
    ``cache_dir`` (default :func:`default_cache_dir`) and is written atomically, so concurrent
    callers (test sessions, benchmarks) at worst convert twice and never see a partial file.
    """
    resolve_dtype(dtype, 0)
    model_dir = _check_model_dir(model_dir)
    _read_config(model_dir)  # fail early, with the converter's errors, before hashing
    dtype = chosen_dtype(model_dir, dtype)
    digest = hashlib.sha256(f"llamabatch-convert-bert v{CONVERTER_VERSION} {dtype}\n".encode())
    for path in _input_files(model_dir):
        digest.update(f"{path.relative_to(model_dir).as_posix()}\n".encode())
        digest.update(_file_sha256(path).encode())
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", _model_name(model_dir)).strip("-.") or "model"
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = out / f"{slug}-{dtype}-{digest.hexdigest()[:20]}.gguf"
    if target.is_file():
        return target
    return convert_bert(model_dir, target, dtype=dtype)


# --------------------------------------------------------------------------- inputs


def _check_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {str(path)!r}")
    if not path.is_dir():
        raise NotADirectoryError(f"not a model directory: {str(path)!r}")
    return path


def _require_file(model_dir: Path, name: str, what: str) -> Path:
    path = model_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {str(path)!r}")
    return path


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from exc


def _read_config(model_dir: Path) -> BertConfig:
    raw = _load_json(_require_file(model_dir, "config.json", "model config"))
    if not isinstance(raw, dict):
        raise ValueError(f"{str(model_dir / 'config.json')!r} does not hold a JSON object")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in ("bert", XLMR):
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures {archs}): "
            "only BERT-family models (model_type 'bert' or 'xlm-roberta') can be converted"
        )
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise ValueError("unsupported BERT variant: decoder / cross-attention models cannot be converted")
    pos_type = raw.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ValueError(f"unsupported position_embedding_type {pos_type!r}: only 'absolute' is supported")
    act = raw.get("hidden_act", "gelu")
    if act not in _GELU_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}: llama.cpp's bert graph uses GELU")

    def need_int(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
        return value

    cfg = BertConfig(
        vocab_size=need_int("vocab_size"),
        hidden_size=need_int("hidden_size"),
        intermediate_size=need_int("intermediate_size"),
        num_hidden_layers=need_int("num_hidden_layers"),
        num_attention_heads=need_int("num_attention_heads"),
        max_position_embeddings=need_int("max_position_embeddings"),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        base_model=str(raw["_name_or_path"]) if raw.get("_name_or_path") else None,
        model_type=str(model_type),
        position_offset=position_offset(raw) if model_type == XLMR else 0,
    )
    if cfg.position_offset:
        if cfg.max_position_embeddings <= cfg.position_offset:
            raise ValueError(
                f"config.json: max_position_embeddings {cfg.max_position_embeddings} leaves no position "
                f"after the {cfg.position_offset} RoBERTa skips"
            )
        cfg = replace(cfg, max_position_embeddings=cfg.max_position_embeddings - cfg.position_offset)
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(
            f"config.json: hidden_size {cfg.hidden_size} is not a multiple of "
            f"num_attention_heads {cfg.num_attention_heads}"
        )
    if cfg.type_vocab_size < 1:
        raise ValueError(f"config.json: type_vocab_size must be >= 1, got {cfg.type_vocab_size}")
    return cfg


def _st_modules(model_dir: Path) -> list[dict[str, Any]]:
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    modules = _load_json(path)
    if not isinstance(modules, list):
        raise ValueError(f"{str(path)!r} does not hold a JSON list")
    return [m for m in modules if isinstance(m, dict)]


def _pooling_config_path(model_dir: Path) -> Path | None:
    modules = _st_modules(model_dir)
    for module in modules:
        mtype = module.get("type", "")
        if mtype not in _ST_ALLOWED_MODULES:
            raise ValueError(
                f"unsupported sentence-transformers module {mtype!r} in modules.json: "
                "only Transformer, Pooling and Normalize can be expressed in a llama.cpp bert GGUF"
            )
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            path = model_dir / str(module.get("path", "")) / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"pooling config named by modules.json not found: {str(path)!r}")
            return path
    fallback = model_dir / "1_Pooling" / "config.json"
    return fallback if fallback.is_file() else None


def _read_pooling(model_dir: Path) -> str:
    """The pooling name (mean, cls, last) from the sentence-transformers Pooling config."""
    path = _pooling_config_path(model_dir)
    if path is None:
        return "mean"
    raw = _load_json(path)
    if isinstance(raw.get("pooling_mode"), str):  # the single-string spelling
        mode_name = raw["pooling_mode"]
        if mode_name not in _ST_POOLING_NAMES:
            raise ValueError(f"unsupported pooling mode {mode_name!r} in {str(path)!r}")
        flags = {_ST_POOLING_NAMES[mode_name]: True}
    else:
        flags = {k: v for k, v in raw.items() if k.startswith("pooling_mode_")}
    chosen = [k for k, v in flags.items() if v]
    if not chosen:
        return "mean"
    if len(chosen) > 1:
        raise ValueError(f"unsupported pooling in {str(path)!r}: several modes at once {chosen}")
    mode = chosen[0]
    if mode not in _ST_POOLING_FLAGS:
        raise ValueError(f"unsupported pooling mode {mode!r} in {str(path)!r}")
    pooling = _ST_POOLING_FLAGS[mode]
    if pooling is None:
        raise ValueError(
            f"unsupported pooling mode {mode!r} in {str(path)!r}: llama.cpp pools by mean, cls or last token"
        )
    return pooling


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _load_json(index).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"weight shard named by {index.name} not found: {str(f)!r}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    hint = " (pytorch_model.bin is not supported; save the model as safetensors)"
    has_bin = (model_dir / "pytorch_model.bin").is_file()
    raise FileNotFoundError(f"model weights not found: {str(single)!r}{hint if has_bin else ''}")


def _input_files(model_dir: Path) -> list[Path]:
    """Every file the converter reads for ``model_dir`` (the cache key hashes these)."""
    names = [
        "config.json",
        "modules.json",
        "vocab.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors.index.json",
        "config_sentence_transformers.json",
    ]
    files = [model_dir / n for n in names if (model_dir / n).is_file()]
    pooling = _pooling_config_path(model_dir)
    if pooling is not None:
        files.append(pooling)
    files.extend(_weight_files(model_dir))
    return files


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- tensors


def _iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` from a safetensors file (memory-mapped, float32 for BF16)."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len <= 0 or header_len > 100_000_000:
            raise ValueError(f"{str(path)!r} is not a safetensors file")
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        st_dtype = info["dtype"]
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if st_dtype not in _SAFETENSORS_DTYPES:
            if name.endswith("position_ids"):
                continue  # an integer buffer some checkpoints carry; not a weight
            raise ValueError(f"{str(path)!r}: tensor {name!r} has unsupported dtype {st_dtype}")
        array = data[start:end].view(_SAFETENSORS_DTYPES[st_dtype]).reshape(shape)
        if st_dtype == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        yield name, array


def _gguf_name(name: str, head: ClassifierHead | None) -> str | None:
    """The GGUF tensor name for a Hugging Face BERT tensor name (``bert.`` prefix dropped),
    None for an unused head."""
    if head is not None and name in HEAD_TENSORS:
        return HEAD_TENSORS[name]
    if head is not None and name in XLMR_HEAD_TENSORS:
        return XLMR_HEAD_TENSORS[name]
    if name.startswith(_IGNORED_PREFIXES):
        return None
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    if name in _EMBEDDING_TENSORS:
        return _EMBEDDING_TENSORS[name]
    m = _LAYER_RE.fullmatch(name)
    if m:
        layer, module, kind = m.groups()
        kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)
        if module in _LAYER_TENSORS:
            return f"blk.{int(layer)}.{_LAYER_TENSORS[module]}.{kind}"
    raise ValueError(f"unsupported tensor {name!r}: not part of a plain BERT encoder")


def _expected_shapes(cfg: BertConfig, head: ClassifierHead | None) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy (row-major) shape, for every tensor the GGUF must hold."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.vocab_size, d),
        "token_types.weight": (cfg.type_vocab_size, d),
        "position_embd.weight": (cfg.max_position_embeddings, d),
        "token_embd_norm.weight": (d,),
        "token_embd_norm.bias": (d,),
    }
    for i in range(cfg.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            shapes[f"blk.{i}.{part}.weight"] = (d, d)
            shapes[f"blk.{i}.{part}.bias"] = (d,)
        shapes[f"blk.{i}.ffn_up.weight"] = (ff, d)
        shapes[f"blk.{i}.ffn_up.bias"] = (ff,)
        shapes[f"blk.{i}.ffn_down.weight"] = (d, ff)
        shapes[f"blk.{i}.ffn_down.bias"] = (d,)
        for norm in ("attn_output_norm", "layer_output_norm"):
            shapes[f"blk.{i}.{norm}.weight"] = (d,)
            shapes[f"blk.{i}.{norm}.bias"] = (d,)
    if head is not None:
        shapes.update(head_shapes(d, len(head.labels)))
    return shapes


def _read_tensors(model_dir: Path, cfg: BertConfig) -> tuple[ClassifierHead | None, dict[str, np.ndarray]]:
    """The classification head (None for a plain encoder) and every GGUF tensor, by GGUF name
    in a conventional order (embeddings, layer by layer, head), as read (memory-mapped)."""
    arrays: dict[str, np.ndarray] = {}
    for path in _weight_files(model_dir):
        for hf_name, array in _iter_safetensors(path):
            name = hf_name.removeprefix("bert.").removeprefix("roberta.")
            if name == "embeddings.position_embeddings.weight" and cfg.position_offset:
                array = array[cfg.position_offset :]  # RoBERTa's positions start after the padding id
            if name in arrays:
                raise ValueError(f"tensor {hf_name!r} appears twice")
            arrays[name] = array
    raw = _load_json(model_dir / "config.json")
    st_path = model_dir / "config_sentence_transformers.json"
    st_config = _load_json(st_path) if st_path.is_file() else None
    head = read_head(raw, set(arrays), st_config if isinstance(st_config, dict) else None)
    expected = _expected_shapes(cfg, head)
    found: dict[str, np.ndarray] = {}
    for hf_name, array in arrays.items():
        gguf_name = _gguf_name(hf_name, head)
        if gguf_name is None:
            continue
        if gguf_name not in expected:
            raise ValueError(f"unsupported tensor {hf_name!r}: layer index beyond num_hidden_layers")
        if gguf_name in found:
            raise ValueError(f"tensor {hf_name!r} appears twice")
        shape = expected[gguf_name]
        if tuple(array.shape) != shape:
            raise ValueError(
                f"tensor {hf_name!r} has shape {tuple(array.shape)}, config.json implies {shape}"
            )
        found[gguf_name] = array
    missing = [n for n in expected if n not in found]
    if missing:
        raise ValueError(f"model weights lack {len(missing)} BERT tensors, e.g. {missing[:3]}")
    return head, {name: found[name] for name in expected}


def _count_params(model_dir: Path) -> int:
    """The parameters of the checkpoint (from the safetensors headers only)."""
    total = 0
    for path in _weight_files(model_dir):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or header_len > 100_000_000:
                raise ValueError(f"{str(path)!r} is not a safetensors file")
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__" and info.get("dtype") in _SAFETENSORS_DTYPES:
                total += int(np.prod(info["shape"], dtype=np.int64))
    return total


def _add_tensor(writer: Any, gguf: Any, name: str, array: np.ndarray, dtype: str) -> None:
    """Write one tensor in ``dtype`` (1-D tensors and ``token_types`` stay float32)."""
    if array.ndim != 2 or name in _ALWAYS_F32 or dtype == "f32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return
    if dtype == "q8_0" and name.startswith(_Q8_PREFIXES) and array.shape[1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
    elif dtype == "bf16":
        qtype = gguf.GGMLQuantizationType.BF16
    else:  # f16, and q8_0's lookup tables
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
        return
    data = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)


# --------------------------------------------------------------------------- metadata


def _model_name(model_dir: Path) -> str:
    """A display name: the directory's name, or its parent's when the directory is just "model"."""
    resolved = model_dir.resolve()
    if resolved.name.lower() in {"model", "models"} and resolved.parent.name:
        return resolved.parent.name
    return resolved.name or "model"


def _write_metadata(
    writer: Any,
    gguf: Any,
    cfg: BertConfig,
    pooling: str,
    vocab: HFVocab | UnigramVocab,
    dtype: str,
    name: str,
) -> None:
    writer.add_name(name)
    if cfg.base_model:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, cfg.base_model)
    file_type = {
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    writer.add_file_type(int(file_type.get(dtype, gguf.LlamaFileType.ALL_F32)))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(_POOLING_IDS[pooling]))

    if isinstance(vocab, UnigramVocab):
        write_unigram_metadata(writer, vocab, cfg.type_vocab_size)
        return
    writer.add_tokenizer_model("bert")
    writer.add_token_list(vocab.pieces)
    writer.add_token_types(vocab.types)
    writer.add_token_type_count(cfg.type_vocab_size)
    # llama.cpp's WPM convention: BOS is [CLS]; [SEP] closes the sequence via add_sep
    writer.add_bos_token_id(vocab.cls_id)
    writer.add_sep_token_id(vocab.sep_id)
    writer.add_unk_token_id(vocab.unk_id)
    if vocab.pad_id is not None:
        writer.add_pad_token_id(vocab.pad_id)
    if vocab.mask_id is not None:
        writer.add_mask_token_id(vocab.mask_id)
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)
