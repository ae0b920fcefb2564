"""ARCHITECTURE.md matches the code: every file or folder it names exists, its layer table
lists every subpackage of ``llamabatch`` and places every module, and the imports keep it.

The import scan reads each module with ``ast`` (``.pyx``/``.pxd`` files line by line) and
counts every import of a ``llamabatch`` module:

- module-level and function-level imports alike (a deferred import defers the work, not the
  dependency);
- imports under ``if TYPE_CHECKING:`` too: a lower layer that names a higher layer's type in
  its signatures depends on it all the same (its reader must know it, and moving one drags
  the other), and a cycle through annotations is still a cycle.

``from package import name`` is an edge to ``package.name`` when that is a module, else to
the package; importing ``a.b.c`` is not counted as importing ``a`` or ``a.b``.

The rules: a module imports only from its own layer and the layers below it (the table is
bottom to top); the modules import one another without a cycle; no module reads another
module's private (``_underscore``) names.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llamabatch"
DOC = ROOT / "ARCHITECTURE.md"

#: a backticked path: a file with a known suffix, or a folder (ending in "/")
_PATH = re.compile(r"`([A-Za-z0-9_./-]+(?:\.(?:py|pyx|pxd|pyi|h|md|toml|txt)|/))`")


def named_paths(text: str) -> list[str]:
    """The paths ARCHITECTURE.md names (in backticks): relative to the repository root when
    they start with a top-level folder, else to the ``llamabatch`` package."""
    return sorted(set(_PATH.findall(text)))


def resolve(name: str) -> Path | None:
    for base in (ROOT, PACKAGE):
        path = base / name
        if path.exists():
            return path
    return None


def test_every_named_path_exists() -> None:
    names = named_paths(DOC.read_text(encoding="utf-8"))
    assert len(names) > 40, "ARCHITECTURE.md should name the files of a request's path"
    missing = [name for name in names if resolve(name) is None]
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def layer_table(text: str) -> str:
    return text.split("## Layers", 1)[1].split("\n## ", 1)[0]


def test_layer_table_covers_every_subpackage() -> None:
    table = layer_table(DOC.read_text(encoding="utf-8"))
    folders = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name != "_vendor"
    )
    absent = [name for name in folders if f"`{name}/`" not in table and f"`llamabatch/{name}/`" not in table]
    assert not absent, f"the layer table of ARCHITECTURE.md does not list: {absent}"


def test_the_path_finder_sees_missing_files() -> None:
    # the check above must be able to fail
    assert named_paths("see `nowhere/at_all.py` and `_core/`") == ["_core/", "nowhere/at_all.py"]
    assert resolve("nowhere/at_all.py") is None
    assert resolve("_core/slots.pyx") is not None


# -- the layer map ------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """A row of the layer table: its name and the module names its folder column places
    (``llamabatch.generate`` places the folder's modules, ``llamabatch.config`` one)."""

    name: str
    modules: tuple[str, ...]


def _entry_module(entry: str) -> str:
    """The module name of a folder-column entry: ``generate/`` -> ``llamabatch.generate``,
    ``prompts/chat_template.py`` -> ``llamabatch.prompts.chat_template``, ``vendor/`` ->
    ``llamabatch._vendor`` (setup.py installs it under that name)."""
    if entry == "vendor/":
        return "llamabatch._vendor"
    parts = entry.rstrip("/").removesuffix(".py").split("/")
    if parts == ["__init__"]:
        return "llamabatch"
    return ".".join(["llamabatch", *parts])


def parse_layers(text: str) -> list[Layer]:
    """The layer table's rows, bottom to top: ``| layer | folder | owns |``."""
    layers = []
    for line in layer_table(text).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-", " "}:
            continue
        entries = re.findall(r"`([^`]+)`", cells[1])
        layers.append(Layer(cells[0], tuple(_entry_module(e) for e in entries)))
    return layers


def layer_index(module: str, layers: list[Layer]) -> int | None:
    """The row placing ``module``: the longest entry that is the module or a package above it."""
    best: tuple[int, int] | None = None
    for index, layer in enumerate(layers):
        for entry in layer.modules:
            if module == entry or (entry != "llamabatch" and module.startswith(entry + ".")):
                depth = entry.count(".")
                if best is None or depth > best[1]:
                    best = (index, depth)
    return best[0] if best else None


# -- the import scan ------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target`` at ``line`` (under ``TYPE_CHECKING`` when ``type_only``)."""

    source: str
    target: str
    line: int
    type_only: bool = False


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files(package: Path = PACKAGE) -> dict[str, list[Path]]:
    """Each module of ``package`` and the files that hold its source (``.py``; a Cython
    module's ``.pyx`` and ``.pxd``; a compiled module known only by its ``.pyi`` stub has no
    imports to scan but can be imported)."""
    root = package.parent
    out: dict[str, list[Path]] = {}
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxd", ".pyi") and "__pycache__" not in path.parts:
            out.setdefault(_module_name(path, root), []).append(path)
    return out


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    known = set(modules)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def parse(source: str) -> ast.Module:
    """``ast.parse``, again after CPython 3.11's "AST constructor recursion depth mismatch"
    (a ``SystemError``: its AST state is shared by the interpreter's threads, and a thread an
    earlier test left running may be parsing too; fixed in later CPython releases)."""
    for _ in range(2):
        try:
            return ast.parse(source)
        except SystemError:
            continue
    return ast.parse(source)


def python_imports(module: str, source: str, modules: Iterable[str], is_package: bool) -> list[Import]:
    """The ``llamabatch`` imports of a Python module's ``source``, wherever they sit."""
    known = set(modules)
    tree = parse(source)
    type_only = _type_checking_nodes(tree)
    here = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            target = _resolve(name, known) if name.split(".")[0] == "llamabatch" else None
            if target is not None and target != module:
                out.append(Import(module, target, node.lineno, id(node) in type_only))
    return out


_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+(llamabatch[\w.]*)\s+c?import\b|c?import\s+(llamabatch[\w.]*))")


