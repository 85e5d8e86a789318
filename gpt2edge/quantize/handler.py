"""quantize_model: an fp32 export folder -> a new, atomically written export folder in fp16 / int8 / int4.

The handler only checks the request, calls the pure rewrite (half.py, weight_only.py), copies the tokenizer
and configs, measures the quality report against the parent, and writes the manifest.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpt2edge.api_args import path_arg, text_arg
from gpt2edge.budget.needs import quantize_need
from gpt2edge.errors import QuantizeError
from gpt2edge.extras import require_extra
from gpt2edge.folder.derive import Derivation
from gpt2edge.heap import return_free_memory
from gpt2edge.manifest import resolve_inside, write_manifest
from gpt2edge.manifest.records import Manifest
from gpt2edge.onnx_io.stats import decode_weight_bytes
from gpt2edge.progress import Progress
from gpt2edge.quantize.recipe import (  # noqa: F401  (re-exported: the CLI and tests read them here)
    ACCURACY_LEVELS,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_SYMMETRIC,
    HEAD8_BLOCK_SIZE,
    HEAD_BITS,
    MODES,
    WIDTH,
    Recipe,
    make_recipe,
)
from gpt2edge.report_text import BUILT_IN, record_text


def quantize_model(
    src: Path,
    out: Path,
    recipe: Recipe,
    *,
    force: bool = False,
    text: str | None = None,
    report: bool = True,
    log=sys.stderr,
    text_source: str | None = None,
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """Write the `recipe` variant of export folder `src` to `out`; returns the new manifest. A `text` is recorded
    in the new folder for later reports (gpt2edge.report_text); `text_source` names it in the report. `kv_dtype`
    ("fp32", "fp16", "int8"; None: the parent's): the variant's KV cache (gpt2edge.quantize.kv), whose effect
    against a float32 cache the report measures apart."""
    require_extra("quantize", "quantize")
    from gpt2edge.quality import check_report_text, compare_folders, print_report

    src, out = path_arg(src, "src"), path_arg(out, "out")  # a TypeError names a wrong type, before any other check
    text = None if text is None else text_arg(text, "text")
    d = Derivation(src, out, "quantize", force=force)
    info, src = d.parent, d.src
    parent = info.raw
    if info.graph.format != "onnx":  # .ort / genai folders (gpt2edge convert)
        origin = parent.get("conversion", {}).get("parent", {}).get("path", "?")
        raise QuantizeError(f"{src} is a converted folder; quantize the .onnx export it came from ({origin}).")
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
    if info.graph.head == "all":  # a scoring export; --head tail (speculative decoding's target) is quantized
        raise QuantizeError(
            f"{src} is a --head all export; quantize a generation export (--head last, or --head tail for a "
            "speculative decoding target) of the same checkpoint."
        )
    if recipe.mode == "fp16" and info.graph.kv_cache == "shared":
        raise QuantizeError(
            f"{src} is a shared-cache export (the CPU fast path); fp16 would put casts around its in-place cache. "
            "Make fp16 from a --kv-cache concat export, or use int8/int4 here."
        )
    compact = _check_kv_dtype(src, kv_dtype, recipe.mode, info.graph.kv_dtype)
    # the blocks as the graph will hold them (tables, a default block fitted to the rows), or refused now
    recipe = recipe.fitted(info.dims.n_embd, info.dims.n_inner)
    if report:
        check_report_text(src, text)  # an empty or one-token --text, refused before the work
    d.ready(quantize_need(info.model_bytes(), recipe.mode, report))  # OUT, memory and disk, every checksum

    with Progress(3 if report else 2, f"quantize {recipe.mode}", file=sys.stderr) as bar:  # periodic lines off a TTY
        graph_path = resolve_inside(src, info.graph.file)
        from gpt2edge.onnx_io.stream import load_graph

        # streamed: the graph without its external data; each weight is read when it is rewritten or written
        bytes_of = None  # the writer copies what the rewrite left as a reference to the parent
        if recipe.mode == "fp16":
            from gpt2edge.quantize.half import to_fp16

            variant, bytes_of = to_fp16(load_graph(graph_path), graph_path.parent)  # rounded as it is written
        else:
            from gpt2edge.quantize.weight_only import quantize_weights

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
        with d.output() as tmp:
            from gpt2edge.quantize.graph import write_variant

            files = write_variant(variant, d, tmp, bytes_of=bytes_of)
            del variant
            if text is not None:
                record_text(tmp, text)
            bar.update()
            manifest = d.write_manifest(tmp, **_variant_fields(info, recipe, files, tmp))
            if compact is not None:
                from gpt2edge.quantize.kv import compact_kv_cache

                bar.set_postfix_str(f"{compact} KV cache")
                manifest = compact_kv_cache(
                    tmp, manifest, compact, report=report, text=text, text_source=text_source, log=log
                )
            if report:
                return_free_memory()  # the rewrite's freed arrays, before the report's sessions load on top
                # measured on the finished folder, exactly as the runtime will load it
                bar.set_postfix_str("quality report")
                manifest["quality"] = compare_folders(src, tmp, text=text, variant_name=str(d.out))
                manifest["quality"]["text_scored"] = text_source or ("--text" if text is not None else BUILT_IN)
                bar.update()
                bar.clear()
                print_report(manifest["quality"], title=f"{recipe.mode} vs fp32", file=log)
                manifest = write_manifest(tmp, manifest)
    return manifest


def _check_kv_dtype(src: Path, choice: str | None, mode: str, parent_kv: str) -> str | None:
    """The KV cache dtype the variant's graph is rewritten to (None: no rewrite), or a one-line refusal."""
    from gpt2edge.quantize.kv import kv_dtype_of

    if parent_kv != "float32":
        if mode == "fp16" or (choice is not None and kv_dtype_of(choice) != parent_kv):
            raise QuantizeError(
                f"{src} already has a {parent_kv} KV cache (--kv-dtype at export); quantize an export with the "
                f"float32 cache (export without --kv-dtype) and give --kv-dtype here."
            )
        return None
    if choice is None or choice == "fp32":
        return None
    if mode == "fp16":
        if choice != "fp16":
            raise QuantizeError(
                f"--mode fp16 keeps the KV cache in float16 with the rest of the graph; --kv-dtype {choice} applies "
                "to int8/int4 (or export with --kv-dtype int8 and keep fp32 weights)."
            )
        return None
    return kv_dtype_of(choice)


def _variant_fields(info: Manifest, recipe: Recipe, files: list[str], tmp: Path) -> dict[str, Any]:
    """The variant's graph fields (precision, KV dtype, files) and its quantization record."""
    graph = dict(info.raw["graph"])
    kv = "float16" if recipe.mode == "fp16" else graph.get("kv_dtype", "float32")
    graph.update(
        precision=recipe.mode, kv_dtype=kv, files=files, decode_weight_bytes=decode_weight_bytes(tmp / files[0])
    )
    for io in ("inputs", "outputs"):
        graph[io] = [
            {**t, "dtype": kv} if t["name"].startswith(("past_key_values.", "present.")) else t
            for t in graph.get(io, [])  # optional in a manifest
        ]
    before = info.model_bytes()
    after = sum((tmp / f).stat().st_size for f in files)
    record = {
        "recipe": recipe.to_json(),
        "cpu": _cpu_record(recipe),
        "size_before": before,
        "size_after": after,
        "ratio": after / before,
    }
    return {"graph": graph, "record": record}


def _cpu_record(recipe: Recipe) -> dict[str, Any] | None:
    """The quantizing machine's CPU as probed (flags, what it runs), when a target was chosen by or for it."""
    if recipe.target is None:
        return None
    from gpt2edge.quantize.targets import detect

    return detect().to_json()
