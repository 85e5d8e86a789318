"""The tests' own shape, read with ast (no imports): every test file sits in a room folder that docs/layout.md
maps, every folder is a package (two rooms may hold files of the same name), and no test imports another test
file (shared helpers live in tests/support/, fixtures in tests/conftest.py) or a private name of gpt2edge (test
the public surface, or make the name public)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LAYOUT = TESTS.parent / "docs" / "layout.md"


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path, src: str) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in `src` (the file at `path`), at any depth."""
    out = []
    for node in ast.walk(ast.parse(src, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts[: -node.level or None])
            module = ".".join(x for x in (base if node.level else "", node.module or "") if x)
            out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def _violations(path: Path, src: str, stems: set[str]) -> list[str]:
    """The imports of one file that the rule refuses, each with its line and why."""
    where, bad = path.relative_to(TESTS.parent), []
    for line, module, names in _imports(path, src):
        parts = module.split(".")
        if parts[0] == "tests" and any(m.startswith("test_") for m in parts[1:] + names):
            bad.append(f"{where}:{line}: imports a test file ({module}); shared helpers go in tests/support/")
        elif parts[0] in stems or parts[0].startswith("test_"):
            bad.append(f"{where}:{line}: imports a sibling by bare name ({module}); use tests.support")
        if parts[0] == "gpt2edge":
            private = [p for p in parts[1:] if p.startswith("_") and p != "__init__"]
            private += [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{where}:{line}: imports a private name of {module}: {private}")
    return bad


def test_every_test_file_is_in_a_mapped_room():
    layout = LAYOUT.read_text()
    stray = [p.name for p in TESTS.glob("test_*.py")]
    assert not stray, f"test files outside a room (move them into tests/ROOM/, docs/layout.md): {stray}"
    rooms = sorted(p.parent.name for p in TESTS.glob("*/test_*.py"))
    unmapped = sorted({r for r in rooms if f"tests/{r}/" not in layout})
    assert not unmapped, f"rooms that docs/layout.md does not map: {unmapped}"


def test_every_folder_is_a_package():
    folders = {p.parent for p in _sources()}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"folders without __init__.py (same-named test files would clash): {missing}"


def test_no_test_imports_another_test_file_or_a_private_name():
    stems = {p.stem for p in _sources()}
    bad = [v for p in _sources() for v in _violations(p, p.read_text(), stems)]
    assert not bad, "\n".join(bad)


def test_the_rule_refuses_each_form():
    """Each forbidden form is caught, and the allowed ones pass (a rule that cannot fail proves nothing)."""
    probe = TESTS / "house" / "probe.py"  # read as if it sat here, so relative imports resolve; never written
    refused = [
        "from tests.serve.test_serve import post",
        "from . import test_layout",
        "import tests.cli.test_ease_cli",
        "from test_serve import post",
        "from web_helpers import WEB",
        "from gpt2edge.folder.temp import _start_token",
        "from gpt2edge.runtime.sparse_head._certify import x",
    ]
    for line in refused:
        assert _violations(probe, line, {"web_helpers", "test_serve"}), line
    allowed = (
        "from tests.support import cli\nfrom tests.support.serve import post\nfrom gpt2edge.folder.temp import host_tag"
    )
    assert _violations(probe, allowed, {"web_helpers", "test_serve"}) == []