def cython_imports(module: str, source: str, modules: Iterable[str]) -> list[Import]:
    """The ``llamabatch`` imports and cimports of a ``.pyx``/``.pxd`` file."""
    out = []
    for number, line in enumerate(source.splitlines(), 1):
        match = _CYTHON_IMPORT.match(line)
        if match:
            target = _resolve(match.group(1) or match.group(2), modules)
            if target is not None and target != module:
                out.append(Import(module, target, number))
    return out


def scan_imports(package: Path = PACKAGE) -> list[Import]:
    files = package_files(package)
    out: list[Import] = []
    for module, paths in files.items():
        for path in paths:
            source = path.read_text(encoding="utf-8")
            if path.suffix == ".py":
                out += python_imports(module, source, files, path.name == "__init__.py")
            elif path.suffix in (".pyx", ".pxd"):
                out += cython_imports(module, source, files)
    return out


def upward_imports(imports: Iterable[Import], layers: list[Layer]) -> list[str]:
    """Each import from a lower layer to a higher one, as ``source:line (layer) -> target (layer)``."""
    out = []
    for imp in imports:
        low, high = layer_index(imp.source, layers), layer_index(imp.target, layers)
        if low is not None and high is not None and high > low:
            kind = " (TYPE_CHECKING)" if imp.type_only else ""
            out.append(
                f"{imp.source}:{imp.line} ({layers[low].name}) -> {imp.target} ({layers[high].name}){kind}"
            )
    return sorted(set(out))


