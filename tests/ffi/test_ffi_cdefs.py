"""The hand-written cdef names only what the vendored llama.h declares, and only what llamabatch uses.

``_cdefs.h`` is parsed into its declarations: functions, enums (type and values), structs and
typedefs, and the fields of the structs whose layout the compiler completes (``...;``).
Every function must be called as ``lib.<name>`` (or taken as ``ffi.addressof(lib, "<name>")``)
somewhere in ``llamabatch/``, or, declared ``extern "Python"``, written with
``@ffi.def_extern()``; every global variable read or set as ``lib.<name>``; every enum value
read as ``lib.<VALUE>``; every partial-struct field accessed as ``.<field>``; every type named
by another declaration or by an ``ffi.new``/``ffi.cast`` in the package. A declaration
nobody uses fails the test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llamabatch import _vendor
from llamabatch._ffi import _build

PACKAGE = Path(_build.__file__).resolve().parents[1]
IDENT = r"[A-Za-z_]\w*"


@dataclass
class Declarations:
    """What a cdef source declares."""

    functions: set[str] = field(default_factory=set)
    #: functions declared ``extern "Python"``: written in Python (``@ffi.def_extern()``), called by C
    python_functions: set[str] = field(default_factory=set)
    #: global variables (``extern TYPE NAME;``: llamabatch's own, read and set as ``lib.NAME``)
    variables: set[str] = field(default_factory=set)
    defines: set[str] = field(default_factory=set)
    #: enum type -> its listed values
    enums: dict[str, list[str]] = field(default_factory=dict)
    #: every named struct or typedef: (the names it defines, the statement defining it)
    types: list[tuple[set[str], str]] = field(default_factory=list)
    #: struct tag -> fields, for structs ending in ``...;`` (the compiler completes their layout)
    partial_fields: dict[str, list[str]] = field(default_factory=dict)
    statements: list[str] = field(default_factory=list)


def _statements(source: str) -> tuple[list[str], list[str]]:
    """(top-level ``;``-terminated statements, preprocessor lines) of C declarations."""
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    source = re.sub(r"//[^\n]*", " ", source)
    directives = [line.strip() for line in source.splitlines() if line.strip().startswith("#")]
    source = "\n".join(line for line in source.splitlines() if not line.strip().startswith("#"))
    statements, depth, current = [], 0, []
    for ch in source:
        depth += (ch == "{") - (ch == "}")
        if ch == ";" and depth == 0:
            statements.append(" ".join("".join(current).split()))
            current = []
        else:
            current.append(ch)
    return [s for s in statements if s], directives


def parse(source: str) -> Declarations:
    out = Declarations()
    statements, directives = _statements(source)
    out.statements = statements
    for line in directives:
        m = re.match(rf"#\s*define\s+({IDENT})", line)
        if m:
            out.defines.add(m.group(1))
    for st in statements:
        body = re.search(r"\{(.*)\}", st)
        if st.startswith("typedef"):
            pointer = re.search(rf"\(\s*\*\s*({IDENT})\s*\)", st)  # a function pointer type
            names = {pointer.group(1)} if pointer else {re.findall(IDENT, re.sub(r"\{.*\}", "", st))[-1]}
            tag = re.match(rf"typedef\s+(?:struct|enum)\s+({IDENT})\s*\{{", st)
            if tag:
                names.add(tag.group(1))
            out.types.append((names, st))
        elif m := re.match(rf"enum\s+({IDENT})\s*\{{", st):
            values = [v.strip() for v in body.group(1).split(",")] if body else []
            out.enums[m.group(1)] = [v for v in values if v and v != "..."]
            out.types.append(({m.group(1)}, st))
        elif m := re.match(rf"struct\s+({IDENT})\s*(\{{|$)", st):
            out.types.append(({m.group(1)}, st))
        elif "(" in st:
            out.functions.add(re.search(rf"({IDENT})\s*\(", st).group(1))
            if st.startswith('extern "Python"'):
                out.python_functions.add(re.search(rf"({IDENT})\s*\(", st).group(1))
        elif m := re.match(rf"extern\s+[\w\s*]+?\b({IDENT})$", st):
            out.variables.add(m.group(1))
        else:
            raise AssertionError(f"unparsed cdef statement: {st!r}")
        struct = re.match(rf"(?:typedef\s+)?struct\s+({IDENT})\s*\{{", st)
        if struct and body:
            members = [m.strip() for m in body.group(1).split(";") if m.strip()]
            if "..." in members:
                out.partial_fields[struct.group(1)] = [
                    re.findall(IDENT, re.sub(r"\[.*?\]", "", m))[-1] for m in members if m != "..."
                ]
    return out


def package_source() -> str:
    """Every Python file of llamabatch/, concatenated (the binding's callers)."""
    return "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")))


