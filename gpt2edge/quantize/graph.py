"""Small helpers over an ONNX graph, and saving a model the way the export does."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import onnx

from gpt2edge.folder.derive import Derivation
from gpt2edge.manifest import resolve_inside
from gpt2edge.onnx_io.stats import EXTERNAL_DATA_THRESHOLD


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """tensor name -> the node that outputs it."""
    return {o: n for n in graph.node for o in n.output}


def payload_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the weights a model will write: external lengths and inline raw data, from the descriptions."""
    from gpt2edge.onnx_io.stream import _external_info

    total = 0
    for init in model.graph.initializer:
        info = _external_info(init)
        total += int(info.get("length", 0)) if info is not None else len(init.raw_data)
    return total


def save_model(model: onnx.ModelProto, path: Path, base_dir: Path | None = None, bytes_of=None) -> list[str]:
    """Write `model` to `path`, weights in `<name>.data` when over 2 GB; returns the file names written.

    Streamed tensor by tensor (gpt2edge.onnx_io.stream): initializers still stored outside are read from
    `base_dir` (the parent's graph folder) one at a time, or made by `bytes_of` (a rewrite that converts each
    tensor as it is written, e.g. fp16); the message is never serialized with its weights."""
    from gpt2edge.onnx_io.stream import passthrough, save_streaming

    path = Path(path)
    external = payload_bytes(model) > EXTERNAL_DATA_THRESHOLD  # read at call time: tests lower it
    bytes_of = bytes_of or passthrough(Path(base_dir or path.parent))
    return save_streaming(model, path, bytes_of, external=external)


def write_variant(model: onnx.ModelProto, d: Derivation, tmp: Path, bytes_of=None) -> list[str]:
    """A derived folder's files in `tmp`: `model` where the parent keeps its graph, and the parent's other files
    (tokenizer, configs) copied unchanged. Returns the graph files written, relative to the folder. `bytes_of`:
    see save_model (default: the parent's bytes as they are)."""
    parent = d.parent
    graph_dir = PurePosixPath(parent.graph.file).parent  # "." unless the parent keeps its graph in a subfolder
    (tmp / graph_dir).mkdir(parents=True, exist_ok=True)
    base = resolve_inside(d.src, parent.graph.file).parent  # where the parent's external data is read from
    written = save_model(model, tmp / parent.graph.file, base_dir=base, bytes_of=bytes_of)
    d.copy_side_files(tmp)
    return [(graph_dir / f).as_posix() for f in written]