def import_cycles(imports: Iterable[Import]) -> list[list[Import]]:
    """One cycle through each strongly connected group of modules, as the imports that make
    it (Tarjan's algorithm, then a shortest way back within the group)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(start: str) -> None:  # iterative Tarjan
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)

    for name in sorted(edges):
        if name not in index:
            visit(name)
    cycles = []
    for group in groups:
        start = min(group)
        paths: dict[str, list[Import]] = {start: []}
        frontier = [start]
        cycle: list[Import] | None = None
        while frontier and cycle is None:  # breadth first: the shortest way back to start
            following = []
            for node in frontier:
                for target, imp in sorted(edges.get(node, {}).items()):
                    if target == start:
                        cycle = [*paths[node], imp]
                        break
                    if target in group and target not in paths:
                        paths[target] = [*paths[node], imp]
                        following.append(target)
                if cycle is not None:
                    break
            frontier = following
        assert cycle is not None
        cycles.append(cycle)
    return cycles


def describe_cycle(cycle: list[Import]) -> str:
    steps = [f"{imp.source}:{imp.line}" + (" (TYPE_CHECKING)" if imp.type_only else "") for imp in cycle]
    return " -> ".join([*steps, cycle[0].source])


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return scan_imports()


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    return parse_layers(DOC.read_text(encoding="utf-8"))


def test_every_module_has_a_layer(layers: list[Layer]) -> None:
    unplaced = [m for m in package_files() if layer_index(m, layers) is None]
    assert not unplaced, f"the layer table of ARCHITECTURE.md places no layer for: {unplaced}"


def test_no_import_goes_up_a_layer(imports: list[Import], layers: list[Layer]) -> None:
    upward = upward_imports(imports, layers)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_cycle(imports: list[Import]) -> None:
    cycles = import_cycles(imports)
    assert not cycles, "import cycles:\n" + "\n".join(describe_cycle(c) for c in cycles)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reads(module: str, source: str, modules: Iterable[str], is_package: bool) -> list[str]:
    """Where ``module`` reads another module's private name: ``from x import _name``,
    ``x._name`` with ``x`` an imported ``llamabatch`` module (``_ffi`` and ``_core``, folders
    of the package, are not names read), ``obj._name`` (``obj`` not ``self`` or ``cls``)
    where no code of this module defines ``_name``: an object of another module's class, and
    ``self._name`` in a subclass of another module's class where no code here defines it."""
    known = set(modules)
    tree = parse(source)
    here = module if is_package else module.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> the llamabatch module it is bound to
    imported: set[str] = set()  # names imported from other llamabatch modules
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "llamabatch" and alias.name in known:
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "llamabatch" or base == module:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    aliases[alias.asname or alias.name] = full
                else:
                    imported.add(alias.asname or alias.name)
                if full not in known and _is_private(alias.name):
                    out.append((node.lineno, f"{module}:{node.lineno} imports {full}"))
    own = _names_defined(tree)
    foreign = _foreign_names(tree)
    inherited = _subclass_nodes(tree, imported)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = ast.unparse(node.value)
            target = aliases.get(owner, owner if owner in known else None)
            if target is not None:
                if target != module:
                    out.append((node.lineno, f"{module}:{node.lineno} reads {target}.{node.attr}"))
            elif owner in ("self", "cls"):
                if id(node) in inherited and node.attr not in own:
                    text = (
                        f"{module}:{node.lineno} reads {owner}.{node.attr}, a base class's of another module"
                    )
                    out.append((node.lineno, text))
            elif owner.split(".")[0] not in foreign and node.attr not in own:
                text = f"{module}:{node.lineno} reads {owner}.{node.attr}, defined in no code of its own"
                out.append((node.lineno, text))
    return [text for _, text in sorted(out)]


def _subclass_nodes(tree: ast.AST, imported: set[str]) -> set[int]:
    """The nodes inside classes that subclass a class imported from another llamabatch
    module (their ``self._name`` may be the base's private name)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            ast.unparse(b).split(".")[0] in imported for b in node.bases
        ):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def _names_defined(tree: ast.AST) -> set[str]:
    """Every name this module's code defines or assigns (functions, classes, attributes,
    variables, parameters, and strings, which name ``__slots__`` and ``getattr`` targets)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names bound to what is not llamabatch's (the standard library's ``os._exit``), and
    cffi's ``ffi`` / ``lib``, whose attributes are C names."""
    names = {"ffi", "lib", "llama_ffi", "llama_lib"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] != "llamabatch"
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] != "llamabatch"
        ):
            names.update(a.asname or a.name for a in node.names)
    return names


def test_no_private_name_read_across_modules() -> None:
    files = package_files()
    found = []
    for module, paths in files.items():
        for path in paths:
            if path.suffix == ".py":
                source = path.read_text(encoding="utf-8")
                found += private_reads(module, source, files, path.name == "__init__.py")
    assert not found, "private names read across modules:\n" + "\n".join(sorted(found))


#: the most lines a Python module may hold (split one by concern before it grows past)
MAX_MODULE_LINES = 700


