"""Deterministic GGUF mutants, and a subprocess harness that loads, tokenizes and runs each one.

Used by ``tests/gguf/test_fuzz_gguf.py`` and ``tests/gguf/test_gguf_check.py``.

* :class:`GGUF` (``gguf_editor.py``) is an editable GGUF (key-value pairs and tensors) with its
  own serializer, so a mutant can hold what ``gguf.GGUFWriter`` refuses to write (duplicate
  tensors, raw invalid types, offsets that overlap).
* Three bases (``gguf_bases.py``): a micro Llama written by ``llamabatch.gguf.testing`` (and the
  project's ``tiny`` preset), a micro BPE Llama, and a micro BERT written by
  ``llamabatch.gguf.convert`` from a random-weight Hugging Face directory.
* :data:`SEMANTIC` lists the mutation classes of files that parse but are wrong (vocabulary and
  hyper-parameters in ``gguf_semantic.py``, architecture and tensors in
  ``gguf_semantic_tensors.py``); :data:`BYTE` the byte-level ones (``gguf_byte_mutations.py``:
  bit flips, truncations, huge counts, lengths and offsets). :func:`generate` draws ``n``
  mutants, round-robin over the classes, each from a seeded ``random.Random``: the same
  arguments give the same files.
* :func:`run_mutants` runs them in a child process (``python gguf_mutants.py --child``), many
  per child: load the model, tokenize, detokenize, then generate a few tokens (decoders, with
  ``LLM``) or embed (encoders, with ``Embedder``). A child that dies by a signal or aborts is a
  *crash*, one that exceeds the timeout a *hang*; the harness restarts the child and goes on.
"""

from __future__ import annotations

import json
import math
import os
import random
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf_semantic_tensors  # noqa: F401  (registers the rest of SEMANTIC, after gguf_semantic's)
from gguf.constants import Keys
from gguf_bases import write_bases
from gguf_byte_mutations import BYTE
from gguf_editor import GGUF, VT, Field, Tensor
from gguf_semantic import ISSUE_CLASSES, SEMANTIC, NotApplicable, set_tokens

#: what the tests import from here (the parts' names among them)
__all__ = [
    "BYTE",
    "GGUF",
    "ISSUE_CLASSES",
    "SEMANTIC",
    "Bases",
    "Field",
    "Mutant",
    "Report",
    "Tensor",
    "generate",
    "issue_mutants",
    "run_mutants",
    "write_bases",
]

# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    index: int
    name: str  # class name
    kind: str  # "semantic" or "byte"
    base: str
    description: str
    source: bytes | Callable[[], bytes] = field(repr=False)  # the bytes, or a function making them

    @property
    def data(self) -> bytes:
        """The file's bytes (made on demand: a thousand mutants would not fit in memory)."""
        return self.source() if callable(self.source) else self.source

    @property
    def label(self) -> str:
        return f"#{self.index} {self.name} [{self.base}] {self.description}"


