"""The ``.pyi`` stubs of the compiled core describe its runtime API, and ``Strategy`` types ``strategy=``.

The stubs are parsed (``ast``) and compared with the compiled modules: the same public
names, the same public members per class (properties as properties), and the same
parameter names and defaults wherever the runtime has a signature. A name added to a
``.pyx`` without its stub, or a parameter renamed, fails here. A slow test runs mypy on a
snippet to check that the stubs and the ``Strategy`` protocol are what it sees.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import llamabatch.strategies
from llamabatch._core import BatchPool, SlotTable
from llamabatch.config import EngineConfig
from llamabatch.strategies import Balanced, DecodeMaximal, PrefillPriority, SlotState, Strategy

CORE_MODULES = [
    "llamabatch._core.batch",
    "llamabatch._core.kv_record",
    "llamabatch._core.slot_record",
    "llamabatch._core.slots",
    "llamabatch._core.strategies",
    "llamabatch._core.ubatch_runs",
    "llamabatch._core.user_plans",
]
DUNDERS = {"__len__", "__init__"}  # compared like public names where the runtime shows them


def _stub(module: ModuleType) -> ast.Module:
    path = Path(module.__file__).with_name(module.__name__.rsplit(".", 1)[1] + ".pyi")
    assert path.is_file(), f"{module.__name__} has no stub {path.name}"
    return ast.parse(path.read_text())


def _public(name: str) -> bool:
    return not name.startswith("_") or name in DUNDERS


def _defs(body: list[ast.stmt]) -> dict[str, list[ast.stmt]]:
    """Names a stub body defines (functions, overloads together, classes, annotated names)."""
    out: dict[str, list[ast.stmt]] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.setdefault(node.name, []).append(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, []).append(node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node)
    return {name: nodes for name, nodes in out.items() if _public(name)}


def _runtime_names(module: ModuleType) -> set[str]:
    """Public names the module defines itself (not what it imports)."""
    names = set()
    for name, obj in vars(module).items():
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if (inspect.isclass(obj) or callable(obj)) and getattr(obj, "__module__", None) != module.__name__:
            continue
        names.add(name)
    return names


def _is_property(nodes: list[ast.stmt]) -> bool:
    return any(
        isinstance(n, ast.FunctionDef) and any(getattr(d, "id", None) == "property" for d in n.decorator_list)
        for n in nodes
    )


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, Any]]:
    """(name, default or inspect.Parameter.empty) of each parameter but self."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    params = list(zip([a.arg for a in positional], defaults, strict=True))
    params += [
        (a.arg, inspect.Parameter.empty if d is None else ast.literal_eval(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    return [p for p in params if p[0] != "self"]


def _runtime_params(obj: Any) -> list[tuple[str, Any]] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [(p.name, p.default) for p in sig.parameters.values() if p.name != "self"]


def _check_callable(where: str, runtime: Any, nodes: list[ast.stmt]) -> None:
    expected = _runtime_params(runtime)
    if expected is None:
        return
    overloads = [n for n in nodes if isinstance(n, ast.FunctionDef)]
    assert overloads, f"{where}: a callable at runtime, not a function in the stub"
    if len(overloads) == 1:
        assert _stub_params(overloads[0]) == expected, f"{where}: the stub's parameters differ"
    else:  # overloads: the same names each; the runtime default appears in one of them
        for fn in overloads:
            names = [n for n, _ in _stub_params(fn)]
            assert names == [n for n, _ in expected], f"{where}: an overload differs"
        for i, (name, default) in enumerate(expected):
            if default is not inspect.Parameter.empty:
                stub_defaults = {_stub_params(fn)[i][1] for fn in overloads}
                assert default in stub_defaults, f"{where}: {name}'s default {default!r} is in no overload"


@pytest.mark.parametrize("name", CORE_MODULES)
def test_stub_declares_the_module_public_names(name):
    module = importlib.import_module(name)
    stub = _defs(_stub(module).body)
    runtime = _runtime_names(module)
    assert set(stub) == runtime, (
        f"{name}: in the module only {sorted(runtime - set(stub))}, "
        f"in the stub only {sorted(set(stub) - runtime)}"
    )
    for attr in sorted(runtime):
        obj = getattr(module, attr)
        if callable(obj) and not inspect.isclass(obj):
            _check_callable(f"{name}.{attr}", obj, stub[attr])


@pytest.mark.parametrize("name", CORE_MODULES)
def test_stub_classes_match_the_runtime_classes(name):
    module = importlib.import_module(name)
    stub = _defs(_stub(module).body)
    for cls_name in sorted(_runtime_names(module)):
        cls = getattr(module, cls_name)
        if not inspect.isclass(cls):
            continue
        (node,) = stub[cls_name]
        assert isinstance(node, ast.ClassDef)
        members = _defs(node.body)
        runtime = {m for m in vars(cls) if _public(m)}
        if "__init__" not in vars(cls):
            runtime.discard("__init__")
        # A cdef class takes its arguments in __cinit__, which has no signature: the stub's
        # __init__ is checked by calling the class with every parameter by keyword.
        stub_init = members.pop("__init__", None)
        assert set(members) == runtime, (
            f"{name}.{cls_name}: at runtime only {sorted(runtime - set(members))}, "
            f"in the stub only {sorted(set(members) - runtime)}"
        )
        if stub_init is not None:
            kwargs = {p: (1 if d is inspect.Parameter.empty else d) for p, d in _stub_params(stub_init[0])}
            cls(**kwargs)
        for member in sorted(runtime):
            obj = vars(cls)[member]
            where = f"{name}.{cls_name}.{member}"
            if inspect.isdatadescriptor(obj):
                assert _is_property(members[member]), f"{where}: a property at runtime"
            elif callable(obj):
                _check_callable(where, getattr(cls, member), members[member])
            else:  # a class attribute (a strategy's name, an enum member)
                assert not _is_property(members[member]), f"{where}: a class attribute at runtime"


def test_builtins_and_user_strategies_satisfy_the_protocol():
    class Mine:
        def plan(self, view, budget, chunk_size, queue_depth):
            return []

    for strategy in (DecodeMaximal(), PrefillPriority(), Balanced(), Mine()):
        assert isinstance(strategy, Strategy)
    assert not isinstance(object(), Strategy)
    annotation = inspect.signature(EngineConfig.__init__).parameters["strategy"].annotation
    assert annotation == "str | Strategy"


def test_the_protocol_docstring_example_plans_a_valid_batch():
    doc = llamabatch.strategies.__doc__
    code = textwrap.dedent(re.search(r"::\n\n(.*?)\n\n(?=\S)", doc, flags=re.S).group(1))
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    strategy = namespace["strategy"]
    table, pool = SlotTable(3, 64, chunk_size=4), BatchPool(n_batch=8)
    batch = pool.acquire()
    table.start(0, [1, 2, 3])
    table.start(1, list(range(10, 20)))
    assert table.fill(batch, strategy, 8) == 3 + 4  # slot 0's prompt, a chunk of slot 1's
    table.commit()
    table.accept(0, 7)
    assert table.fill(batch, strategy, 8) == 1 + 4  # slot 0 decodes, slot 1's next chunk
    assert table.last_plan() == [(0, 1), (1, 4)]
    table.commit()
    assert table.state(0) == SlotState.AWAIT_SAMPLE
    pool.release(batch)


SNIPPET = """
from collections.abc import Iterable

from llamabatch._core import BatchPool, SlotTable, get_strategy
from llamabatch.config import EngineConfig
from llamabatch.strategies import Balanced, SlotState, Strategy, TableView


class Mine:
    def plan(
        self, view: TableView, budget: int, chunk_size: int, queue_depth: int
    ) -> Iterable[tuple[int, int]]:
        return [(s, 1) for s in view.decode_slots[:budget]]


class Wrong:
    def plan(self, view: TableView) -> list[int]:
        return []


table = SlotTable(4, 64, chunk_size=16)
batch = BatchPool(n_batch=32).acquire()
table.start(0, [1, 2, 3])
n: int = table.fill(batch, Mine(), 32) + table.fill(batch, "balanced", 32)
state: SlotState = table.state(0)
ok: Strategy = Balanced()
reveal_type(get_strategy("balanced"))
reveal_type(get_strategy(Mine()))
reveal_type(batch.tokens)
EngineConfig(strategy=Mine())
bad: Strategy = Wrong()  # E1
table.fill(batch, Wrong(), 32)  # E2
table.start("0", [1])  # E3
EngineConfig(strategy=Wrong())  # E4
"""


@pytest.mark.slow
def test_mypy_sees_the_stubs_and_the_protocol(tmp_path):
    api = pytest.importorskip("mypy.api")
    path = tmp_path / "snippet.py"
    path.write_text(SNIPPET)
    options = ["--follow-imports=silent", "--no-error-summary", "--hide-error-context"]
    out, err, _ = api.run([str(path), *options])
    lines = SNIPPET.splitlines()
    errors: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(rf"{re.escape(str(path))}:(\d+): (error|note): (.*)", line)
        if m and m.group(2) == "error":
            tag = re.search(r"# (E\d)", lines[int(m.group(1)) - 1])
            errors.setdefault(tag.group(1) if tag else f"line {m.group(1)}", []).append(m.group(3))
    assert sorted(errors) == ["E1", "E2", "E3", "E4"], out + err
    assert 'Revealed type is "llamabatch._core.strategies.Balanced"' in out
    assert 'Revealed type is "snippet.Mine"' in out
    assert "numpy.signedinteger[numpy._typing._nbit_base._32Bit]" in out
