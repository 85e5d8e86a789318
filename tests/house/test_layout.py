"""The package's shape, read from the source with ast (no imports, so it is cheap): no import cycle between
gpt2edge's modules (an import inside a function or under TYPE_CHECKING counts: it is still a dependency both
ways), the runtime importing nothing from the layers above it nor torch, the ground importing nothing above it,
the rooms importing one way (docs/layout.md draws the arrows), and sizes that fit a concern: a function's body
of 80 lines at most, a module of 600."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "gpt2edge"
# what gpt2edge.runtime must never import (the house rules: serve -> runtime, never back; no torch)
RUNTIME_FORBIDDEN = (
    "gpt2edge.export", "gpt2edge.quantize", "gpt2edge.trim", "gpt2edge.convert", "gpt2edge.serve", "gpt2edge.cli",
    "gpt2edge.bench", "torch", "transformers", "onnx", "onnxscript",
)  # fmt: skip
MAX_MODULE_LINES = 600  # one concern's module; past this it is two
MAX_FUNCTION_LINES = 80  # a function's body, after its signature and docstring (a click command's options are
# its signature): one screen
# the functions over MAX_FUNCTION_LINES today, each with the most lines it may have and why it is one function
# (a listed function may shrink, never grow; one that fits the cap is taken off the list)
LONG_FUNCTIONS = {
    "gpt2edge.export.exporter.export_model": (117, "every argument checked before work, then the export's steps "
                                             "inside one progress bar and one atomic output (each step calls "
                                             "its module)"),
    "gpt2edge.quantize.handler.quantize_model": (93, "the parent's checks before Derivation.ready, then the "
                                                 "streamed rewrite and its report inside one progress bar"),
    "gpt2edge.quantize.weight_only.quantize_weights": (90, "one pass over the graph's nodes whose branches share "
                                                       "the new nodes, initializers and packed tables"),
    "gpt2edge.sparse.fused.fused_nodes": (86, "the fused head's graph in numbered steps on one builder: each "
                                          "step's tensors feed the next"),
}  # fmt: skip


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


# --- the model contract (gpt2edge/runtime/model/contract.py) ----------------------------------------------------
# the model room knows nothing of the sparse head's, nor of the factory above both
MODEL_ROOM, ABOVE_MODEL = "gpt2edge.runtime.model", ("gpt2edge.runtime.sparse_head", "gpt2edge.runtime.open_model")
# the concrete graph, LM and cache-row kinds: callers read the contract's members, never test for one of these
KINDS = ("OrtGraph", "StaticGraph", "SparseGraph", "ApproxGraph", "BodyGraph", "OrtLM", "StaticLM", "SparseLM",
         "ApproxLM", "BodyLM", "SlotLM", "SoloRows")  # fmt: skip
FACTORY = "gpt2edge.runtime.open_model"  # the one place that opens a folder as the kind its manifest names
# the runtime (the model room, decoding, the sparse head ...) and serve's scheduling read the contract
PROBED = {m: p for m, p in MODULES.items() if m.startswith(("gpt2edge.runtime.", "gpt2edge.serve.scheduling."))}


def probes(path: Path) -> list[str]:
    """What in a file probes an object instead of reading the contract: getattr with a default, hasattr,
    isinstance / issubclass naming one of the concrete KINDS (alone or in a tuple), and a class's __getattr__
    (a wrapper whose members are whatever the wrapped object has)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            found.append(f"{path.name}:{node.lineno} __getattr__")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        name, args = node.func.id, node.args
        if (name == "getattr" and len(args) == 3) or name == "hasattr":
            found.append(f"{path.name}:{node.lineno} {name}")
        elif name in ("isinstance", "issubclass") and len(args) == 2:
            kinds = args[1].elts if isinstance(args[1], ast.Tuple) else [args[1]]
            kinds = [k for k in kinds if isinstance(k, ast.Name | ast.Attribute)]
            named = [k.id if isinstance(k, ast.Name) else k.attr for k in kinds]
            found += [f"{path.name}:{node.lineno} {name} {k}" for k in named if k in KINDS]
    return found


def test_the_model_room_imports_nothing_from_the_sparse_head():
    """(The graph factory, above both rooms, opens a sparse-head folder.)"""
    graph = import_graph(MODULES)
    bad = sorted((m, d) for m in MODULES if _in(m, (MODEL_ROOM,)) for d in graph[m] if _in(d, ABOVE_MODEL))
    assert bad == []


