"""Small helpers over an ONNX graph, and saving a model the way the export does."""

from __future__ import annotations

import shutil
from pathlib import Path, PurePosixPath

import onnx

from gpt2edge.manifest import resolve_inside
from gpt2edge.manifest_records import Manifest
from gpt2edge.onnx_stats import EXTERNAL_DATA_THRESHOLD


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """tensor name -> the node that outputs it."""
    return {o: n for n in graph.node for o in n.output}


def save_model(model: onnx.ModelProto, path: Path) -> list[str]:
    """Write `model` to `path`, weights in `<name>.data` when over 2 GB; returns the file names written."""
    path = Path(path)
    try:
        external = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    except Exception:  # ByteSize itself fails on messages over 2 GiB
        external = True
    if external:
        data = path.name + ".data"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data)
        return [path.name, data]
    onnx.save_model(model, str(path))
    return [path.name]


def write_variant(model: onnx.ModelProto, parent: Manifest, src: Path, tmp: Path) -> list[str]:
    """A variant folder's files in `tmp`: `model` where the parent keeps its graph, and the parent's other files
    (tokenizer, configs) copied unchanged. Returns the graph files written, relative to the folder."""
    graph_dir = PurePosixPath(parent.graph.file).parent  # "." unless the parent keeps its graph in a subfolder
    (tmp / graph_dir).mkdir(parents=True, exist_ok=True)
    files = [(graph_dir / f).as_posix() for f in save_model(model, tmp / parent.graph.file)]
    for name in parent.files:
        if name not in parent.graph.files:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(resolve_inside(src, name), tmp / name)
    return files
