"""export_model: HF checkpoint -> a self-contained, validated, atomically written export folder.

torch and onnx are imported only once the arguments and the source have been checked, so a bad request
(or an offline hub id) fails in a moment, and a runtime-only install is told which extra it needs.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gpt2edge
from gpt2edge.api_args import path_arg, text_arg
from gpt2edge.budget.needs import checkpoint_weight_bytes, export_need
from gpt2edge.errors import ExportError
from gpt2edge.export.checkpoint import load_checkpoint, resolve_source
from gpt2edge.export.options import (
    DEFAULT_ATOL,
    DEFAULT_OPSET,
    StaticShape,
    check_atol,
    check_kv_dtype,
    check_opset,
    check_static_capacity,
    check_static_options,
    parse_static_spec,
)
from gpt2edge.export.tokenizer_source import OWN_FIX, check_tokenizer_folder
from gpt2edge.extras import require_extra
from gpt2edge.folder.derive import Output
from gpt2edge.manifest import write_manifest
from gpt2edge.manifest.records import ATTENTION_OPS, HEAD_MODES, KV_CACHE_MODES, STATIC_KV_CACHE
from gpt2edge.onnx_io.stats import EXTERNAL_DATA_THRESHOLD, decode_weight_bytes
from gpt2edge.progress import Progress
from gpt2edge.report_text import record_text

if TYPE_CHECKING:
    from gpt2edge.export.validate import Check

MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class ExportResult:
    path: Path
    manifest: dict[str, Any]
    checks: list[Check]


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shaped the graph, for the manifest."""
    import onnx
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    return {
        "gpt2edge": gpt2edge.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": sys.version.split()[0],
    }


def export_model(
    source: str,
    out: Path,
    *,
    head: str = "last",
    kv_cache: str = "concat",
    opset: int = DEFAULT_OPSET,
    run_validation: bool = True,
    atol: float = DEFAULT_ATOL,
    force: bool = False,
    revision: str | None = None,
    tokenizer: str | None = None,
    static: str | StaticShape | None = None,
    log=sys.stderr,
    report_text: str | None = None,
    kv_dtype: str = "fp32",
) -> ExportResult:
    """Export `source` (local folder or hub id) to `out`. Every check on the arguments runs before any work.

    `static` ("BATCHxCHUNKxCAPACITY" or a StaticShape): write static-shape prefill and decode graphs instead
    (gpt2edge.export.static). `log` receives the validation table (None: not printed). `report_text`: recorded
    in the folder (quality_text.txt) for the quality reports of its variants and of parity (gpt2edge.report_text).
    `kv_dtype` ("fp32", "fp16", "int8"): the KV cache's dtype (gpt2edge.quantize.kv): the graph is validated with a
    float32 cache, then rewritten, and the KV effect (against the float32 cache) is measured when validating."""
    require_extra("export", "export")
    out = path_arg(out, "out")  # a TypeError names a wrong type
    source = str(path_arg(source, "source")) if not isinstance(source, str) else source
    report_text = None if report_text is None else text_arg(report_text, "report_text")
    if head not in HEAD_MODES:
        raise ExportError(f"Unknown head mode '{head}'; choose one of {', '.join(HEAD_MODES)}.")
    check_opset(opset)
    if kv_cache not in KV_CACHE_MODES:
        raise ExportError(f"Unknown KV cache mode '{kv_cache}'; choose one of {', '.join(KV_CACHE_MODES)}.")
    check_atol(atol)
    shape = static if isinstance(static, StaticShape) or static is None else parse_static_spec(static)
    if shape is not None:
        check_static_options(head, kv_cache, kv_dtype)
    check_kv_dtype(kv_dtype)
    target = Output(out, force=force, sources=[source, tokenizer])  # local ones must not overlap OUT (a hub id: none)
    target.check()
    resolved = resolve_source(source, revision)  # a missing folder, an export folder, an offline hub id: refused now
    if tokenizer is not None:  # a missing path, or a folder with no tokenizer files: refused now
        check_tokenizer_folder(tokenizer, hub_ok=True)
    elif resolved.kind == "local":  # the checkpoint's own tokenizer files
        check_tokenizer_folder(resolved.location, what="The checkpoint", fix=OWN_FIX)
    if resolved.kind == "local":  # memory and disk it will take, from config.json: refused now if they do not fit
        weight_bytes = checkpoint_weight_bytes(Path(resolved.location))
        if weight_bytes is not None:
            target.check(export_need(weight_bytes, run_validation, EXTERNAL_DATA_THRESHOLD))

    # the heavy imports (torch, transformers, onnx), once the request is known to be good
    from gpt2edge.export.model import from_hf_model
    from gpt2edge.export.onnx_graph import export_graph, inline_small
    from gpt2edge.export.validate import (
        checks_to_json,
        print_checks,
        raise_on_failure,
        reference_outputs,
        validate_against,
    )

    checks: list[Check] = []
    # a progress bar on a terminal, periodic lines otherwise; it closes and clears itself on any error
    with Progress(5 if run_validation else 4, "export", file=sys.stderr) as steps:
        steps.set_postfix_str("loading checkpoint")
        ckpt = load_checkpoint(source, revision=revision, tokenizer_source=tokenizer, resolved=resolved)
        model = from_hf_model(ckpt.model, head=head, kv_cache=kv_cache)
        if shape is not None:
            check_static_capacity(shape, model.dims.n_positions)  # the first moment the positions are known
        steps.update()
        with target.output() as tmp:
            steps.set_postfix_str("tracing to ONNX")
            if shape is None:
                graph_files = export_graph(model, tmp / MODEL_FILE, opset=opset)
            else:
                from gpt2edge.export.static import export_static

                graph_files = export_static(model, tmp, shape, opset=opset)
            steps.update()

            steps.set_postfix_str("writing tokenizer and configs")
            ckpt.tokenizer.backend_tokenizer.save(str(tmp / TOKENIZER_FILE))
            ckpt.model.config.to_json_file(tmp / "config.json")
            ckpt.generation_config.to_json_file(tmp / "generation_config.json")
            if report_text is not None:
                record_text(tmp, report_text)
            steps.update()

            dims = {**asdict(model.dims), "head_dim": model.dims.head_dim}
            if shape is None:
                # PyTorch's answers first, then the torch model is freed before ONNX Runtime loads the graph:
                # the two never hold the weights at once (peak ~1x the weights, not 2x)
                reference = reference_outputs(ckpt.model) if run_validation else None
                graph = _dynamic_graph(model, tmp, opset)
                del model
                ckpt = release_model(ckpt)
            else:
                graph = _static_graph(model, tmp, graph_files, opset, shape)
            if run_validation:
                steps.set_postfix_str("validating against PyTorch")
                if shape is None:
                    checks = validate_against(tmp / MODEL_FILE, reference, head=head, atol=atol, kv_cache=kv_cache)
                else:
                    from gpt2edge.export.static_validate import validate_static

                    decode = tmp / graph_files[1 if shape.chunk > 1 else 0]
                    checks = validate_static(tmp / graph_files[0], decode, ckpt.model, shape, atol)
                steps.update()
                steps.clear()
                if log is not None:
                    print(f"validation (ONNX Runtime vs PyTorch, atol {atol:g}):", file=log)
                    print_checks(checks, file=log)
                    log.flush()  # before an error line on the other stream
                raise_on_failure(checks)
            if shape is None:
                # validated in its external-data form (ONNX Runtime reads it tensor by tensor, no parsed copy of a
                # 1.4 GB message next to the weights), then a graph under 2 GB becomes one file, streamed
                graph["files"] = inline_small(tmp / MODEL_FILE)

            manifest = write_manifest(
                tmp,
                {
                    "gpt2edge_version": gpt2edge.__version__,
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "source": ckpt.source,
                    "dims": dims,
                    "graph": graph,
                    "tokenizer": TOKENIZER_FILE,
                    "versions": library_versions(),
                    "validation": {"atol": atol, "checks": checks_to_json(checks)} if run_validation else None,
                },
            )
            if kv_dtype != "fp32":
                from gpt2edge.quantize.kv import KV_DTYPES, compact_kv_cache

                steps.set_postfix_str(f"{kv_dtype} KV cache")
                manifest = compact_kv_cache(
                    tmp, manifest, KV_DTYPES[kv_dtype], report=run_validation, text=report_text, log=log
                )
            steps.update()
    return ExportResult(path=out, manifest=manifest, checks=checks)


