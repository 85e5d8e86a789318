"""Small helpers over an ONNX graph, and saving a model the way the export does."""

from __future__ import annotations

from pathlib import Path

import onnx

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
