"""Random-weight Llama GGUF test models, and English text to feed them. ``gguf/testing.py``
(``llamabatch.testing``) gathers these and the other test models.

The project makes its own GGUF files with the ``gguf`` package: a random-weight model costs the
compute of a trained one of the same shape, all that scheduler, hostile-file and speed tests need.

* :class:`ModelSpec` describes a model (shape, weight dtype, seed, name); :data:`PRESETS` holds the
  shapes the project uses (``"tiny"`` for unit tests, ``"small"`` for integration tests,
  ``"135m"``, the SmolLM-135M shape, for benchmarks).
* :func:`write_llama_gguf` writes one to a path; :func:`model_path` returns a cached file, building
  it on first use (atomic, and safe against concurrent builders).
* :func:`english_sentences` returns deterministic real English sentences.

The vocabulary is SentencePiece-style (``tokenizer.ggml.model = "llama"``) with fixed ids::

    0 <unk>   1 <s> (BOS)   2 </s> (EOS)   3..258 <0x00>..<0xFF> (byte fallback)
    259 <|im_start|>   260 <|im_end|> (end of turn, an end-of-generation token)
    261.. normal pieces ("▁the", "▁of", "ing", single characters, ...)

Byte fallback makes every string, in any script, tokenizable and exactly recoverable. The chat
template is ChatML. The output rows of the special and byte tokens are scaled down, so greedy
decoding produces normal pieces (valid UTF-8 text) and in practice never emits an
end-of-generation token on its own: tests that need one should bias or force it.

The pieces are generated from a hard-coded word list and fixed rules, so the vocabulary does not
depend on the Python version or the machine; the weights come from the PCG64 bit stream (whose
output numpy keeps stable) through exact float32 arithmetic, so they are the same everywhere.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib
import inspect
import json
import os
import re
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from llamabatch.gguf.testing_vocab import (
    BOS_ID,
    BYTE_TOKEN_OFFSET,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    N_SPECIAL_TOKENS,
    UNK_ID,
    add_test_vocab,
    build_vocab,
)

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

__all__ = [
    "BOS_ID",
    "BYTE_TOKEN_OFFSET",
    "CHATML_TEMPLATE",
    "EOS_ID",
    "FIM_IDS",
    "FORMAT_VERSION",
    "IM_END_ID",
    "IM_START_ID",
    "N_SPECIAL_TOKENS",
    "PRESETS",
    "UNK_ID",
    "ModelSpec",
    "build_vocab",
    "built_once",
    "cache_dir",
    "english_sentences",
    "model_path",
    "spec_hash",
    "write_llama_gguf",
]

#: Bump whenever the generator's output changes (weights, vocabulary, metadata): cached files
#: carry it in their name, so a changed generator never reuses a stale file.
FORMAT_VERSION = 1


#: ChatML, as a Jinja template (llama.cpp recognises it by ``<|im_start|>``).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WeightDType = Literal["F32", "F16", "Q8_0"]

_ROPE_FREQ_BASE = 10000.0
_RMS_EPS = 1e-5
#: ``write_llama_gguf(fim=True)``'s fill-in-the-middle tokens: byte tokens 0xF8..0xFC, which no
#: UTF-8 text tokenizes to
FIM_IDS = {name: BYTE_TOKEN_OFFSET + 0xF8 + i for i, name in enumerate(("pre", "suf", "mid", "rep", "sep"))}
#: Target standard deviation of the output logits (greedy tokens well separated, not saturated).
_LOGIT_STD = 4.0
#: Scale of the output rows of special and byte tokens (see _damp_special_rows).
_SPECIAL_ROW_SCALE = 0.1

# ---------------------------------------------------------------------------------------------
# Model specification
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """The shape and contents of a random-weight Llama model.

    ``dtype`` is the type of the 2-D weight matrices (1-D norm weights are always F32).
    ``seed`` selects the weights; ``name`` becomes ``general.name`` and the cached file's stem.
    """

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 4096
    dtype: WeightDType = "F32"
    seed: int = 0
    name: str = "llamabatch-random"

    def __post_init__(self) -> None:
        if self.dtype not in ("F32", "F16", "Q8_0"):
            raise ValueError(f"dtype must be 'F32', 'F16' or 'Q8_0', not {self.dtype!r}")
        for field in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_ctx_train"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive")
        if self.n_vocab < N_SPECIAL_TOKENS + 1:
            raise ValueError(f"n_vocab must be > {N_SPECIAL_TOKENS} (special and byte tokens)")
        if self.n_embd % self.n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("the head dimension (n_embd / n_head) must be even for RoPE")
        if self.dtype == "Q8_0" and (self.n_embd % 32 or self.n_ff % 32):
            raise ValueError("Q8_0 needs n_embd and n_ff to be multiples of 32")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise ValueError("name may only contain letters, digits, '.', '_' and '-'")
        if not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head (also the RoPE dimension count)."""
        return self.n_embd // self.n_head

    @property
    def n_params(self) -> int:
        """Number of weights in the model (all tensors)."""
        d, kv = self.n_embd, self.head_dim * self.n_head_kv
        per_layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * self.n_ff
        return 2 * self.n_vocab * d + d + self.n_layer * per_layer


