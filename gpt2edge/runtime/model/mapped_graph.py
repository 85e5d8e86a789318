"""A self-contained .onnx file handed to ONNX Runtime with its weights left in the file, to be mapped from there.

ONNX Runtime loads a self-contained file by parsing the whole protobuf (every weight's bytes copied into the
message) and then copying each weight out of it into the session: gpt2-small's one-file fp32 graph (0.5 GB)
peaks ~150 MB over the session's own size while it loads. `mapped_model` instead reads the file field by field
(the protobuf wire format, field numbers from onnx.proto: no onnx package) and describes each large
initializer's raw_data as external data that points into the file itself (its location, offset and length);
given that message and the file's folder, ONNX Runtime maps those byte ranges (file-backed pages, read when first
used) instead of parsing and copying them. The graph computed is the same: same nodes, same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from gpt2edge.onnx_io.wire import read_varint, varint

# onnx.proto: ModelProto.graph, GraphProto.initializer, TensorProto.raw_data / external_data / data_location
MODEL_GRAPH, GRAPH_INITIALIZER, TENSOR_RAW_DATA, TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION = 7, 5, 9, 13, 14
EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
# smaller tensors (biases, norms, shape constants) stay in the message: shape inference reads some of them, and
# a mapping costs at least a page
MAP_MIN_BYTES = 64 << 10
_HEAD = 20  # a field's key and length varints fit in 20 bytes


def fields(fd: int, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field, wire type, payload start, payload length, field start) of each field of the message stored in bytes
    start..end of file `fd`; reads only the keys and lengths (a field spans field start .. payload start + length).
    ValueError when a field runs past `end`."""
    pos = start
    while pos < end:
        head = os.pread(fd, min(_HEAD, end - pos), pos)
        key, i = read_varint(head, 0)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, i = read_varint(head, i)
            length = 0
        elif wire in (1, 5):
            length = 8 if wire == 1 else 4
        elif wire == 2:
            length, i = read_varint(head, i)
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in the ONNX file")
        at = pos + i
        if at + length > end:
            raise ValueError("a protobuf field runs past its message: the ONNX file is truncated")
        yield field, wire, at, length, pos
        pos = at + length


def read_exact(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ValueError("the ONNX file is truncated")
    return data


def _entry(key: str, value: str) -> bytes:
    """One TensorProto.external_data entry (StringStringEntryProto: key 1, value 2)."""
    body = b"".join(varint(f << 3 | 2) + varint(len(s)) + s for f, s in ((1, key.encode()), (2, value.encode())))
    return varint(TENSOR_EXTERNAL_DATA << 3 | 2) + varint(len(body)) + body


def _tensor(fd: int, at: int, length: int, location: str, min_bytes: int) -> tuple[bytes, int]:
    """An initializer's message with a raw_data of min_bytes or more replaced by a reference into the file;
    returns (message, bytes left in the file)."""
    rest, raw = bytearray(), None
    for field, wire, fat, flen, fstart in fields(fd, at, at + length):
        if field == TENSOR_RAW_DATA and wire == 2 and flen >= min_bytes:
            raw = (fat, flen)
        else:
            rest += read_exact(fd, fat + flen - fstart, fstart)
    if raw is None:
        return bytes(rest), 0
    for key, value in (("location", location), ("offset", str(raw[0])), ("length", str(raw[1]))):
        rest += _entry(key, value)
    rest += varint(TENSOR_DATA_LOCATION << 3) + varint(EXTERNAL)  # the last value of a field wins
    return bytes(rest), raw[1]


def mapped_model(path: Path, min_bytes: int = MAP_MIN_BYTES) -> bytes | None:
    """The serialized ModelProto of self-contained file `path` with every initializer's raw_data of `min_bytes` or
    more left in the file (described as external data at its own offset in `path`); None when there is none (a
    graph whose weights are already external: load the file as it is). Load the result with ONNX Runtime's
    session.model_external_initializers_file_folder_path set to path's folder. ValueError or OSError: the file
    is not a readable protobuf (let ONNX Runtime say why)."""
    path = Path(path)
    mapped = 0
    out = bytearray()
    with open(path, "rb") as f:
        fd = f.fileno()
        for field, wire, at, length, start in fields(fd, 0, os.fstat(fd).st_size):
            if field != MODEL_GRAPH or wire != 2:
                out += read_exact(fd, at + length - start, start)
                continue
            graph = bytearray()
            for gfield, gwire, gat, glen, gstart in fields(fd, at, at + length):
                if gfield == GRAPH_INITIALIZER and gwire == 2:
                    tensor, n = _tensor(fd, gat, glen, path.name, min_bytes)
                    mapped += n
                    graph += varint(GRAPH_INITIALIZER << 3 | 2) + varint(len(tensor)) + tensor
                else:
                    graph += read_exact(fd, gat + glen - gstart, gstart)
            out += varint(MODEL_GRAPH << 3 | 2) + varint(len(graph)) + graph
    return bytes(out) if mapped else None