class Bases:
    """The base files, parsed once."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths
        self.gguf = {name: GGUF.read(path) for name, path in paths.items()}
        self.serialized = {name: g.to_bytes() for name, g in self.gguf.items()}


def _base_for(name: str, i: int) -> str:
    return ("llama", "bert", "bpe", "llama", "bert", "tiny")[i % 6]


def generate(
    bases: Bases, n: int, *, seed: int = 0, kinds: Iterable[str] = ("semantic", "byte"), start: int = 0
) -> list[Mutant]:
    """``n`` mutants, round-robin over the classes of ``kinds`` (semantic first), deterministic;
    numbered from ``start``."""
    classes: list[tuple[str, str]] = []
    if "semantic" in kinds:
        classes += [("semantic", name) for name in SEMANTIC]
    if "byte" in kinds:
        classes += [("byte", name) for name in BYTE]
    out: list[Mutant] = []
    i = start
    attempts = 0
    while len(out) < n and attempts < 10 * n + 100:
        kind, name = classes[attempts % len(classes)]
        round_ = attempts // len(classes)
        attempts += 1
        base = _base_for(name, round_)

        def make(
            kind: str = kind, name: str = name, base: str = base, key: str = f"{seed}:{name}:{round_}"
        ) -> tuple[bytes, str]:
            rng = random.Random(key)
            if kind == "semantic":
                g = bases.gguf[base].copy()
                description = SEMANTIC[name](g, rng)
                return g.to_bytes()[0], description
            base_bytes, fields = bases.serialized[base]
            return BYTE[name](base_bytes, fields, rng)

        try:
            _, description = make()
        except (NotApplicable, IndexError, ValueError, KeyError, TypeError, AttributeError, struct.error):
            continue
        out.append(Mutant(i, name, kind, base, description, lambda make=make: make()[0]))
        i += 1
    return out


def issue_mutants(bases: Bases) -> dict[str, bytes]:
    """One fixed file per crash the issue reports (llama.cpp aborts on each without validation)."""

    def edit(base: str, fn: Callable[[GGUF], None]) -> bytes:
        g = bases.gguf[base].copy()
        fn(g)
        return g.to_bytes()[0]

    def dup(g: GGUF) -> None:
        tokens = list(g.tokens)
        tokens[300] = tokens[299]
        set_tokens(g, tokens)

    def model(name: bytes) -> Callable[[GGUF], None]:
        return lambda g: g.set(Keys.Tokenizer.MODEL, VT.STRING, name)

    return {
        "duplicate_token_texts": edit("llama", dup),
        "block_count_0": edit("llama", lambda g: g.set("llama.block_count", VT.UINT32, 0)),
        "block_count_huge": edit("llama", lambda g: g.set("llama.block_count", VT.UINT32, 100_000)),
        "rms_epsilon_nan": edit(
            "llama", lambda g: g.set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, math.nan)
        ),
        "rms_epsilon_negative": edit(
            "llama", lambda g: g.set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, -1e-5)
        ),
        "bert_tokenizer_on_llama_vocab": edit("llama", model(b"bert")),
        "tokenizer_none": edit("llama", model(b"none")),
        "all_token_texts_empty": edit("llama", lambda g: set_tokens(g, [b""] * len(g.tokens))),
    }


# ---------------------------------------------------------------------------------------------
# The subprocess harness
# ---------------------------------------------------------------------------------------------

TEXTS = [
    "Hello world, this is a test of the model file.",
    "naïve café — 東京 🙂\t\n<s></s>[CLS] <|im_start|> \x00 end",
    "",
]


@dataclass
class Outcome:
    mutant: Mutant
    result: str  # "ok", "error" (a clean exception), "crash", "hang"
    stage: str = ""
    error_type: str = ""
    message: str = ""
    clean: bool = True  # for "error": a LlamaBatchError or ValueError
    seconds: float = 0.0

    def __str__(self) -> str:
        detail = f"{self.error_type}: {self.message}" if self.error_type else self.message
        return f"{self.result:5s} at {self.stage or '-':10s} {self.mutant.label[:150]} | {detail[:300]}"


@dataclass
class Report:
    outcomes: list[Outcome]
    seconds: float

    def of(self, result: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == result]

    @property
    def crashes(self) -> list[Outcome]:
        return self.of("crash")

    @property
    def hangs(self) -> list[Outcome]:
        return self.of("hang")

    @property
    def unclean(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == "error" and not o.clean]

    def summary(self) -> str:
        kinds = {k: sum(o.mutant.kind == k for o in self.outcomes) for k in ("semantic", "byte")}
        counts = {r: len(self.of(r)) for r in ("ok", "error", "crash", "hang")}
        return (
            f"{len(self.outcomes)} mutants ({kinds['semantic']} semantic, {kinds['byte']} byte) in "
            f"{self.seconds:.1f}s: {counts['ok']} ran, {counts['error']} raised "
            f"({len(self.unclean)} unclean), {counts['crash']} crashes, {counts['hang']} hangs"
        )


class _Child:
    def __init__(self, workdir: Path, validate: bool) -> None:
        self.stderr_path = workdir / f"child-stderr-{time.monotonic_ns()}.txt"
        self.stderr = self.stderr_path.open("wb")
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parent)
        # (no empty entry: it would put the current directory, maybe an unbuilt source tree, first)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        env["PYTHONFAULTHANDLER"] = "1"
        env["GGML_NO_BACKTRACE"] = "1"  # ggml would attach gdb to print a backtrace on abort
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(Path(__file__).resolve()), "--child", "1" if validate else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            start_new_session=True,
        )
        self.buffer = b""

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()

    def read_line(self, deadline: float) -> dict[str, Any] | None:
        """The next message; raises EOFError when the child is gone, TimeoutError past ``deadline``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            if b"\n" not in self.buffer:
                self._fill(fd, deadline)
                continue
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                return json.loads(line)
            except ValueError:  # not a message (the child's stdout is its stderr; be safe)
                continue

    def _fill(self, fd: int, deadline: float) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                break
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError
        self.buffer += chunk

    def stderr_tail(self) -> str:
        self.stderr.flush()
        text = self.stderr_path.read_bytes()[-20000:].decode("utf-8", "replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # what llama.cpp / the C++ runtime said, then the innermost Python frame
        said = [ln for ln in lines if any(k in ln for k in ("GGML_ASSERT", "error", "terminate", "what()"))]
        frames = [ln for ln in lines if ln.startswith("File ")]
        return " | ".join(said[-3:] + frames[:1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.close()

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self.stderr.close()
        self.stderr_path.unlink(missing_ok=True)


def run_mutants(
    mutants: list[Mutant],
    workdir: Path,
    *,
    validate: bool = True,
    timeout: float = 30.0,
    progress: Callable[[Outcome], None] | None = None,
) -> Report:
    """Run every mutant in child processes (restarted after a crash or a hang)."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    child: _Child | None = None
    try:
        for m in mutants:
            path = workdir / f"mutant-{m.index:05d}.gguf"
            path.write_bytes(m.data)
            if child is None:
                child = _Child(workdir, validate)
            start = time.monotonic()
            child.send({"path": str(path)})
            stage = ""
            outcome: Outcome | None = None
            while outcome is None:
                try:
                    msg = child.read_line(start + timeout)
                except EOFError:
                    msg = None
                except TimeoutError:
                    outcome = Outcome(m, "hang", stage, message=f"no answer within {timeout:.0f}s")
                    child.kill()
                    child = None
                    break
                if msg is None:
                    code = child.proc.wait()
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    outcome = Outcome(m, "crash", stage, message=f"{how}: {child.stderr_tail()}")
                    child.kill()
                    child = None
                    break
                if msg["event"] == "stage":
                    stage = msg["stage"]
                elif msg["event"] == "done":
                    outcome = Outcome(
                        m,
                        msg["result"],
                        msg.get("stage", stage),
                        msg.get("error_type", ""),
                        msg.get("message", ""),
                        msg.get("clean", True),
                    )
            outcome.seconds = time.monotonic() - start
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
            path.unlink(missing_ok=True)
    finally:
        if child is not None:
            child.kill()
    return Report(outcomes, time.monotonic() - t0)


# -- the child -----------------------------------------------------------------------------------


def _child_main(validate: bool) -> None:
    import faulthandler

    faulthandler.enable()
    from llamabatch import LLM, Embedder, SamplingParams
    from llamabatch._ffi import model as model_module
    from llamabatch.errors import LlamaBatchError

    original_init = model_module.Model.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["validate"] = validate  # every Model the child makes (LLM's, Embedder's too)
        original_init(self, *args, **kwargs)

    model_module.Model.__init__ = init  # type: ignore[method-assign]
    # Messages go to the original stdout; anything else printing to fd 1 lands in stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def send(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    for line in sys.stdin:
        job = json.loads(line)
        path = job["path"]
        stage = "load"
        try:
            send(event="stage", stage=stage)
            with model_module.Model(path) as model:
                stage = "tokenize"
                send(event="stage", stage=stage)
                for text in TEXTS:
                    tokens = model.tokenize(text)
                    model.tokenize(text, add_special=False, parse_special=True)
                    model.detokenize(tokens)
                    for t in tokens[:8]:
                        model.token_to_piece(t)
                        model.token_to_piece(t, special=True)
                # embedding models (BERT and the like) declare a pooling; decoders do not
                encoder = model.pooling_type != "unspecified" or model.has_encoder
                decoder = model.has_decoder and not encoder
            if decoder:
                stage = "generate"
                send(event="stage", stage=stage)
                try:
                    with LLM(path, n_ctx=128, n_parallel=2, n_batch=32, n_threads=1) as llm:
                        llm.generate(TEXTS[:2], SamplingParams(max_tokens=3, seed=1))
                        llm.generate(["x y z"], SamplingParams(max_tokens=3, temperature=0.0))
                except ValueError as exc:
                    if "decoder-only" not in str(exc):
                        raise
                    encoder = True  # a non-causal model without a declared pooling: embed it
            if encoder:
                stage = "embed"
                send(event="stage", stage=stage)
                with Embedder(path, n_batch=128, n_threads=1, truncate=True) as emb:
                    emb.embed(TEXTS)
            send(event="done", result="ok", stage=stage)
        except Exception as exc:
            send(
                event="done",
                result="error",
                stage=stage,
                error_type=type(exc).__name__,
                message=str(exc)[:500],
                clean=isinstance(exc, (LlamaBatchError, ValueError)),
            )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2] == "1")
    else:  # a report: python tests/gguf_mutants.py N [validate 0/1]
        import tempfile

        n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
        validate = sys.argv[2] != "0" if len(sys.argv) > 2 else True
        with tempfile.TemporaryDirectory() as tmp:
            bases = Bases(write_bases(Path(tmp) / "bases"))
            timeout = float(os.environ.get("FUZZ_TIMEOUT", "30"))

            def show(o: Outcome) -> None:
                if o.result != "ok":
                    print(o, flush=True)

            report = run_mutants(
                generate(bases, n), Path(tmp) / "run", validate=validate, timeout=timeout, progress=show
            )
            print(report.summary())
