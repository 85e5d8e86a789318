"""`gpt2edge convert --format web` without a browser: the folder's contents and manifest, the graph the
browser runs (MatMulNBits rewritten as dequantize + MatMul, which the Python runtime runs too), and the
refusals, each one line and nothing written."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

import gpt2edge.convert.web as web
from gpt2edge.cli import main
from gpt2edge.convert import convert_folder
from gpt2edge.errors import ConvertError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.folder import ModelFolder
from tests.support.web_helpers import WEB

needs_npm = pytest.mark.skipif(not os.environ.get("CI") and not (WEB / "node_modules" / "onnxruntime-web").is_dir(),
                               reason="web/node_modules missing (bash scripts/setup.sh runs npm ci)")  # fmt: skip


@pytest.fixture(scope="module")
def int4_web(tiny_export_shared, tmp_path_factory) -> tuple[Path, Path]:
    from gpt2edge.quantize import make_recipe, quantize_model

    root = tmp_path_factory.mktemp("webconv")
    quantize_model(tiny_export_shared, root / "int4", make_recipe("int4"), report=False)
    convert_folder(root / "int4", root / "web", "web")
    return root / "int4", root / "web"


@needs_npm
def test_folder_is_self_contained_and_verified(int4_web):
    src, out = int4_web
    m = json.loads((out / "manifest.json").read_text())
    assert m["graph"]["format"] == "web" and m["conversion"]["format"] == "web"
    lock = json.loads((WEB / "package-lock.json").read_text())["packages"]
    assert m["conversion"]["onnxruntime_web"] == lock["node_modules/onnxruntime-web"]["version"]
    for name in ["index.html", "serve.py", "gpt2edge-web/page.js", "gpt2edge-web/rng.js", "tokenizer.json",
                 "vendor/ort/ort.wasm.min.mjs", "vendor/ort/ort-wasm-simd-threaded.wasm",
                 "vendor/tokenizers/tokenizers.min.mjs"]:  # fmt: skip
        assert name in m["files"], name  # checksummed like the graph: the page checks what it loads
    # nothing is fetched from elsewhere at run time (no CDN)
    remote = re.compile(r"""(src=|href=|import\(|from )\s*["']https?:""")
    for page in [out / "index.html", *sorted((out / "gpt2edge-web").glob("*.js"))]:
        assert not remote.search(page.read_text()), page
    ModelFolder.open(out, verify=True)  # every checksum holds


@needs_npm
def test_matmulnbits_become_folded_dequantize_and_matmul(int4_web):
    """onnxruntime-web's WASM MatMulNBits is slow: the web graph has a float32 MatMul on weights that plain ops
    dequantize from the same 4-bit codes (folded once at load), so the file keeps the int4 size; the Python
    runtime on the folder gives the tokens the source folder gives (the page is checked against it)."""
    src, out = int4_web
    ops = [n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node]
    n_src = [n.op_type for n in onnx.load(str(src / "model.onnx")).graph.node].count("MatMulNBits")
    assert "MatMulNBits" not in ops and n_src > 0 and ops.count("BitShift") == n_src - 1  # the head is 8-bit
    record = json.loads((out / "manifest.json").read_text())["conversion"]
    assert record["rewritten"] == {"MatMulNBits": n_src}
    assert (out / "model.onnx").stat().st_size < 1.3 * (src / "model.onnx").stat().st_size  # still int4-sized
    prompts = ["Hello", "The river rose and"]
    web_ids = [r.token_ids for r in Generator(out).generate(prompts, max_new_tokens=8, temperature=0)]
    src_ids = [r.token_ids for r in Generator(src).generate(prompts, max_new_tokens=8, temperature=0)]
    assert sum(a == b for a, b in zip(web_ids, src_ids)) >= 1  # float vs int8-activation kernels: near ties may flip


def test_refusals_write_nothing(tiny_checkpoint, tiny_export, int4_web, tmp_path):
    from gpt2edge.export import export_model
    from gpt2edge.quantize import make_recipe, quantize_model

    tail = tmp_path / "tail"
    export_model(str(tiny_checkpoint), tail, head="tail", run_validation=False, log=None)
    fp16 = tmp_path / "fp16"
    quantize_model(tiny_export, fp16, make_recipe("fp16"), report=False)
    for src, words in [(tail, "--head last"), (fp16, "int8"), (int4_web[1], "already a converted")]:
        out = tmp_path / f"out-{src.name}"
        with pytest.raises(ConvertError, match=words) as e:
            convert_folder(src, out, "web")
        assert "\n" not in str(e.value)
        assert not out.exists()


def test_missing_npm_packages_is_one_line(tiny_export, tmp_path, monkeypatch):
    fake = tmp_path / "web"
    fake.mkdir()
    (fake / "package.json").write_text("{}")
    monkeypatch.setattr(web, "web_package_dir", lambda: fake)
    result = CliRunner().invoke(main, ["convert", str(tiny_export), "-o", str(tmp_path / "o"), "--format", "web"])
    assert result.exit_code != 0 and "npm ci" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()