#: Named model shapes used across the project.
PRESETS: dict[str, ModelSpec] = {
    # Unit tests: builds and loads in milliseconds.
    "tiny": ModelSpec(
        n_vocab=1024,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        n_ff=128,
        n_ctx_train=4096,
        dtype="F32",
        seed=0,
        name="llamabatch-tiny",
    ),
    # Integration tests: big enough for real tokenization and a visible batching speed-up.
    "small": ModelSpec(
        n_vocab=4096,
        n_embd=256,
        n_layer=4,
        n_head=8,
        n_head_kv=4,
        n_ff=512,
        n_ctx_train=4096,
        dtype="F16",
        seed=0,
        name="llamabatch-small",
    ),
    # Benchmarks: the SmolLM-135M shape.
    "135m": ModelSpec(
        n_vocab=32000,
        n_embd=576,
        n_layer=30,
        n_head=9,
        n_head_kv=3,
        n_ff=1536,
        n_ctx_train=8192,
        dtype="Q8_0",
        seed=0,
        name="llamabatch-135m",
    ),
}


def spec_hash(spec: Any) -> str:
    """A short hex digest of ``spec`` (a model spec dataclass: :class:`ModelSpec`, or
    ``testing_swa.SWASpec``) and :data:`FORMAT_VERSION` (changes when either does)."""
    payload = json.dumps(
        {"format_version": FORMAT_VERSION, **dataclasses.asdict(spec)}, sort_keys=True
    ).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def _uniform(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Deterministic float32 values, uniform with standard deviation ``std``, for one tensor.

    Uses the raw PCG64 stream (stable across numpy versions) and exact float32 arithmetic, so the
    values are the same on every machine.
    """
    n = int(np.prod(shape))
    bitgen = np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))
    raw = bitgen.random_raw((n + 1) // 2).astype("<u8", copy=False).view("<u4")[:n]
    out = (raw >> np.uint32(8)).astype(np.float32)  # 24 random bits, exact in float32
    half_width = np.float32(std * 3.0**0.5)
    out *= np.float32(2.0**-23) * half_width
    out -= half_width
    return out.reshape(shape)


def _ggml_type(dtype: WeightDType) -> GGMLQuantizationType:
    from gguf import GGMLQuantizationType as Q

    return {"F32": Q.F32, "F16": Q.F16, "Q8_0": Q.Q8_0}[dtype]


def _tensor_plan(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], float | None]]:
    """``(name, numpy shape (rows, cols), std)`` for every tensor; ``std is None``: all ones."""
    d, ff, kv = spec.n_embd, spec.n_ff, spec.head_dim * spec.n_head_kv
    in_d, in_ff = d**-0.5, ff**-0.5
    plan: list[tuple[str, tuple[int, ...], float | None]] = [
        ("token_embd.weight", (spec.n_vocab, d), 1.0),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (d,), None),
            (p + "attn_q.weight", (d, d), in_d),
            (p + "attn_k.weight", (kv, d), in_d),
            (p + "attn_v.weight", (kv, d), in_d),
            (p + "attn_output.weight", (d, d), in_d),
            (p + "ffn_norm.weight", (d,), None),
            (p + "ffn_gate.weight", (ff, d), in_d),
            (p + "ffn_up.weight", (ff, d), in_d),
            (p + "ffn_down.weight", (d, ff), in_ff),
        ]
    # The final RMS norm makes the hidden state's RMS exactly 1, so the logits' standard
    # deviation is std(output) * sqrt(n_embd) = _LOGIT_STD.
    plan += [
        ("output_norm.weight", (d,), None),
        ("output.weight", (spec.n_vocab, d), _LOGIT_STD * in_d),
    ]
    return plan


def _damp_special_rows(values: np.ndarray) -> np.ndarray:
    """Scale down the output rows of special and byte tokens (ids below N_SPECIAL_TOKENS).

    Their logits then have a standard deviation of ``_LOGIT_STD * _SPECIAL_ROW_SCALE``, so greedy
    decoding yields normal pieces (valid text) and practically never stops on an end-of-generation
    token by itself; sampling at temperature 1 still picks them, rarely.
    """
    values[:N_SPECIAL_TOKENS] *= np.float32(_SPECIAL_ROW_SCALE)
    return values


def _encode(values: np.ndarray, dtype: WeightDType) -> np.ndarray:
    from gguf.quants import quantize

    return quantize(values, _ggml_type(dtype))


def _nbytes(shape: tuple[int, ...], dtype: WeightDType) -> int:
    n = int(np.prod(shape))
    if dtype == "F32":
        return 4 * n
    if dtype == "F16":
        return 2 * n
    return n // 32 * 34  # Q8_0: 32 int8 values and one f16 scale per block


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

_FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0


def write_llama_gguf(
    path: str | os.PathLike[str],
    spec: ModelSpec,
    *,
    chat_template: str | None = CHATML_TEMPLATE,
    rope_sections: tuple[int, int, int, int] | None = None,
    fim: bool = False,
) -> Path:
    """Write a random-weight Llama GGUF for ``spec`` to ``path`` and return the path.

    The file appears atomically (written next to ``path``, then renamed). Tensors are generated
    and written one at a time, so peak memory is about one tensor, not the whole model.
    ``chat_template`` becomes ``tokenizer.chat_template`` (ChatML by default; None: no template).
    ``rope_sections`` (rotation pairs per M-RoPE section: temporal, height, width, unused)
    makes it a Qwen2-VL text model (architecture ``qwen2vl``, same tensors as Llama's).
    ``fim``: fill-in-the-middle tokens (:data:`FIM_IDS`: byte tokens no UTF-8 text holds), as a
    code model has them for ``/infill``.
    """
    import gguf

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    plan = _tensor_plan(spec)

    if rope_sections is not None and (
        len(rope_sections) != 4 or min(rope_sections) < 0 or sum(rope_sections) * 2 > spec.head_dim
    ):
        raise ValueError(
            f"rope_sections must be 4 counts summing to at most head_dim / 2 = {spec.head_dim // 2}"
        )
    writer = gguf.GGUFWriter(str(tmp), arch="llama" if rope_sections is None else "qwen2vl")
    try:
        writer.add_name(spec.name)
        writer.add_file_type(_FILE_TYPES[spec.dtype])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_vocab_size(spec.n_vocab)
        writer.add_context_length(spec.n_ctx_train)
        writer.add_embedding_length(spec.n_embd)
        writer.add_block_count(spec.n_layer)
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
        writer.add_layer_norm_rms_eps(_RMS_EPS)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(_ROPE_FREQ_BASE)
        if rope_sections is not None:
            writer.add_rope_dimension_sections(list(rope_sections))

        add_test_vocab(writer, spec.n_vocab)
        if fim:
            for key, token in FIM_IDS.items():
                writer.add_uint32(getattr(gguf.Keys.Tokenizer, f"FIM_{key.upper()}_ID"), token)
        writer.add_add_space_prefix(True)
        if chat_template is not None:
            writer.add_chat_template(chat_template)

        for name, shape, _std in plan:
            dtype: WeightDType = "F32" if len(shape) == 1 else spec.dtype
            writer.add_tensor_info(
                name, shape, np.dtype(np.float32), _nbytes(shape, dtype), raw_dtype=_ggml_type(dtype)
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, std in plan:
            if std is None:
                writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            else:
                values = _uniform(spec.seed, name, shape, std)
                if name == "output.weight":
                    values = _damp_special_rows(values)
                writer.write_tensor_data(_encode(values, spec.dtype))
        writer.flush()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def cache_dir() -> Path:
    """Where :func:`model_path` keeps models: ``$LLAMABATCH_CACHE_DIR`` or ``~/.cache/llamabatch/models``."""
    env = os.environ.get("LLAMABATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "llamabatch" / "models"


def model_path(preset: str | ModelSpec = "tiny", cache: str | os.PathLike[str] | None = None) -> Path:
    """The path of the GGUF file for ``preset`` (a :data:`PRESETS` name or a :class:`ModelSpec`).

    Built on first use (:func:`built_once`) and reused; its name carries :func:`spec_hash`, so a
    different spec or generator version gets another file. ``cache`` overrides :func:`cache_dir`."""
    if isinstance(preset, str):
        try:
            spec = PRESETS[preset]
        except KeyError:
            raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}") from None
    else:
        spec = preset
    directory = Path(cache) if cache is not None else cache_dir()
    path = directory / f"{spec.name}-{spec_hash(spec)}.gguf"
    return built_once(path, lambda tmp: write_llama_gguf(tmp, spec))


def built_once(path: Path, build: Callable[[Path], object]) -> Path:
    """``path``, built once by ``build(tmp)`` and renamed into place; concurrent callers wait."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.stem}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.build")
            try:
                build(tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# English sentences
# ---------------------------------------------------------------------------------------------

# Standard-library modules whose docstrings supply the sentences, in a fixed order.
_SENTENCE_MODULES = """
abc argparse ast asyncio.base_events asyncio.events asyncio.futures asyncio.locks asyncio.queues
asyncio.streams asyncio.tasks base64 bdb bisect builtins bz2 calendar cmd code codecs collections
collections.abc concurrent.futures colorsys configparser contextlib copy copyreg csv dataclasses
datetime decimal difflib dis doctest email.message email.parser email.utils enum filecmp fileinput
fnmatch fractions ftplib functools gc getopt gettext glob gzip hashlib heapq hmac html
html.parser http.client http.cookiejar http.cookies http.server imaplib inspect io ipaddress
itertools json json.decoder json.encoder keyword linecache locale logging logging.handlers lzma
mailbox math mimetypes multiprocessing.managers multiprocessing.pool netrc numbers operator
optparse os pathlib pdb pickle pickletools pkgutil platform plistlib poplib posixpath pprint
profile pstats pydoc queue quopri random re reprlib sched secrets selectors shelve
shlex shutil signal smtplib socket socketserver sqlite3 ssl stat statistics string struct
subprocess symtable sys sysconfig tabnanny tarfile tempfile textwrap threading timeit token
tokenize trace traceback tracemalloc types unittest.case unittest.loader unittest.mock
unittest.result urllib.parse urllib.request uuid warnings wave weakref xml.dom.minidom
xml.etree.ElementTree xml.sax zipfile zipimport zlib
""".split()

_PLAIN_SENTENCE = re.compile(r"[A-Z][A-Za-z0-9 ,;'()-]*[a-z][.!?]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _docstrings(module_name: str) -> Iterator[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    yield module.__doc__ or ""
    for _name, obj in sorted(vars(module).items()):
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__ and module_name != "builtins":
            continue
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str):
            yield doc
        if inspect.isclass(obj):
            for _, member in sorted(vars(obj).items()):
                if isinstance(member, (property, classmethod, staticmethod)) or inspect.isroutine(member):
                    doc = getattr(member, "__doc__", None)
                    if isinstance(doc, str):
                        yield doc


def _sentences_of(doc: str) -> Iterator[str]:
    for paragraph in re.split(r"\n\s*\n", doc):
        lines = [line.strip() for line in paragraph.splitlines()]
        if any(line.startswith((">>>", "...")) for line in lines):
            continue  # doctest examples
        text = " ".join(line for line in lines if line)
        for sentence in _SENTENCE_END.split(text):
            sentence = sentence.strip()
            if (
                _PLAIN_SENTENCE.fullmatch(sentence)
                and 5 <= len(sentence.split()) <= 60
                and sentence.count("(") == sentence.count(")")
            ):
                yield sentence


@lru_cache(maxsize=1)
def _all_sentences() -> tuple[str, ...]:
    found: dict[str, None] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in _SENTENCE_MODULES:
            for doc in _docstrings(module_name):
                for sentence in _sentences_of(doc):
                    found.setdefault(sentence, None)
    return tuple(found)


def english_sentences(n: int) -> list[str]:
    """``n`` real English sentences (5-60 words each), deterministic for a given Python version.

    They are the plain sentences of the docstrings of a fixed list of standard-library modules,
    deduplicated, in a stable order (thousands are available; if ``n`` is larger, they repeat).
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    pool = _all_sentences()
    if not pool:  # pragma: no cover - every CPython has docstrings unless run with -OO
        raise RuntimeError("no docstrings available (is Python running with -OO?)")
    return [pool[i % len(pool)] for i in range(n)]
