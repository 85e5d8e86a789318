"""Read and write ONNX weights one tensor at a time, so a graph of any size is rewritten in ~one tensor of memory.

onnx.load + onnx.save hold every weight twice (the message, then its serialized bytes) and cannot write a
message over 2 GiB at all. Here a model is loaded without its external data (`load_graph`); each initializer's
bytes are read when asked for (`tensor_bytes`, a pread into a fresh buffer: no mapping stays resident), and
`save_streaming` writes either
  - external data: the weights appended to `<name>.data` one by one, the small graph message written last, or
  - one self-contained file: the protobuf assembled by hand, each initializer's raw_data streamed in place.
Protobuf allows a message's fields in any order and repeated fields split across the stream, so the file is
an ordinary ModelProto that onnx and ONNX Runtime read as usual.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gpt2edge.onnx_io.wire import varint as _varint

# protobuf field numbers (onnx.proto3): ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
# external data offsets aligned to a page: ONNX Runtime can map them instead of copying
ALIGN = 4096
# smaller tensors stay in the graph file (onnx's own threshold): shape inference needs them there
INLINE_BELOW = 1024


def load_graph(path: Path):
    """The ModelProto without its weights in memory: initializers stored outside keep their location; in a
    self-contained file each initializer's raw_data is described as external data that points into the file
    itself (read later by `tensor_bytes`), so a 1.4 GB graph costs its nodes, not 2 x 1.4 GB (file bytes and the
    parsed message, as onnx.load holds them)."""
    import onnx

    path = Path(path)
    if path.stat().st_size < SCAN_ABOVE:
        return onnx.load(str(path), load_external_data=False)
    from gpt2edge.onnx_io.scan import scan_model

    with open(path, "rb") as f:
        return scan_model(f, path.name)


# self-contained files over this are scanned field by field instead of parsed whole
SCAN_ABOVE = 64 << 20


def external_locations(model) -> list[str]:
    """The external data files a graph's initializers name, in first-use order."""
    seen: dict[str, None] = {}
    for init in model.graph.initializer:
        info = _external_info(init)
        if info is not None:
            seen.setdefault(info["location"], None)
    return list(seen)


def _external_info(init) -> dict[str, str] | None:
    from onnx import TensorProto

    if init.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in init.external_data}


def tensor_bytes(init, base_dir: Path) -> bytes | None:
    """The raw little-endian bytes of an initializer stored outside (read now), or None when it is inline."""
    info = _external_info(init)
    if info is None:
        return None
    location = Path(base_dir) / info["location"]
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else location.stat().st_size - offset
    with open(location, "rb") as f:
        data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise OSError(f"{location} is truncated: {init.name} needs bytes {offset}..{offset + length}")
    return data


def tensor_array(init, base_dir: Path) -> np.ndarray:
    """An initializer as an array, read from external data when it is stored there (writable, owned)."""
    from onnx import numpy_helper
    from onnx.helper import tensor_dtype_to_np_dtype

    data = tensor_bytes(init, base_dir)
    if data is None:
        return numpy_helper.to_array(init)
    dtype = np.dtype(tensor_dtype_to_np_dtype(init.data_type)).newbyteorder("<")
    return np.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(init.dims))


def _key(field: int) -> bytes:
    return _varint((field << 3) | 2)  # wire type 2: length-delimited


BytesOf = Callable[[object], "bytes | np.ndarray | None"]


def _payload(init, bytes_of: BytesOf) -> bytes | memoryview | None:
    data = bytes_of(init)
    if data is None:
        return None
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data.astype(data.dtype.newbyteorder("<"), copy=False))).cast("B")
    return data


def _bare(init):
    """A copy of an initializer's description with no data and no location."""
    from onnx import TensorProto

    meta = TensorProto()
    meta.CopyFrom(init)
    meta.ClearField("raw_data")
    del meta.external_data[:]
    meta.data_location = TensorProto.DEFAULT
    return meta


def save_streaming(model, path: Path, bytes_of: BytesOf, external: bool) -> list[str]:
    """Write `model` to `path`. `bytes_of(init)` gives an initializer's data (bytes or array; None: the init is
    complete as it is, e.g. a small inline constant); it must agree with the description's length (external
    length or raw_data), which sizes the single-file layout before any tensor is read. Returns the file names
    written ([graph] or [graph, data]).
    `model`'s initializers are left as descriptions (the data is never attached to the message)."""
    path = Path(path)
    inits = list(model.graph.initializer)
    if external:
        data_name = path.name + ".data"
        with open(path.parent / data_name, "wb") as f:
            for init in inits:
                data = _payload(init, bytes_of)
                if data is None:
                    continue
                if len(data) < INLINE_BELOW:  # shapes and other small constants: ONNX Runtime reads them inline
                    bare = _bare(init)
                    bare.raw_data = bytes(data)
                    init.CopyFrom(bare)
                    continue
                offset = -(-f.tell() // ALIGN) * ALIGN
                f.seek(offset)
                f.write(data)
                bare = _bare(init)
                init.CopyFrom(bare)
                init.data_location = init.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(data)))):
                    entry = init.external_data.add()
                    entry.key, entry.value = k, v
            f.truncate()  # no slack past the last tensor
        path.write_bytes(model.SerializeToString())
        return [path.name, data_name]

    # one file: ModelProto without its graph, then the graph field: its other fields, then each initializer
    from onnx import GraphProto, ModelProto

    head = ModelProto()
    head.CopyFrom(model)
    head.ClearField("graph")
    graph = GraphProto()
    graph.CopyFrom(model.graph)
    del graph.initializer[:]
    graph_head = graph.SerializeToString()
    metas = []
    for init in inits:
        external = _external_info(init) is not None
        meta = _bare(init) if external or init.HasField("raw_data") else init
        metas.append(meta.SerializeToString())
    sizes = []
    for init, meta in zip(inits, metas):
        n = _length_of(init, bytes_of)
        body = len(meta) + (len(_key(_TENSOR_RAW_DATA)) + len(_varint(n)) + n if n is not None else 0)
        sizes.append(body)
    graph_len = len(graph_head) + sum(len(_key(_GRAPH_INITIALIZER)) + len(_varint(s)) + s for s in sizes)
    with open(path, "wb") as f:
        f.write(head.SerializeToString())
        f.write(_key(_MODEL_GRAPH) + _varint(graph_len))
        f.write(graph_head)
        for init, meta, body in zip(inits, metas, sizes):
            f.write(_key(_GRAPH_INITIALIZER) + _varint(body))
            f.write(meta)
            data = _payload(init, bytes_of)
            if data is not None:
                f.write(_key(_TENSOR_RAW_DATA) + _varint(len(data)))
                f.write(data)
    return [path.name]


def _length_of(init, bytes_of: BytesOf) -> int | None:
    """Bytes of an initializer's payload, from its description where it says (external length, raw_data)."""
    info = _external_info(init)
    if info is not None and "length" in info:
        return int(info["length"])
    if init.HasField("raw_data"):
        return len(init.raw_data)
    data = _payload(init, bytes_of)
    return None if data is None else len(data)


def passthrough(base_dir: Path) -> BytesOf:
    """bytes_of for a model as loaded: external tensors read from `base_dir`, inline raw_data kept as bytes."""

    def bytes_of(init):
        data = tensor_bytes(init, base_dir)
        if data is None and init.HasField("raw_data"):
            return init.raw_data
        return data

    return bytes_of
