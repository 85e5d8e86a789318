"""`gpt2edge convert --format web` without a browser: the folder's contents and manifest, the graph the
browser computes (MatMulNBits at float accuracy, which the Python runtime then runs token for token), and
the refusals, each one line and nothing written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from web_helpers import WEB

import gpt2edge.convert.web as web
from gpt2edge.cli import main
from gpt2edge.convert import convert_folder
from gpt2edge.errors import ConvertError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model_folder import ModelFolder

needs_npm = pytest.mark.skipif(not (WEB / "node_modules" / "onnxruntime-web").is_dir(),
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
def test_matmulnbits_run_at_float_accuracy_and_python_runs_the_folder(int4_web):
    """The WASM kernel computes MatMulNBits in float32 whatever accuracy_level asks: the folder says so, and the
    Python runtime on it computes what the browser computes (test_web_browser checks the page against it)."""
    src, out = int4_web
    levels = [a.i for n in onnx.load(str(out / "model.onnx")).graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "accuracy_level"]  # fmt: skip
    assert levels and set(levels) == {0}
    record = json.loads((out / "manifest.json").read_text())["conversion"]
    assert record["rewritten"] == {"MatMulNBits.accuracy_level=0": len(levels)}
    r = Generator(out).generate("Hello", max_new_tokens=6, temperature=0)
    assert len(r.token_ids) == 6


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
