"""The house rules, read from the package's own imports (``docs/architecture.md``).

Every import of a tokenpatch module, at module level or inside a function, is an arrow. The test fails
on an import circle, on an import placed inside a function (the way circles used to be dodged), on an
import of another module's private name (``from tokenpatch.x import _y``, or ``x._y`` on an imported
module), on the library importing the workbench, and on a library file past 400 lines.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenpatch"
WORKBENCH = "tokenpatch.workbench"
MAX_LINES = 400


@dataclass
class Module:
    name: str
    path: Path
    imports: list[tuple[int, str, bool]] = field(default_factory=list)  # (line, target module, inside a function)
    private: list[tuple[int, str]] = field(default_factory=list)  # (line, "module._name")


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Module]:
    names = {_name(p): p for p in PACKAGE.rglob("*.py")}
    mods = {}
    for name, path in names.items():
        mod = Module(name, path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bound: dict[str, str] = {}  # local name -> tokenpatch module it is bound to

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    if base.split(".")[0] == "tokenpatch":
                        for alias in child.names:
                            full = f"{base}.{alias.name}"
                            if full in names:  # a module imported by name
                                mod.imports.append((child.lineno, full, inner))
                                bound[alias.asname or alias.name] = full
                            else:
                                mod.imports.append((child.lineno, base, inner))
                                if alias.name.startswith("_") and not alias.name.startswith("__") and base != name:
                                    mod.private.append((child.lineno, f"{base}.{alias.name}"))
                elif isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name.split(".")[0] == "tokenpatch":
                            mod.imports.append((child.lineno, alias.name, inner))
                            if alias.asname:
                                bound[alias.asname] = alias.name
                visit(child, inner)

        visit(tree, False)
        for node in ast.walk(tree):  # files._x on a module bound above
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
            ):
                mod.private.append((node.lineno, f"{bound[node.value.id]}.{node.attr}"))
        mods[name] = mod
    return mods


MODULES = _modules()


def _cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    graph = {m: sorted({t for _, t, _ in mod.imports if t in mods and t != m}) for m, mod in mods.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_reader_sees_every_module():
    assert {"tokenpatch.patch", "tokenpatch.run", "tokenpatch.workbench.cli.main", "tokenpatch.arch.base"} <= set(
        MODULES
    )
    assert any(t == "tokenpatch.patch" for _, t, _ in MODULES["tokenpatch.run"].imports)


def test_no_import_circles():
    assert _cycles(MODULES) == []


def test_cycle_finder_finds_one():  # the finder itself, on a made-up circle
    a, b = Module("a", PACKAGE, [(1, "b", False)]), Module("b", PACKAGE, [(1, "a", True)])
    assert _cycles({"a": a, "b": b}) == [["a", "b"]]


def test_no_imports_inside_functions():
    """In the library. The command line defers its imports on purpose (it checks its arguments before
    torch loads); the circle test above holds it to the same graph."""
    inside = [
        f"{m.name}:{line} imports {t}"
        for m in MODULES.values()
        for line, t, fn in m.imports
        if fn and not m.name.startswith(f"{WORKBENCH}.cli")
    ]
    assert inside == []


def test_no_private_names_across_modules():
    used = [f"{m.name}:{line} uses {what}" for m in MODULES.values() for line, what in m.private]
    assert used == []


def test_library_never_imports_the_workbench():
    wrong = [
        f"{m.name}:{line} imports {t}"
        for m in MODULES.values()
        for line, t, _ in m.imports
        if t.startswith(WORKBENCH) and not (m.name.startswith(WORKBENCH) or m.name == "tokenpatch.__main__")
    ]
    assert wrong == []


@pytest.mark.parametrize("name", sorted(m for m in MODULES if not m.startswith(WORKBENCH)))
def test_library_files_are_short(name):
    lines = MODULES[name].path.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{MODULES[name].path} has {lines} lines"


DELTA_PROTOCOL = ("tokenpatch.deltas", "tokenpatch.lowrank")  # the delta protocol and LowRank's own methods


def test_delta_types_are_told_apart_only_in_the_delta_protocol():
    """``isinstance`` on a delta's type (``LowRank``, ``Delta``, or ``Tensor`` of a ``delta``) only in
    ``deltas.py`` and ``lowrank.py``: elsewhere a delta goes through the protocol (``deltas.kind`` where
    the kinds must be told apart), so a new kind of delta is one entry there."""
    found = []
    for m in MODULES.values():
        if m.name in DELTA_PROTOCOL:
            continue
        text = m.path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if not (
                isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2
            ):
                continue
            kinds = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            what = ast.get_source_segment(text, node.args[0]) or ""
            if kinds & {"LowRank", "Delta"} or ("Tensor" in kinds and "delta" in what.lower()):
                found.append(f"{m.name}:{node.lineno} isinstance({what}, {ast.get_source_segment(text, node.args[1])})")
    assert found == []


NORM_CLASSES = ("RMSNorm", "LayerNorm")  # in a norm class's name (Gemma3RMSNorm, nn.LayerNorm, ...)
NORM_TABLES = ("NORMS", "RMS_OFFSETS", "SCALE_NORMS")  # tokenpatch.arch.norms' table and what is read from it


def test_norm_classes_are_named_only_in_arch():
    """Norm classes (``...RMSNorm``, ``...LayerNorm``) and their offsets are known in one table,
    ``arch/norms.py`` (``NORMS``), which ``arch/float64.py`` and ``tokenpatch.testing`` read: outside
    ``tokenpatch/arch/`` no code names a norm class (a name, an attribute, an imported name, a string
    that is not a docstring), and no module re-exports the table, or a table read from it, in its
    ``__all__``. Our own models' code (``tokenpatch/models/``) defines its layers and is exempt."""
    found = []
    for m in MODULES.values():
        if m.name.split(".")[1:2] in (["arch"], ["models"]):
            continue
        tree = ast.parse(m.path.read_text(encoding="utf-8"))
        scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = {
            id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, scopes) and isinstance(n.body[0], ast.Expr)
        }
        from_arch = {  # names imported from tokenpatch.arch's modules
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tokenpatch.arch")
            for a in n.names
        }
        exported = {  # the module's __all__
            e.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
            for e in getattr(n.value, "elts", [])
            if isinstance(e, ast.Constant)
        }
        found += [f"{m.name}: re-exports {name}" for name in sorted(exported & from_arch) if name in NORM_TABLES]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                name = node.value
            elif isinstance(node, ast.alias):
                name = node.name
            else:
                name = getattr(node, "id", None) or getattr(node, "attr", None) or ""
            if any(c in name for c in NORM_CLASSES):
                found.append(f"{m.name}:{node.lineno} {name[:60]}")
    assert found == []


