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

from tqdm import tqdm

import gpt2edge
from gpt2edge.errors import ExportError
from gpt2edge.export.checkpoint import load_checkpoint, resolve_source
from gpt2edge.export.options import DEFAULT_ATOL, DEFAULT_OPSET, check_atol, check_opset
from gpt2edge.extras import require_extra
from gpt2edge.folder import atomic_output_dir, check_output_dir
from gpt2edge.manifest import ATTENTION_OPS, HEAD_MODES, KV_CACHE_MODES, write_manifest
from gpt2edge.onnx_stats import decode_weight_bytes

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
    log=sys.stderr,
) -> ExportResult:
    """Export `source` (local folder or hub id) to `out`. Every check on the arguments runs before any work.

    `log` receives the validation table (None: not printed)."""
    require_extra("export", "export")
    out = Path(out)
    if head not in HEAD_MODES:
        raise ExportError(f"Unknown head mode '{head}'; choose one of {', '.join(HEAD_MODES)}.")
    check_opset(opset)
    if kv_cache not in KV_CACHE_MODES:
        raise ExportError(f"Unknown KV cache mode '{kv_cache}'; choose one of {', '.join(KV_CACHE_MODES)}.")
    check_atol(atol)
    sources = [source, tokenizer]  # local ones must not overlap OUT (a hub id matches no path)
    check_output_dir(out, force, sources)
    resolved = resolve_source(source, revision)  # a missing folder, an export folder, an offline hub id: refused now

    # the heavy imports (torch, transformers, onnx), once the request is known to be good
    from gpt2edge.export.model import from_hf_model
    from gpt2edge.export.onnx_graph import export_graph, io_spec
    from gpt2edge.export.validate import checks_to_json, print_checks, raise_on_failure, validate

    checks: list[Check] = []
    # a progress bar on a terminal only (disable=None); it closes and clears itself on any error
    bar = dict(desc="export", unit="step", file=sys.stderr, leave=False, disable=None)
    with tqdm(total=5 if run_validation else 4, **bar) as steps:
        steps.set_postfix_str("loading checkpoint")
        ckpt = load_checkpoint(source, revision=revision, tokenizer_source=tokenizer, resolved=resolved)
        model = from_hf_model(ckpt.model, head=head, kv_cache=kv_cache)
        steps.update()
        with atomic_output_dir(out, force=force, sources=sources) as tmp:
            steps.set_postfix_str("tracing to ONNX")
            graph_files = export_graph(model, tmp / MODEL_FILE, opset=opset)
            steps.update()

            steps.set_postfix_str("writing tokenizer and configs")
            ckpt.tokenizer.backend_tokenizer.save(str(tmp / TOKENIZER_FILE))
            ckpt.model.config.to_json_file(tmp / "config.json")
            ckpt.generation_config.to_json_file(tmp / "generation_config.json")
            steps.update()

            if run_validation:
                steps.set_postfix_str("validating against PyTorch")
                checks = validate(tmp / MODEL_FILE, ckpt.model, head=head, atol=atol, kv_cache=kv_cache)
                steps.update()
                steps.clear()
                if log is not None:
                    print(f"validation (ONNX Runtime vs PyTorch, atol {atol:g}):", file=log)
                    print_checks(checks, file=log)
                    log.flush()  # before an error line on the other stream
                raise_on_failure(checks)

            manifest = write_manifest(
                tmp,
                {
                    "gpt2edge_version": gpt2edge.__version__,
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "source": ckpt.source,
                    "dims": {**asdict(model.dims), "head_dim": model.dims.head_dim},
                    "graph": {
                        "file": MODEL_FILE,
                        "files": graph_files,
                        "opset": opset,
                        "head": head,
                        "kv_cache": kv_cache,
                        "attention": ATTENTION_OPS[kv_cache],
                        "precision": "fp32",
                        "kv_dtype": "float32",
                        "tied_lm_head": model.lm_head is None,
                        "decode_weight_bytes": decode_weight_bytes(tmp / MODEL_FILE),
                        **io_spec(model),
                    },
                    "tokenizer": TOKENIZER_FILE,
                    "versions": library_versions(),
                    "validation": {"atol": atol, "checks": checks_to_json(checks)} if run_validation else None,
                },
            )
            steps.update()
    return ExportResult(path=out, manifest=manifest, checks=checks)