def test_no_module_over_the_line_limit() -> None:
    """Python modules only; the Cython sources (``_core/*.pyx``) are not held to it here."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


# -- the checks above must be able to fail -------------------------------------------------


def test_the_scan_sees_every_kind_of_import() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import llamabatch.errors\n"
        "from llamabatch.generate import core\n"
        "from . import sibling\n"
        "from .sibling import name\n"
        "if TYPE_CHECKING:\n"
        "    from llamabatch.config import EngineConfig\n"
        "def later():\n"
        "    from llamabatch.params import SamplingParams\n"
    )
    modules = [
        "llamabatch.errors",
        "llamabatch.generate",
        "llamabatch.generate.core",
        "llamabatch.prompts.sibling",
        "llamabatch.config",
        "llamabatch.params",
    ]
    found = python_imports("llamabatch.prompts.here", source, modules, is_package=False)
    assert [(i.target, i.line, i.type_only) for i in found] == [
        ("llamabatch.errors", 2, False),
        ("llamabatch.generate.core", 3, False),
        ("llamabatch.prompts.sibling", 4, False),
        ("llamabatch.prompts.sibling", 5, False),
        ("llamabatch.config", 7, True),
        ("llamabatch.params", 9, False),
    ]
    pyx = "from llamabatch._core.batch cimport Batch\nimport numpy\nfrom llamabatch.errors import X\n"
    found = cython_imports("llamabatch._core.slots", pyx, ["llamabatch._core.batch", "llamabatch.errors"])
    assert [(i.target, i.line) for i in found] == [("llamabatch._core.batch", 1), ("llamabatch.errors", 3)]


def test_the_layer_check_sees_an_upward_import() -> None:
    text = (
        "## Layers\n\n| layer | folder | owns |\n| --- | --- | --- |\n"
        "| leaf | `errors.py` | x |\n| engine | `generate/`, `config.py` | y |\n"
        "| chat | `prompts/chat_template.py` | z |\n\n## Next\n"
    )
    layers = parse_layers(text)
    assert [layer.name for layer in layers] == ["leaf", "engine", "chat"]
    assert layer_index("llamabatch.generate.core", layers) == 1
    assert layer_index("llamabatch.prompts.chat_template", layers) == 2
    assert layer_index("llamabatch.prompts.inputs", layers) is None
    imports = [
        Import("llamabatch.errors", "llamabatch.config", 3, True),
        Import("llamabatch.config", "llamabatch.errors", 4),
        Import("llamabatch.generate.core", "llamabatch.config", 5),
    ]
    assert upward_imports(imports, layers) == [
        "llamabatch.errors:3 (leaf) -> llamabatch.config (engine) (TYPE_CHECKING)"
    ]


def test_the_cycle_check_sees_a_cycle() -> None:
    imports = [
        Import("a", "b", 1),
        Import("b", "c", 2),
        Import("c", "a", 3, True),
        Import("c", "d", 4),
        Import("d", "e", 5),
    ]
    cycles = import_cycles(imports)
    assert len(cycles) == 1
    assert describe_cycle(cycles[0]) == "a:1 -> b:2 -> c:3 (TYPE_CHECKING) -> a"
    assert import_cycles(imports[:2] + imports[3:]) == []


def test_the_private_name_check_sees_reads() -> None:
    source = (
        "import llamabatch.generate.core as core\n"
        "from llamabatch.generate import request\n"
        "from llamabatch.params import _check, SamplingParams\n"
        "from llamabatch import _ffi\n"
        "import os\n"
        "def f(x):\n"
        "    core._budget\n"
        "    request._private(x)\n"
        "    x._mine\n"
        "    x._theirs\n"
        "    request.__name__\n"
        "    os._exit(1)\n"
        "class A:\n"
        "    _mine = 1\n"
        "class B(SamplingParams):\n"
        "    def f(self):\n"
        "        return self._put, self._mine\n"
    )
    modules = ["llamabatch", "llamabatch._ffi", "llamabatch.generate", "llamabatch.generate.core"]
    modules += ["llamabatch.generate.request", "llamabatch.params"]
    assert private_reads("llamabatch.here", source, modules, is_package=False) == [
        "llamabatch.here:3 imports llamabatch.params._check",
        "llamabatch.here:7 reads llamabatch.generate.core._budget",
        "llamabatch.here:8 reads llamabatch.generate.request._private",
        "llamabatch.here:10 reads x._theirs, defined in no code of its own",
        "llamabatch.here:17 reads self._put, a base class's of another module",
    ]
