"""The how-to pages' Python blocks run as written, on the tiny session export, and give gpt2edge's own greedy tokens:
docs/genai.md (onnxruntime-genai's loop on a converted folder) and docs/optimum.md (the ONNX Runtime loop an
Optimum user knows; its ORTModelForCausalLM block where optimum is installed)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from docs_markdown import DOCS, fenced_blocks

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
