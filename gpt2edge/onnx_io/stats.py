"""Facts about a graph that the manifest records for the runtime and the benchmarks (needs onnx)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# protobuf cannot hold a message over 2 GiB; graphs past this keep their weights in external data
EXTERNAL_DATA_THRESHOLD = 1_900_000_000


def reader_ops(graph) -> dict[str, set[str]]:
    """tensor name -> the op types of the nodes that read it."""
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    return readers


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step must read: every initializer once at its stored width, except
    tables that only Gathers read (an embedding lookup touches a few rows, not the table).

    Reads shapes and types only: external data is not loaded, and a self-contained file is scanned, its weights
    left in the file (onnx.load would hold a 1.5 GB graph twice: the file's bytes and the parsed message)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    from gpt2edge.onnx_io.stream import load_graph

    model = load_graph(Path(path))
    readers = reader_ops(model.graph)
    total = 0
    for init in model.graph.initializer:
        if readers.get(init.name, set()) <= {"Gather", "GatherBlockQuantized"}:
            continue  # gathered rows only (or unused)
        itemsize = np.dtype(tensor_dtype_to_np_dtype(init.data_type)).itemsize
        total += int(np.prod(init.dims, dtype=np.int64)) * itemsize
    return total
