"""The package's shape, read from the source with ast (no imports, so it is cheap): no import cycle between
gpt2edge's modules (an import inside a function or under TYPE_CHECKING counts: it is still a dependency both
ways), the runtime importing nothing from the layers above it nor torch, and runtime modules of about 300 lines
at most."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "gpt2edge"
# what gpt2edge.runtime must never import (the house rules: serve -> runtime, never back; no torch)
RUNTIME_FORBIDDEN = (
    "gpt2edge.export", "gpt2edge.quantize", "gpt2edge.trim", "gpt2edge.convert", "gpt2edge.serve", "gpt2edge.cli",
    "gpt2edge.bench", "torch", "transformers", "onnx", "onnxscript",
)  # fmt: skip
MAX_RUNTIME_LINES = 320


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


MODULES = modules_of(ROOT)


def imported(path: Path, modules: dict[str, Path] = MODULES, root: Path = ROOT) -> set[str]:
    """Every module name an import statement anywhere in the file names (`from a import b` gives a.b when b
    is a module of ours, else a)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module_name(path, root).split(".")
                base = base[: len(base) - node.level + (path.name == "__init__.py")]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
    return out


def import_graph(modules: dict[str, Path], root: Path = ROOT) -> dict[str, set[str]]:
    return {m: {d for d in imported(p, modules, root) if d in modules and d != m} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph(MODULES)) == []


def test_cycle_finder_sees_a_cycle(tmp_path):
    """The check above could pass by seeing nothing: the same walk on two modules importing each other, one of
    them lazily inside a function and one under TYPE_CHECKING, must report them."""
    pkg = tmp_path / "gpt2edge"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from gpt2edge.b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpt2edge import a\n")
    assert cycles(import_graph(modules_of(pkg), pkg)) == [["gpt2edge.a", "gpt2edge.b"]]


RUNTIME = {m: p for m, p in MODULES.items() if m == "gpt2edge.runtime" or m.startswith("gpt2edge.runtime.")}


@pytest.mark.parametrize("module", sorted(RUNTIME))
def test_runtime_imports_nothing_above_it(module):
    bad = sorted(d for d in imported(RUNTIME[module]) for f in RUNTIME_FORBIDDEN if d == f or d.startswith(f + "."))
    assert bad == [], f"{module} imports {bad}"


def test_runtime_modules_stay_small():
    long = {m: n for m, p in RUNTIME.items() if (n := len(p.read_text().splitlines())) > MAX_RUNTIME_LINES}
    assert long == {}


def _in(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


# the ground every layer stands on: it imports nothing above it (and onnx_io sits below manifest)
GROUND = (
    "gpt2edge.errors", "gpt2edge.api_args", "gpt2edge.manifest", "gpt2edge.folder", "gpt2edge.onnx_io",
    "gpt2edge.budget.needs", "gpt2edge.budget.memory", "gpt2edge.budget.inputs",
)  # fmt: skip
# rooms each room must not import: (room, forbidden rooms)
ONE_WAY = (
    ("gpt2edge.onnx_io", ("gpt2edge.manifest", "gpt2edge.folder")),
    ("gpt2edge.quality", ("gpt2edge.trim", "gpt2edge.quantize", "gpt2edge.sparse", "gpt2edge.convert")),
)
GRAPH = import_graph(MODULES)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, GROUND)))
def test_the_ground_imports_nothing_above_it(module):
    bad = sorted(d for d in GRAPH[module] if d != "gpt2edge" and not _in(d, GROUND))
    assert bad == [], f"{module} imports {bad}"


@pytest.mark.parametrize(("room", "forbidden"), ONE_WAY, ids=[room for room, _ in ONE_WAY])
def test_rooms_import_one_way(room, forbidden):
    bad = sorted((m, d) for m in MODULES if _in(m, (room,)) for d in GRAPH[m] if _in(d, forbidden))
    assert bad == []
