"""quantize_model: an fp32 export folder -> a new, atomically written export folder in fp16 / int8 / int4.

The handler only checks the request, calls the pure rewrite (half.py, weight_only.py), copies the tokenizer
and configs, measures the quality report against the parent, and writes the manifest.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

import gpt2edge
from gpt2edge.errors import QuantizeError
from gpt2edge.extras import require_extra
from gpt2edge.folder import atomic_output_dir
from gpt2edge.folder_checks import check_output_dir, check_sources
from gpt2edge.manifest import graph_files, load_manifest, resolve_inside, verify_files, write_manifest
from gpt2edge.onnx_stats import decode_weight_bytes
from gpt2edge.resources import check_need, quantize_need

# bits of the widest tensor each precision stores; a variant can only be made from a wider parent
WIDTH = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}
MODES = ("fp16", "int8", "int4")
# Block sizes and zero points chosen by measurement on a 2-core AMD Zen 4 (AVX-512 VNNI), GPT-2 small shape
# (benchmarks/README.md, "int4 against llama.cpp Q4_0"): ONNX Runtime's int8-activation kernels are partly
# compute-bound, the per-block work costs more than the bytes saved by small blocks. int4 at block 256 decodes
# faster than at 32 (the layers' matmuls 1.95 vs 2.83 ms a step) and its 128-token prefill matmuls run faster
# than int8's (55 vs 58 ms; block 32: 86 ms); zero points cost nothing there and lower the error.
DEFAULT_BLOCK_SIZE = {"int8": 128, "int4": 256}
# the tied head at 8 bits: int8 uses its own block; int4's at 256 (~0.2 ms a step less than at 128)
HEAD8_BLOCK_SIZE = {"int8": 128, "int4": 256}
# MatMulNBits' compute types: 0 as the input (float), 1 fp32, 2 fp16, 3 bf16, 4 int8 activations;
# 4 is ~2x faster than the float path (levels 0/1) here, and ~40x on AVX2 without VNNI
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
DEFAULT_ACCURACY_LEVEL = 4
HEAD_BITS = (4, 8)
# zero points (asymmetric) by default: at block 128/256 the kernels run as fast with them as without on
# AVX-512 VNNI, and the error is lower; --symmetric drops them (llama.cpp Q4_0's form; on AVX2 without VNNI
# the 4-bit kernel ran ~20 % faster without them)
DEFAULT_SYMMETRIC = {"int8": False, "int4": False}


@dataclass
class Recipe:
    mode: str
    block_size: int | None = None
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    head_bits: int | None = None  # None: head/embedding stay fp32
    symmetric: bool = False  # no zero points: code * scale (every table, the head's too)
    head_block: int | None = None  # the tied table's block once fitted to n_embd (None: the asked one)
    position_block: int | None = None  # the position table's block once fitted to n_embd
    block_defaulted: bool = False  # block_size is the mode's default, not asked for: fitted() may shrink it
    target: str | None = None  # the CPU the defaults were chosen for (targets.py); None: the built-in defaults
    int8_op: str = "MatMulNBits"  # int8 layers: weight-only MatMulNBits, or DynamicQuantizeMatMul (u8s8 GEMM)

    @property
    def weight_bits(self) -> int | None:
        """Bits of the weight matrices (int8 / int4); None for fp16."""
        return {"int8": 8, "int4": 4}.get(self.mode)

    @property
    def head_block_size(self) -> int | None:
        """An 8-bit head uses its mode's head block (scales cost 4 bytes per block); a 4-bit head the main one;
        fitted, the largest power of two up to that which divides n_embd."""
        if self.head_bits is None:
            return None
        if self.head_block is not None:
            return self.head_block
        return HEAD8_BLOCK_SIZE[self.mode] if self.head_bits == 8 else self.block_size

    def fitted(self, n_embd: int, n_inner: int | None = None) -> Recipe:
        """The recipe as the graph will hold it: an embedding table's rows are dequantized whole, so its block
        is the largest power of two up to the asked one that divides n_embd; a width none of 16..256 divides is
        refused here, before any work. A default block_size shrinks likewise to divide every matrix's rows
        (n_embd and n_inner), so no block is padded (gpt2-xl's 1600: 64, not 256 with 12 % padding); one the
        user asked for is kept (rows are padded to whole blocks)."""
        from gpt2edge.quantize.primitives import BLOCK_SIZES, POSITION_BLOCK_SIZE, embedding_block_size

        if self.mode == "fp16":
            return self
        fit = self
        if self.block_defaulted:
            rows = [n_embd, n_inner or 4 * n_embd]
            block = min([self.block_size, *(k & -k for k in rows)])  # the largest power of two dividing each
            if block >= BLOCK_SIZES[0]:
                fit = replace(self, block_size=block)
        head = None if fit.head_bits is None else embedding_block_size(n_embd, fit.head_block_size)
        return replace(fit, head_block=head, position_block=embedding_block_size(n_embd, POSITION_BLOCK_SIZE))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.mode != "fp16":
            out.update(
                weight_bits=self.weight_bits,
                block_size=self.block_size,
                accuracy_level=self.accuracy_level,
                head_bits=self.head_bits,
                head_block_size=self.head_block_size,
                position_table_bits=8,
                position_table_block_size=self.position_block,
                symmetric=self.symmetric,
                op="com.microsoft.MatMulNBits",
            )
            if self.int8_op != "MatMulNBits":
                out.update(layer_op=f"com.microsoft.{self.int8_op}", layer_quantization="per-column int8, symmetric")
        else:
            out.update(fp32_ops=["LayerNormalization", "Softmax", "LogSoftmax", "MLP GELU"], kv_dtype="float16")
        if self.target is not None:
            out["target"] = self.target
        return out


def make_recipe(
    mode: str,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    head_bits: int | None = None,
    keep_head_fp32: bool = False,
    symmetric: bool | None = None,
    target: str | None = None,
) -> Recipe:
    """Validate the options of a mode and fill in its defaults: the built-in ones, or `target`'s (a name of
    targets.TARGETS; "native": this machine's, probed). An option given explicitly always wins."""
    from gpt2edge.quantize.primitives import check_block_size
    from gpt2edge.quantize.targets import RECIPES, check_target

    if mode not in MODES:
        raise QuantizeError(f"Unknown mode '{mode}'; choose one of {', '.join(MODES)}.")
    if target is not None:
        target = check_target(None if target == "native" else target)  # an unknown name: refused here
    if mode == "fp16":
        if any(x is not None for x in (block_size, accuracy_level, head_bits, symmetric)) or keep_head_fp32:
            raise QuantizeError(
                "--block-size, --accuracy-level, --head-bits, --keep-head-fp32 and --symmetric/--asymmetric apply "
                "to int8/int4, not fp16."
            )
        return Recipe("fp16", target=target)
    tuned = RECIPES.get(target) if target is not None else None
    block_defaulted = block_size is None
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE[mode]
        if tuned is not None:
            block_size = tuned.int4_block if mode == "int4" else tuned.int8_block
    check_block_size(block_size)
    if accuracy_level is None:
        accuracy_level = DEFAULT_ACCURACY_LEVEL if tuned is None else tuned.accuracy_level
    if accuracy_level not in ACCURACY_LEVELS:
        raise QuantizeError(f"--accuracy-level must be 0..4, got {accuracy_level}.")
    if keep_head_fp32 and head_bits is not None:
        raise QuantizeError("Give either --keep-head-fp32 or --head-bits, not both.")
    if head_bits not in (None, *HEAD_BITS):
        raise QuantizeError(f"--head-bits must be 4 or 8, got {head_bits}.")
    if mode == "int8" and head_bits == 4:
        raise QuantizeError("--head-bits 4 is for int4; an int8 model keeps its head at 8 bits or fp32.")
    if symmetric is None:
        symmetric = DEFAULT_SYMMETRIC[mode] if tuned is None or mode != "int4" else tuned.int4_symmetric
    if head_bits is None and tuned is not None and not keep_head_fp32:
        head_bits = tuned.head_bits
    head_bits = None if keep_head_fp32 else (8 if head_bits is None else head_bits)
    int8_op = tuned.int8_op if tuned is not None and mode == "int8" else "MatMulNBits"
    return Recipe(
        mode,
        block_size,
        accuracy_level,
        head_bits,
        symmetric,
        block_defaulted=block_defaulted,
        target=target,
        int8_op=int8_op,
    )


def quantize_model(
    src: Path,
    out: Path,
    recipe: Recipe,
    *,
    force: bool = False,
    text: str | None = None,
    report: bool = True,
    log=sys.stderr,
) -> dict[str, Any]:
    """Write the `recipe` variant of export folder `src` to `out`; returns the new manifest."""
    require_extra("quantize", "quantize")
    import onnx

    from gpt2edge.quality import check_report_text, compare_folders, print_report

    src, out = Path(src), Path(out)
    info = load_manifest(src)  # every path it names stays inside src
    parent = dict(info.raw)
    if info.graph.format != "onnx":  # .ort / genai folders (gpt2edge convert)
        origin = parent.get("conversion", {}).get("parent", {}).get("path", "?")
        raise QuantizeError(f"{src} is a converted folder; quantize the .onnx export it came from ({origin}).")
    check_sources(out, [src])  # -o equal to, inside or holding MODEL_DIR: --force would delete the input
    if info.graph.static is not None:
        raise QuantizeError(
            f"{src} is a static-shape export (--static): its two graphs share one weights file, which these "
            "rewrites do not keep; quantize for the target NPU with its own tools (see docs/export.md, Static shapes)."
        )
    precision = info.graph.precision
    if precision != "fp32":
        hint = "it would not shrink it" if WIDTH[recipe.mode] >= WIDTH.get(precision, 0) else "errors would compound"
        raise QuantizeError(
            f"{src} is already {precision}; quantizing it to {recipe.mode} is refused ({hint}). "
            f"Quantize its fp32 parent ({parent.get('quantization', {}).get('parent', {}).get('path', '?')})."
        )
    if info.graph.head != "last":
        raise QuantizeError(
            f"{src} is a --head {info.graph.head} export; quantize a generation export (--head last) of the same "
            "checkpoint."
        )
    if recipe.mode == "fp16" and info.graph.kv_cache == "shared":
        raise QuantizeError(
            f"{src} is a shared-cache export (the CPU fast path); fp16 would put casts around its in-place cache. "
            "Make fp16 from a --kv-cache concat export, or use int8/int4 here."
        )
    # the blocks as the graph will hold them (tables, a default block fitted to the rows), or refused now
    recipe = recipe.fitted(info.dims.n_embd, info.dims.n_inner)
    check_output_dir(out, force, sources=[src])
    if report:
        check_report_text(src, text)  # an empty or one-token --text, refused before the work
    parent_bytes = sum(parent["files"][f]["size"] for f in graph_files(parent))
    check_need(quantize_need(parent_bytes, recipe.mode, report), out)  # before any work: memory and disk
    verify_files(src, info)

    with tqdm(
        total=3 if report else 2,
        desc=f"quantize {recipe.mode}",
        unit="step",
        file=sys.stderr,
        leave=False,
        disable=None,
    ) as bar:
        graph_path = resolve_inside(src, info.graph.file)
        if recipe.mode == "fp16":
            from gpt2edge.quantize.half import to_fp16

            variant = to_fp16(onnx.load(str(graph_path)))  # ONNX Runtime's converter wants every weight loaded
        else:
            from gpt2edge.onnx_stream import load_graph
            from gpt2edge.quantize.weight_only import quantize_weights

            # streamed: the graph without its external data; each matrix is read when it is quantized
            variant = quantize_weights(
                load_graph(graph_path),
                recipe.weight_bits,
                recipe.block_size,
                recipe.head_bits,
                recipe.head_block_size or 0,
                recipe.accuracy_level,
                recipe.symmetric,
                layer_op=recipe.int8_op,
                base_dir=graph_path.parent,
                in_place=True,
            )
        bar.update()
        with atomic_output_dir(out, force=force, sources=[src]) as tmp:
            from gpt2edge.quantize.graph import write_variant

            files = write_variant(variant, info, src, tmp)
            del variant
            bar.update()
            manifest = write_manifest(tmp, _variant_manifest(parent, src, recipe, files, tmp))
            if report:
                # measured on the finished folder, exactly as the runtime will load it
                bar.set_postfix_str("quality report")
                manifest["quality"] = compare_folders(src, tmp, text=text, variant_name=str(out))
                bar.update()
                bar.clear()
                print_report(manifest["quality"], title=f"{recipe.mode} vs fp32", file=log)
                manifest = write_manifest(tmp, manifest)
    return manifest


def _variant_manifest(parent: dict, src: Path, recipe: Recipe, files: list[str], tmp: Path) -> dict[str, Any]:
    """The parent's manifest with the graph's precision, files and the recipe updated."""
    graph = dict(parent["graph"])
    kv = "float16" if recipe.mode == "fp16" else graph.get("kv_dtype", "float32")
    graph.update(
        precision=recipe.mode, kv_dtype=kv, files=files, decode_weight_bytes=decode_weight_bytes(tmp / files[0])
    )
    for io in ("inputs", "outputs"):
        graph[io] = [
            {**t, "dtype": kv} if t["name"].startswith(("past_key_values.", "present.")) else t
            for t in graph.get(io, [])  # optional in a manifest
        ]
    parent_files = graph_files(parent)
    before = sum(parent["files"][f]["size"] for f in parent_files)
    after = sum((tmp / f).stat().st_size for f in files)
    manifest = {k: v for k, v in parent.items() if k not in ("files", "validation", "format", "format_version")}
    manifest.update(
        gpt2edge_version=gpt2edge.__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        graph=graph,
        quantization={
            "recipe": recipe.to_json(),
            "parent": {
                "path": str(src.resolve()),
                "precision": parent["graph"].get("precision", "fp32"),
                "sha256": {f: parent["files"][f]["sha256"] for f in parent_files},
            },
            "cpu": _cpu_record(recipe),
            "size_before": before,
            "size_after": after,
            "ratio": after / before,
        },
    )
    return manifest


def _cpu_record(recipe: Recipe) -> dict[str, Any] | None:
    """The quantizing machine's CPU as probed (flags, what it runs), when a target was chosen by or for it."""
    if recipe.target is None:
        return None
    from gpt2edge.quantize.targets import detect

    return detect().to_json()
