"""An export folder as a static web page: the graph in the form onnxruntime-web runs, the tokenizer, the
manifest, gpt2edge's JavaScript runtime (web/src), the page (web/index.html) and onnxruntime-web's,
@huggingface/tokenizers' and @mlc-ai/web-xgrammar's (the constraint engine: structured output) browser files,
copied from the npm packages that web/package-lock.json pins (no CDN at run time: the folder works offline on
any static file server).

What the browser runs (onnxruntime-web 1.30 WASM, checked in headless Chromium by tests/web/test_web_browser.py):
fp32, int8 and int4 graphs of both KV-cache kinds: GroupQueryAttention (--kv-cache shared), MatMulNBits (4 and
8 bits), GatherBlockQuantized (the quantized embedding lookup), FastGelu and LayerNormalization all have WASM
kernels. MatMulNBits is slow there, so it is rewritten (dequantize_matmulnbits below). fp16 graphs are refused
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
XGRAMMAR_DIR = "vendor/xgrammar"
# xgrammar's browser bundle (a UMD script with its WASM inlined), copied as vendor/xgrammar/xgrammar.js; the
# page's constraints.js imports it the first time a constraint is used (the package ships no LICENSE file: it is
# Apache-2.0 by its package.json, which the folder's manifest records with the version)
XGRAMMAR_FILES = ("lib/index.js",)
RUNTIME_FILES = (
    "constraints.js", "folder.js", "generator.js", "model.js", "page.js", "rng.js", "sampler.js", "text-stream.js",
)  # fmt: skip


def web_package_dir() -> Path:
    """Where gpt2edge's JS runtime and its pinned npm files are: the installed package's data (gpt2edge/_web,
    which setup.py's build hook puts in the wheel), else a source checkout's web/ folder."""
    from importlib.resources import files

    installed = files("gpt2edge") / "_web"
    if installed.is_dir() and (installed / "package.json").is_file():
        return Path(str(installed))
    return Path(__file__).resolve().parents[2] / "web"


@dataclass
class WebConversion:
    page: str
    runtime: str
    onnxruntime_web: str
    tokenizers: str
    xgrammar: str = ""  # @mlc-ai/web-xgrammar's version (structured output in the page)
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
    if folder.precision != "fp16" and folder.graph.kv_dtype != "float32":
        raise ConvertError(
            f"{src} has its KV cache in {folder.graph.kv_dtype} (--kv-dtype); the web runtime feeds a float32 cache. "
            "Convert an export or variant made without --kv-dtype (--kv-dtype fp32)."
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
            f"gpt2edge's web runtime is not at {web}: this install has no gpt2edge/_web (the wheel carries it; an "
            "editable install uses the checkout's web/): reinstall from a wheel, or run bash scripts/setup.sh."
        )
    files = {PAGE: web / PAGE, "serve.py": web / "serve.py"}
    files.update({f"{RUNTIME_DIR}/{n}": web / "src" / n for n in RUNTIME_FILES})
    files.update({f"{ORT_DIR}/{n}": modules / "onnxruntime-web" / "dist" / n for n in ORT_FILES})
    tokenizers = modules / "@huggingface" / "tokenizers"
    files.update({f"{TOKENIZERS_DIR}/{Path(n).name}": tokenizers / n for n in TOKENIZERS_FILES})
    xgrammar = modules / "@mlc-ai" / "web-xgrammar"
    files.update({f"{XGRAMMAR_DIR}/xgrammar.js": xgrammar / n for n in XGRAMMAR_FILES})
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ConvertError(
            f"{missing[0]} is missing: the web runtime's npm packages are not installed; run `npm ci` in {web} "
            "(scripts/setup.sh does)."
        )
    return files


def _package_version(name: str) -> str:
    return json.loads((web_package_dir() / "node_modules" / name / "package.json").read_text())["version"]


def dequantize_matmulnbits(model) -> int:
    """Replace each MatMulNBits (com.microsoft) by MatMul on a weight that plain ONNX ops dequantize from the
    same int8/int4 codes; returns how many nodes were replaced.

    onnxruntime-web's WASM build has no fast MatMulNBits kernel (its fallback makes an int8 GPT-2 several times
    slower than fp32 there). The codes stay in the file as they were (one byte, or two 4-bit codes per byte),
    so the download keeps the quantized size; the weight is (codes - zero point) x scale per block, computed
    in float32 by Cast/Sub/Mul (and BitwiseAnd/BitShift for 4-bit codes) on initializers only, which ONNX
    Runtime's constant folding evaluates once when the session is created: each step runs a float32 MatMul."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    replaced = 0
    for idx in reversed(range(len(g.node))):
        node = g.node[idx]
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        K, N, bits, block = int(a["K"]), int(a["N"]), int(a.get("bits", 4)), int(a["block_size"])
        ins = list(node.input) + [""] * (6 - len(node.input))
        if ins[4] or any(n and n not in inits for n in (ins[1], ins[2], ins[3], ins[5])):
            raise ConvertError("A MatMulNBits node has computed weights or g_idx; quantize the export with gpt2edge.")
        nb = -(-K // block)
        codes = numpy_helper.to_array(inits[ins[1]]).reshape(N, nb, block * bits // 8).transpose(1, 2, 0)
        scale = numpy_helper.to_array(inits[ins[2]]).astype(np.float32).reshape(N, nb).T[:, None, :]  # (nb, 1, N)
        if ins[3]:
            zp = numpy_helper.to_array(inits[ins[3]])
            if zp.dtype != np.uint8:
                raise ConvertError("A MatMulNBits node has float zero points; quantize the export with gpt2edge.")
            zp = zp.reshape(N, -1)
            if bits == 4:
                zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(N, -1)
            zp = np.ascontiguousarray(zp[:, :nb].T[:, None, :])  # (nb, 1, N) uint8
        else:
            zp = np.full((nb, 1, N), 1 << (bits - 1), np.uint8)
        b = _Nodes(g, f"{node.name or 'matmulnbits'}_{idx}_web")
        const, op = b.const, b.op
        packed = const("codes", np.ascontiguousarray(codes))  # (nb, block * bits / 8, N) uint8
        if bits == 4:  # two codes per byte, low nibble first: (nb, block/2, 2, N) -> (nb, block, N)
            lo = op("BitwiseAnd", [packed, const("mask", np.array(15, np.uint8))])
            hi = op("BitShift", [packed, const("shift", np.array(4, np.uint8))], direction="RIGHT")
            axis = const("axis", np.array([2], np.int64))
            pair = op("Concat", [op("Unsqueeze", [lo, axis]), op("Unsqueeze", [hi, axis])], axis=2)
            packed = op("Reshape", [pair, const("blocks", np.array([nb, block, N], np.int64))])
        real = op("Cast", [packed], to=TensorProto.FLOAT)
        zero_point = op("Cast", [const("zero_point", zp)], to=TensorProto.FLOAT)
        w = op("Mul", [op("Sub", [real, zero_point]), const("scale", scale)])  # (nb, block, N)
        w = op("Reshape", [w, const("shape", np.array([nb * block, N], np.int64))])
        if nb * block != K:  # the last block was padded
            zero, k = const("start", np.array([0], np.int64)), const("end", np.array([K], np.int64))
            w = op("Slice", [w, zero, k, zero])
        y = op("MatMul", [ins[0], w])
        if ins[5]:
            op("Add", [y, ins[5]])
        b.nodes[-1].output[0] = node.output[0]
        g.node.remove(node)
        for j, n in enumerate(b.nodes):
            g.node.insert(idx + j, n)
        replaced += 1
    _drop_unused_initializers(model)
    return replaced


class _Nodes:
    """New nodes and initializers for one replaced node, named after it."""

    def __init__(self, graph, prefix: str):
        self.graph, self.prefix, self.nodes = graph, prefix, []

    def const(self, name: str, value) -> str:
        import numpy as np
        from onnx import numpy_helper

        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), f"{self.prefix}_{name}"))
        return f"{self.prefix}_{name}"

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        from onnx import helper

        out = f"{self.prefix}_{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out


def _drop_unused_initializers(model) -> None:
    g = model.graph
    used = {n for node in g.node for n in node.input} | {o.name for o in g.output}
    for init in [i for i in g.initializer if i.name not in used]:
        g.initializer.remove(init)


def write_web(folder, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The converter's writer: the graph (rewritten where the browser needs it) and the page's static files."""
    import onnx

    from gpt2edge.quantize.graph import save_model

    graph = folder.manifest["graph"]
    model = onnx.load(str(folder.graph_path))
    n = dequantize_matmulnbits(model)
    rewritten = {"MatMulNBits": n} if n else {}
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
        xgrammar=_package_version("@mlc-ai/web-xgrammar"),
        rewritten=rewritten,
    )
    return {"file": files[0], "files": files, "format": "web"}, record.to_json()