def test_the_kinds_named_here_exist():
    """KINDS must name real classes of the runtime, or the probe check below would miss a renamed one."""
    trees = [ast.parse(p.read_text()) for m, p in MODULES.items() if m.startswith("gpt2edge.runtime.")]
    defined = {n.name for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    assert set(KINDS) <= defined, sorted(set(KINDS) - defined)


@pytest.mark.parametrize("module", sorted(m for m in PROBED if m != FACTORY))
def test_no_probing_of_graph_or_lm_kinds(module):
    assert probes(PROBED[module]) == []


def test_the_probe_finder_sees_probes(tmp_path):
    src = tmp_path / "p.py"
    src.write_text(
        "a = getattr(lm, 'batch', None)\nb = hasattr(lm, 'x')\nc = isinstance(g, OrtGraph)\n"
        "d = isinstance(g, (int, approx.ApproxGraph))\ne = getattr(lm, 'batch')\nf = isinstance(g, int)\n"
        "class W:\n    def __getattr__(self, name):\n        return 0\n"
    )
    want = ["p.py:1 getattr", "p.py:2 hasattr", "p.py:3 isinstance OrtGraph", "p.py:4 isinstance ApproxGraph",
            "p.py:8 __getattr__"]  # fmt: skip
    assert probes(src) == want


RUNTIME = {m: p for m, p in MODULES.items() if m == "gpt2edge.runtime" or m.startswith("gpt2edge.runtime.")}


@pytest.mark.parametrize("module", sorted(RUNTIME))
def test_runtime_imports_nothing_above_it(module):
    bad = sorted(d for d in imported(RUNTIME[module]) for f in RUNTIME_FORBIDDEN if d == f or d.startswith(f + "."))
    assert bad == [], f"{module} imports {bad}"


def function_lengths(path: Path, root: Path = ROOT) -> dict[str, int]:
    """Body lines (from the first statement after the docstring to the end) of every function and method in
    the file, nested ones too, by qualified name."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]  # the docstring is not logic
                out[f"{prefix}.{child.name}"] = child.end_lineno - body[0].lineno + 1
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")

    visit(ast.parse(path.read_text(), str(path)), module_name(path, root))
    return out


FUNCTIONS = {f: n for p in MODULES.values() for f, n in function_lengths(p).items()}


def test_modules_fit_one_concern():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_functions_fit_a_screen():
    long = {f: n for f, n in FUNCTIONS.items() if n > MAX_FUNCTION_LINES and n > LONG_FUNCTIONS.get(f, (0,))[0]}
    assert long == {}, "split them, or list them in LONG_FUNCTIONS with the reason they are one function"


def test_the_long_function_list_is_current():
    stale = {f: FUNCTIONS.get(f) for f in LONG_FUNCTIONS if FUNCTIONS.get(f, 0) <= MAX_FUNCTION_LINES}
    assert stale == {}, "gone or within the cap now: take them off LONG_FUNCTIONS"


def test_function_lengths_count_the_body(tmp_path):
    """The counter could pass by seeing nothing: a method's body is counted without its signature and
    docstring, a nested function on its own too."""
    pkg = tmp_path / "gpt2edge"
    pkg.mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(90))
    head = 'class C:\n    def m(\n        self,\n    ):\n        """Doc."""\n        def inner():\n            pass\n'
    src = head + body
    (pkg / "a.py").write_text(src)
    assert function_lengths(pkg / "a.py", pkg) == {"gpt2edge.a.C.m": 92, "gpt2edge.a.C.m.inner": 1}


def _in(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


# the ground every layer stands on: it imports nothing above it (and onnx_io sits below manifest)
GROUND = (
    "gpt2edge.errors", "gpt2edge.api_args", "gpt2edge.manifest", "gpt2edge.folder", "gpt2edge.onnx_io",
    "gpt2edge.budget",
)  # fmt: skip
# rooms each room must not import: (room, forbidden rooms)
ONE_WAY = (
    ("gpt2edge.onnx_io", ("gpt2edge.manifest", "gpt2edge.folder")),
    ("gpt2edge.quality", ("gpt2edge.trim", "gpt2edge.quantize", "gpt2edge.sparse", "gpt2edge.convert")),
    # inside the runtime: the model below the decoding loops, the loops below speculative decoding
    # (runtime.model -> runtime.sparse_head is issue 32.2's: the graph factory moves above both)
    ("gpt2edge.runtime.model", ("gpt2edge.runtime.decoding", "gpt2edge.runtime.speculative")),
    ("gpt2edge.runtime.decoding", ("gpt2edge.runtime.speculative",)),
    # serve: hosting -> api -> scheduling -> runtime; serve.config (ServeConfig) beneath all three
    ("gpt2edge.serve.scheduling", ("gpt2edge.serve.api", "gpt2edge.serve.hosting")),
    ("gpt2edge.serve.api", ("gpt2edge.serve.hosting",)),
    ("gpt2edge.serve.config", ("gpt2edge.serve.api", "gpt2edge.serve.scheduling", "gpt2edge.serve.hosting")),
)
GRAPH = import_graph(MODULES)


def ground_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m in graph if _in(m, GROUND) for d in graph[m] if d != "gpt2edge" and not _in(d, GROUND))


def one_way_violations(graph: dict[str, set[str]], room: str, forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted((m, d) for m in graph if _in(m, (room,)) for d in graph[m] if _in(d, forbidden))


def test_the_ground_imports_nothing_above_it():
    assert ground_violations(GRAPH) == []


@pytest.mark.parametrize(("room", "forbidden"), ONE_WAY, ids=[room for room, _ in ONE_WAY])
def test_rooms_import_one_way(room, forbidden):
    assert one_way_violations(GRAPH, room, forbidden) == []


def test_the_room_rules_see_an_upward_import(tmp_path):
    """The rules could pass by matching nothing: a scheduling module importing the api lazily, and a budget
    module importing the runtime, must each be reported."""
    pkg = tmp_path / "gpt2edge"
    for d in ("serve/api", "serve/scheduling", "budget", "runtime"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "serve" / "api" / "protocol.py").write_text("class ApiError(Exception): ...\n")
    (pkg / "serve" / "scheduling" / "plan.py").write_text("def f():\n    from ..api.protocol import ApiError\n")
    (pkg / "budget" / "memory.py").write_text("from gpt2edge.runtime import x\n")
    graph = import_graph(modules_of(pkg), pkg)
    scheduling = dict(ONE_WAY)["gpt2edge.serve.scheduling"]
    found = one_way_violations(graph, "gpt2edge.serve.scheduling", scheduling)
    assert found == [("gpt2edge.serve.scheduling.plan", "gpt2edge.serve.api.protocol")]
    assert ground_violations(graph) == [("gpt2edge.budget.memory", "gpt2edge.runtime")]
