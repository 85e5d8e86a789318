"""Facts about a graph that the manifest records for the runtime and the benchmarks (needs onnx)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step must read: every initializer once at its stored width, except
    tables that only Gathers read (an embedding lookup touches a few rows, not the table).

    Reads shapes and types only (external data is not loaded)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(path), load_external_data=False)
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    total = 0
    for init in model.graph.initializer:
        if readers.get(init.name, set()) <= {"Gather"}:
            continue  # gathered rows only (or unused)
        itemsize = np.dtype(tensor_dtype_to_np_dtype(init.data_type)).itemsize
        total += int(np.prod(init.dims, dtype=np.int64)) * itemsize
    return total