OUTPUT_KIND_NAMES = ("bias", "matrix", "matrix+scale", "gated", "experts")  # arch.outputs.OUTPUT_KINDS
RECORD_FIELDS = ("h", "m", "s", "hidden", "out", "p", "gate", "v", "sum", "first", "a")  # arch.record, and "a"


def _library_trees():
    for m in MODULES.values():
        if not m.name.startswith(WORKBENCH):
            yield m, ast.parse(m.path.read_text(encoding="utf-8"))


def test_no_string_comparison_of_an_output_kind():
    """Output kinds are classes (``arch/outputs.py``: each computes its own patch, fit and stream): no
    ``kind == "bias"``, ``site.kind in ("bias", "matrix")`` anywhere in the package, the workbench included."""
    found = []
    for m in MODULES.values():
        for node in ast.walk(ast.parse(m.path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            flat = [e for side in sides for e in getattr(side, "elts", [side])]
            on_kind = any(getattr(side, "attr", getattr(side, "id", None)) == "kind" for side in sides)
            named = any(isinstance(e, ast.Constant) and e.value in OUTPUT_KIND_NAMES for e in flat)
            if on_kind and named:
                found.append(f"{m.name}:{node.lineno} {ast.unparse(node)[:60]}")
    assert found == []


def test_no_string_keyed_layer_record():
    """A layer's recorded states are a ``LayerRecord`` (``arch/record.py``) read by field: no ``rec["m"]``,
    ``states.get("gate")`` or ``r.pop("a")`` in the library."""
    found = []
    for m, tree in _library_trees():
        for node in ast.walk(tree):
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                key = node.slice.value
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) in ("get", "pop", "setdefault")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                key = node.args[0].value
            if key in RECORD_FIELDS:
                found.append(f"{m.name}:{node.lineno} {ast.unparse(node)[:60]}")
    assert found == []


# What told the engines apart: the flag, and the layer-by-layer methods of the deprecated adapter interface.
ENGINE_NAMES = {"traced", "layer_by_layer", "embed", "mix", "mix_with_alone", "mix_prefixes", "finish"}


def test_no_reference_to_an_engine_outside_arch():
    """Every model is read through the same passes (``trace``, ``anchors``, ``prefixes``, ``prompted``,
    ``layer_calls``): outside ``arch/`` (and ``models/``, whose blocks define ``mix`` and ``finish``) no module
    reads which engine a model uses (``adapter.traced``) or runs a layer by the deprecated methods
    (``adapter.mix(...)``, ``implements("mix_prefixes")``), the workbench included."""
    found = []
    for m in MODULES.values():
        if m.name.split(".")[1:2] in (["arch"], ["models"]):
            continue
        for node in ast.walk(ast.parse(m.path.read_text(encoding="utf-8"))):
            named = (isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES) or (
                isinstance(node, ast.Constant) and node.value in ENGINE_NAMES
            )
            if named:
                found.append(f"{m.name}:{node.lineno} {ast.unparse(node)[:60]}")
    assert found == []
