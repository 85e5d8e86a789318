"""The docs' Python blocks run as written, on the tiny session export: the how-tos give gpt2edge's own greedy
tokens (docs/genai.md: onnxruntime-genai's loop on a converted folder; docs/optimum.md: the ONNX Runtime loop an
Optimum user knows, and its ORTModelForCausalLM block where optimum is installed); docs/generate.md's API examples
run; every Python block in README.md and docs/ parses and its `from gpt2edge... import` names exist."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import textwrap
from pathlib import Path

import pytest

from tests.support.docs_markdown import DOCS, ROOT, doc_files, fenced_blocks

PROMPT = "The weather today"  # the pages' prompt
N_NEW = 32  # the pages' number of new tokens


def python_blocks(page: str) -> list[str]:
    return ["\n".join(b.lines) for b in fenced_blocks(DOCS / page) if b.lang == "python"]


def run_block(code: str, folder_in_doc: str, folder: Path) -> tuple[dict, str]:
    assert f'"{folder_in_doc}"' in code, f"the block no longer names {folder_in_doc}"
    namespace: dict = {"__name__": "__docs__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(f'"{folder_in_doc}"', repr(str(folder))), "<docs>", "exec"), namespace)
    return namespace, out.getvalue()


@pytest.fixture(scope="module")
def greedy(tiny_export):
    from gpt2edge.runtime import Generator

    return Generator(tiny_export).generate(PROMPT, max_new_tokens=N_NEW, do_sample=False)


@pytest.fixture(scope="module")
def genai_folder(tiny_export, tmp_path_factory) -> Path:
    from gpt2edge.convert.handler import convert_folder

    out = tmp_path_factory.mktemp("howto") / "gpt2-genai"
    convert_folder(tiny_export, out, "genai")
    return out


def test_the_genai_page_loop_runs_and_matches_gpt2edge(genai_folder, greedy):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    (code,) = python_blocks("genai.md")
    ns, printed = run_block(code, "out/gpt2-genai", genai_folder)
    assert [int(t) for t in ns["new_ids"]] == greedy.token_ids
    assert printed.strip()  # it streamed text


def test_the_optimum_page_onnxruntime_loop_matches_gpt2edge(tiny_export, greedy):
    ort_block = python_blocks("optimum.md")[0]
    assert "optimum" not in ort_block.split("import onnxruntime")[0]  # the torch-free block comes first
    ns, printed = run_block(ort_block, "out/gpt2", tiny_export)
    assert ns["new_ids"] == greedy.token_ids
    assert printed.rstrip("\n") == ns["tokenizer"].decode(greedy.token_ids)


def test_the_optimum_page_ortmodel_block(genai_folder, greedy):
    pytest.importorskip("optimum.onnxruntime", reason="optimum not installed (not a gpt2edge dependency)")
    block = python_blocks("optimum.md")[1]
    ns, _ = run_block(block, "out/gpt2-genai", genai_folder)
    assert ns["out"][0, ns["inputs"].input_ids.shape[1] :].tolist() == greedy.token_ids


def test_the_generate_page_python_blocks_run(tiny_export, tmp_path, monkeypatch):
    # docs/generate.md's API examples, in order in one namespace (the beam block uses the first block's `gen`);
    # run in a temp folder: the session block saves a file to the current directory
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__docs__"}
    blocks = python_blocks("generate.md")
    assert len(blocks) >= 3
    for code in blocks:
        code = textwrap.dedent(code).replace('"out/gpt2"', repr(str(tiny_export)))
        if "Generator" in code and "import Generator" not in code:
            code = "from gpt2edge.runtime import Generator\n" + code
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "<docs/generate.md>", "exec"), ns)
    assert len(ns["top2"]) == 2 and len(ns["draws"]) == 2 and len(ns["draws"][0]) == 3
    assert ns["best"].sequence_score is not None


def test_every_python_block_compiles_and_its_gpt2edge_imports_resolve():
    bad = []
    for path in doc_files():
        for block in fenced_blocks(path):
            if block.lang not in ("python", "py"):
                continue
            where = f"{path.relative_to(ROOT)}:{block.line}"
            try:
                tree = ast.parse(textwrap.dedent("\n".join(block.lines)))
            except SyntaxError as e:
                bad.append(f"{where}: {e}")
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gpt2edge":
                    module = importlib.import_module(node.module)
                    bad += [f"{where}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert bad == []
