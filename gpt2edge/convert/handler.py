"""convert_folder: an export folder -> a new, atomically written folder in a deployment format.

The handler checks the request, verifies the source, copies the tokenizer and configs, calls the format's
writer (ort_format.py, genai.py, web.py) and writes a manifest whose graph.format says what the folder holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpt2edge.api_args import path_arg
from gpt2edge.convert.ort_format import check_ort_size
from gpt2edge.convert.web import check_web, write_web
from gpt2edge.errors import ConvertError
from gpt2edge.folder.derive import Derivation
from gpt2edge.manifest.records import Manifest
from gpt2edge.runtime.call_params import folder_defaults
from gpt2edge.runtime.model.folder import ModelFolder

FORMATS = ("ort", "genai", "web")

# a writer puts the converted graph into the new folder; returns (graph fields to update, conversion record)
Writer = Callable[[ModelFolder, Path], "tuple[dict[str, Any], dict[str, Any]]"]


def convert_folder(src: str | Path, out: str | Path, fmt: str, *, force: bool = False) -> dict[str, Any]:
    """Write export folder `src` in format `fmt` ("ort", "genai" or "web") to the new folder `out`; returns its
    manifest. Every check runs before anything is written; a failure leaves no `out` behind."""
    src, out = path_arg(src, "src"), path_arg(out, "out")  # a TypeError names a wrong type, before any other check
    if fmt not in FORMATS:
        raise ConvertError(f"Unknown format '{fmt}'; choose one of {', '.join(FORMATS)}.")
    d = Derivation(src, out, "convert", force=force)
    src = d.src
    _check_not_converted(src, d.parent)
    folder = ModelFolder.open(src, verify=False)  # the graph description, cheaply
    if folder.graph.static is not None:
        raise ConvertError(
            f"{src} is a static-shape export (--static), two graphs sharing one weights file; convert --format "
            f"{fmt} takes a dynamic export. For a mobile build, run ONNX Runtime's converter on its .onnx files."
        )
    if fmt == "genai" and folder.head == "tail":
        raise ConvertError(
            f"{src} is a --head tail export, whose logits_to_keep input onnxruntime-genai does not feed; convert "
            "a --head last export of the same checkpoint."
        )
    if fmt in ("web", "genai") and folder.info.raw.get("sparse_head") is not None:
        # the body graph returns the hidden state (and switches the browser runtime and genai do not feed)
        raise ConvertError(
            f"{src} has a sparse LM head, which only gpt2edge's own runtime runs; convert its parent folder "
            f"({folder.info.raw['sparse_head'].get('parent', {}).get('path', 'the folder it was built from')}) for "
            f"--format {fmt}, or use --format ort."
        )
    if fmt == "genai" and folder.graph.kv_dtype == "int8":
        # genai allocates and feeds the cache in the graph's dtype but has no int8 cache
        raise ConvertError(
            f"{src} has an int8 KV cache, which onnxruntime-genai does not allocate; convert an export made with "
            "--kv-dtype fp16 or fp32 for --format genai, or use --format ort."
        )
    if fmt == "ort":
        check_ort_size(folder.model_bytes(), src)
    if fmt == "web":
        check_web(folder, src)
    if fmt == "genai" and folder.info.vocab is not None:
        # genai has no kept-id map: it would read column k of the trimmed head as token id k
        v = folder.info.vocab
        raise ConvertError(
            f"{src} is vocabulary-trimmed ({v.kept} of {v.full} tokens) and onnxruntime-genai cannot map its "
            "log-prob columns back to token ids; convert the untrimmed folder, or use --format ort."
        )
    d.ready()  # OUT (equal to, inside or holding src: refused), then every checksum, before any work
    with d.output() as tmp:
        d.copy_side_files(tmp)  # tokenizer and configs, unchanged (the graph files are the writer's)
        graph, record = _WRITERS[fmt](folder, tmp)
        manifest = d.write_manifest(tmp, graph=graph, record={"format": fmt, **record})
    return manifest


def _check_not_converted(src: Path, parent: Manifest) -> None:
    """Converting a converted folder would stack format on format: point at the export instead."""
    done = parent.graph.format
    if done != "onnx":
        origin = parent.raw.get("conversion", {}).get("parent", {}).get("path", "its parent export")
        raise ConvertError(f"{src} is already a converted ({done}) folder; convert the export it came from ({origin}).")


def _write_ort(folder: ModelFolder, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from gpt2edge.convert.ort_format import convert_to_ort
    from gpt2edge.runtime.model.ort_session import create_session

    conv = convert_to_ort(folder.graph_path, tmp)
    create_session(tmp / conv.file, model_format="ort")  # the file loads as the runtime will load it
    return {"file": conv.file, "files": [conv.file], "format": "ort"}, conv.to_json()


def _write_genai(folder: ModelFolder, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import onnx

    from gpt2edge.convert.genai import (
        GENAI_CONFIG,
        LOGITS,
        LOGPROBS,
        TOKENIZER_CONFIG,
        add_logits_output,
        check_graph_head,
        genai_config,
        tokenizer_config,
    )
    from gpt2edge.quantize.graph import save_model

    graph = folder.manifest["graph"]
    model = onnx.load(str(folder.graph_path))
    check_graph_head(model, folder.head, folder.path)  # the graph's own head, not the manifest's word
    outputs = list(graph.get("outputs", []))
    logits = LOGPROBS  # a --head all graph's (B, S, V) output is bound as it is
    if folder.head == "last":
        entry = add_logits_output(model)
        outputs = [entry if o.get("name") == LOGPROBS else o for o in outputs]
        logits = LOGITS
    files = save_model(model, tmp / graph["file"])
    del model
    generation = folder_defaults(folder)  # its sampling options checked as the runtime checks them
    config = genai_config(folder.manifest, generation, logits, files[0])
    (tmp / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tok = tokenizer_config(folder.tokenizer_path, generation, folder.dims["n_positions"])
    (tmp / TOKENIZER_CONFIG).write_text(json.dumps(tok, indent=2) + "\n")
    record = {
        "genai_config": GENAI_CONFIG,
        "logits": logits,
        "past_present_share_buffer": config["search"]["past_present_share_buffer"],
    }
    return {"file": files[0], "files": files, "format": "genai", "outputs": outputs}, record


_WRITERS: dict[str, Writer] = {"ort": _write_ort, "genai": _write_genai, "web": write_web}
