"""An export folder as a static web page: the graph in the form onnxruntime-web runs, the tokenizer, the
manifest, gpt2edge's JavaScript runtime (web/src), the page (web/index.html) and onnxruntime-web's and
@huggingface/tokenizers' browser files, copied from the npm packages that web/package-lock.json pins (no CDN
at run time: the folder works offline on any static file server).

What the browser runs (onnxruntime-web 1.30 WASM, checked in headless Chromium by tests/test_web_browser.py):
fp32, int8 and int4 graphs of both KV-cache kinds: GroupQueryAttention (--kv-cache shared), MatMulNBits (4 and
8 bits), GatherBlockQuantized (the quantized embedding lookup), FastGelu and LayerNormalization all have WASM
kernels, so the graph is kept as it is but for one attribute (float_accuracy below). fp16 graphs are refused
(the runtime feeds a float32 KV cache).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpt2edge.errors import ConvertError

PAGE = "index.html"
RUNTIME_DIR = "gpt2edge-web"  # the JS runtime's modules, next to the page
ORT_DIR = "vendor/ort"
TOKENIZERS_DIR = "vendor/tokenizers"
# onnxruntime-web's browser files: the WASM-only build and the WebGPU build, each with its loader and binary
ORT_FILES = (
    "ort.wasm.min.mjs",
    "ort-wasm-simd-threaded.mjs",
    "ort-wasm-simd-threaded.wasm",
    "ort.webgpu.min.mjs",
    "ort-wasm-simd-threaded.asyncify.mjs",
    "ort-wasm-simd-threaded.asyncify.wasm",
)
TOKENIZERS_FILES = ("dist/tokenizers.min.mjs", "LICENSE")
RUNTIME_FILES = ("folder.js", "generator.js", "model.js", "page.js", "rng.js", "sampler.js", "text-stream.js")


def web_package_dir() -> Path:
    """The repository's web/ folder (gpt2edge's JS runtime and its npm packages)."""
    return Path(__file__).resolve().parents[2] / "web"


@dataclass
class WebConversion:
    page: str
    runtime: str
    onnxruntime_web: str
    tokenizers: str
    rewritten: dict[str, int] = field(default_factory=dict)  # what was changed in the graph -> how many nodes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_web(folder, src: Path) -> None:
    """Refuse, in one line naming what to use instead, a folder the page cannot run."""
    if folder.head == "tail":
        raise ConvertError(
            f"{src} is a --head tail export (a logits_to_keep input for speculative decoding, which the page does "
            "not do); convert a --head last export of the same checkpoint."
        )
    if folder.info.vocab is not None:
        raise ConvertError(
            f"{src} is vocabulary-trimmed; the web runtime samples over the full vocabulary. Convert the untrimmed "
            "folder it came from."
        )
    if folder.precision == "fp16" or folder.graph.kv_dtype != "float32":
        raise ConvertError(
            f"{src} is an fp16 export; the web runtime runs graphs with a float32 KV cache. Convert the fp32 "
            "export, or its int8/int4 variant (`gpt2edge quantize --mode int8`), which is also smaller."
        )
    _package_files()  # the npm packages are installed: before any work


def _package_files() -> dict[str, Path]:
    """Destination (relative to the new folder) -> source path of every static file the page needs."""
    web = web_package_dir()
    modules = web / "node_modules"
    if not (web / "package.json").is_file():
        raise ConvertError(
            f"gpt2edge's web runtime is not at {web}; `convert --format web` runs from a source checkout (git clone, "
            "then bash scripts/setup.sh)."
        )
    files = {PAGE: web / PAGE, "serve.py": web / "serve.py"}
    files.update({f"{RUNTIME_DIR}/{n}": web / "src" / n for n in RUNTIME_FILES})
    files.update({f"{ORT_DIR}/{n}": modules / "onnxruntime-web" / "dist" / n for n in ORT_FILES})
    tokenizers = modules / "@huggingface" / "tokenizers"
    files.update({f"{TOKENIZERS_DIR}/{Path(n).name}": tokenizers / n for n in TOKENIZERS_FILES})
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ConvertError(
            f"{missing[0]} is missing: the web runtime's npm packages are not installed; run `npm ci` in {web} "
            "(scripts/setup.sh does)."
        )
    return files


def _package_version(name: str) -> str:
    return json.loads((web_package_dir() / "node_modules" / name / "package.json").read_text())["version"]


def float_accuracy(model) -> int:
    """Set every MatMulNBits' accuracy_level to 0 (float32 compute); returns how many nodes changed.

    onnxruntime-web's WASM build computes MatMulNBits in float32 whatever the level asks (level 4, int8
    activations, is an x86/ARM kernel), so the level the browser honours is written into the graph: the
    Python runtime then computes what the page computes, and the page's greedy ids can be checked against it."""
    changed = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for a in node.attribute:
                if a.name == "accuracy_level" and a.i != 0:
                    a.i = 0
                    changed += 1
    return changed


def write_web(folder, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The converter's writer: the graph (rewritten where the browser needs it) and the page's static files."""
    import onnx

    from gpt2edge.quantize.graph import save_model

    graph = folder.manifest["graph"]
    model = onnx.load(str(folder.graph_path))
    n = float_accuracy(model)
    rewritten = {"MatMulNBits.accuracy_level=0": n} if n else {}
    files = save_model(model, tmp / graph["file"])
    del model
    for dest, source in _package_files().items():
        (tmp / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, tmp / dest)
    record = WebConversion(
        page=PAGE,
        runtime=RUNTIME_DIR,
        onnxruntime_web=_package_version("onnxruntime-web"),
        tokenizers=_package_version("@huggingface/tokenizers"),
        rewritten=rewritten,
    )
    return {"file": files[0], "files": files, "format": "web"}, record.to_json()