def release_model(ckpt):
    """The checkpoint without its torch model, the memory returned: tokenizer and configs stay."""
    import gc
    from dataclasses import replace

    ckpt = replace(ckpt, model=None)
    gc.collect()  # the exporter's program and graph hold the weights through reference cycles
    return ckpt


def _dynamic_graph(model, tmp: Path, opset: int) -> dict[str, Any]:
    """The manifest's graph record of the one dynamic-shape graph."""
    from gpt2edge.export.onnx_graph import io_spec

    return {
        "file": MODEL_FILE,
        "files": [MODEL_FILE],  # set once the graph's final form is written (inline_small)
        "opset": opset,
        "head": model.head,
        "kv_cache": model.kv_cache,
        "attention": ATTENTION_OPS[model.kv_cache],
        "precision": "fp32",
        "kv_dtype": "float32",
        "tied_lm_head": model.lm_head is None,
        "decode_weight_bytes": decode_weight_bytes(tmp / MODEL_FILE),
        **io_spec(model),
    }


def _static_graph(model, tmp: Path, files: list[str], opset: int, shape: StaticShape) -> dict[str, Any]:
    """The manifest's graph record of static-shape graphs: files = [prefill, (decode,) weights]; the IO
    described is the prefill graph's (the decode graph's is the same with chunk 1)."""
    from gpt2edge.export.static import static_io_spec

    prefill, decode = files[0], files[1 if shape.chunk > 1 else 0]
    return {
        "file": prefill,
        "files": files,
        "opset": opset,
        "head": "last",
        "kv_cache": STATIC_KV_CACHE,
        "attention": "onnx",
        "precision": "fp32",
        "kv_dtype": "float32",
        "tied_lm_head": model.lm_head is None,
        "decode_weight_bytes": decode_weight_bytes(tmp / decode),
        "static": {
            "batch": shape.batch,
            "chunk": shape.chunk,
            "capacity": shape.capacity,
            "prefill_file": prefill,
            "decode_file": decode,
        },
        **static_io_spec(model, shape),
    }
