"""Small helpers over an ONNX graph, and saving a model the way the export does."""

from __future__ import annotations

from pathlib import Path

import onnx

# protobuf cannot hold a message over 2 GiB; same margin as the export
EXTERNAL_DATA_THRESHOLD = 1_900_000_000


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """tensor name -> the node that outputs it."""
    return {o: n for n in graph.node for o in n.output}


def save_model(model: onnx.ModelProto, path: Path) -> list[str]:
    """Write `model` to `path`, weights in `<name>.data` when over 2 GB; returns the file names written."""
    path = Path(path)
    external = model.ByteSize() > EXTERNAL_DATA_THRESHOLD if _fits_bytesize(model) else True
    if external:
        data = path.name + ".data"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data)
        return [path.name, data]
    onnx.save_model(model, str(path))
    return [path.name]


def _fits_bytesize(model: onnx.ModelProto) -> bool:
    # ByteSize itself fails on messages over 2 GiB
    try:
        model.ByteSize()
        return True
    except Exception:
        return False