def unused(decl: Declarations, python: str) -> list[str]:
    """The declarations in ``decl`` that no code in ``python`` uses."""
    problems = []
    for name in sorted(decl.functions):
        called = re.search(rf"\blib\.{name}\b", python)
        addressed = re.search(rf"addressof\(\s*lib\s*,\s*[\"']{name}[\"']\s*\)", python)
        written = name in decl.python_functions and re.search(rf"def_extern\(\)\s*\ndef {name}\(", python)
        if not (called or addressed or written):
            problems.append(f"function {name}")
    for name in sorted(decl.defines):
        if not re.search(rf"\blib\.{name}\b", python):
            problems.append(f"#define {name}")
    problems += [f"variable {n}" for n in sorted(decl.variables) if not re.search(rf"\blib\.{n}\b", python)]
    for values in decl.enums.values():
        problems += [f"enum value {v}" for v in values if not re.search(rf"\blib\.{v}\b", python)]
    for struct, fields in decl.partial_fields.items():
        problems += [f"field {struct}.{f}" for f in fields if not re.search(rf"\.{f}\b", python)]
    # Types: named by another declaration (a used function, field or typedef), or given to
    # ffi.new / ffi.cast by the package.
    ffi_types = " ".join(re.findall(r"ffi\.(?:new|cast|sizeof|typeof)\(\s*[\"']([^\"']+)[\"']", python))
    for names, own in decl.types:
        others = " ".join(st for st in decl.statements if st != own) + " " + ffi_types
        if not any(re.search(rf"\b{n}\b", others) for n in names):
            problems.append(f"type {'/'.join(sorted(names))}")
    return problems


@pytest.fixture(scope="module")
def cdefs() -> Declarations:
    return parse(_build.cdef_source())


def test_the_parser_reads_the_whole_cdef(cdefs):
    assert len(cdefs.functions) > 60
    assert {"llama_decode", "llamabatch_abort_flag_cb", "_llamabatch_log_callback"} <= cdefs.functions
    assert cdefs.variables == {"llamabatch_log_debug"}
    assert cdefs.enums["llama_pooling_type"][0] == "LLAMA_POOLING_TYPE_UNSPECIFIED"
    assert "n_ctx" in cdefs.partial_fields["llama_context_params"]
    assert "llama_batch" not in cdefs.partial_fields  # a full layout: every field is declared


def test_every_cdef_function_is_in_llama_h(cdefs):
    header = _vendor.find_build().header.read_text()
    declared = set(re.findall(r"LLAMA_API[^;]*?\b(llama_[a-z0-9_]+)\s*\(", header, flags=re.S))
    names = {n for n in cdefs.functions if n.startswith("llama_")}
    missing = sorted(names - declared)
    assert not missing, f"cdef names missing from the vendored llama.h: {missing}"


def test_every_cdef_struct_and_enum_is_in_llama_h(cdefs):
    header = _vendor.find_build().header.read_text()
    for _names, statement in cdefs.types:
        m = re.match(rf"(?:typedef\s+)?(struct|enum)\s+({IDENT})\s*\{{", statement)
        if m and m.group(2).startswith("llama_"):
            assert re.search(rf"\b{m.group(1)}\s+{m.group(2)}\s*\{{", header), f"{m.group(2)} not in llama.h"


def test_loaded_library_exports_every_function(cdefs):
    names = sorted(n for n in cdefs.functions if n.startswith("llama_"))
    assert _vendor.missing_symbols(names) == []


def test_every_cdef_is_used_by_the_package(cdefs):
    problems = unused(cdefs, package_source())
    assert not problems, (
        f"declared in llamabatch/_ffi/_cdefs.h but used nowhere in llamabatch/: {problems} "
        "(remove them, or add each with its first caller)"
    )


def test_the_usage_check_catches_an_unused_declaration():
    source = """
    #define LLAMA_USED ...
    #define LLAMA_UNUSED ...
    typedef int32_t llama_token;
    typedef int32_t llama_orphan;
    struct llama_thing;
    enum llama_kind { LLAMA_KIND_A, LLAMA_KIND_B, ... };
    struct llama_params { int32_t used_field; bool unused_field; ...; };
    struct llama_params llama_default_params(void);
    llama_token llama_used(struct llama_thing * t, enum llama_kind k);
    void llama_unused(void);  /* nobody calls this one */
    extern int llamabatch_used_flag;
    extern int llamabatch_unused_flag;
    """
    python = """
    lib.LLAMA_USED, lib.LLAMA_KIND_A
    p = lib.llama_default_params(); p.used_field = 1
    lib.llama_used(thing, kind)
    lib.llamabatch_used_flag = 1
    """
    assert unused(parse(source), python) == [
        "function llama_unused",
        "#define LLAMA_UNUSED",
        "variable llamabatch_unused_flag",
        "enum value LLAMA_KIND_B",
        "field llama_params.unused_field",
        "type llama_orphan",
    ]
