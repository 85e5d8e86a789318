"""Read a self-contained ONNX file field by field: every initializer's raw_data is left in the file and
described as external data pointing into it, so the graph costs its nodes, not its weights (onnx.load holds the
file's bytes and the parsed message, twice the weights). Used by gpt2edge.onnx_io.stream.load_graph."""

from __future__ import annotations

# protobuf field numbers (onnx.proto3): ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _read_varint(f) -> int | None:
    shift = result = 0
    while True:
        b = f.read(1)
        if not b:
            if shift:
                raise OSError("truncated varint in the ONNX file")
            return None
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return result
        shift += 7


def _fields(f, end: int):
    """(field, wire type, payload start, payload length, raw key+payload start) of each field up to `end`."""
    while f.tell() < end:
        start = f.tell()
        key = _read_varint(f)
        if key is None:
            return
        field, wire = key >> 3, key & 7
        if wire == 0:
            _read_varint(f)
            length, at = 0, f.tell()
        elif wire == 1 or wire == 5:
            length, at = (8 if wire == 1 else 4), f.tell()
            f.seek(length, 1)
        elif wire == 2:
            length = _read_varint(f)
            at = f.tell()
            f.seek(length, 1)
        else:
            raise OSError(f"unsupported protobuf wire type {wire} in the ONNX file")
        yield field, wire, at, length, start


def _raw(f, start: int, end: int) -> bytes:
    here = f.tell()
    f.seek(start)
    data = f.read(end - start)
    f.seek(here)
    return data


def scan_model(f, location: str):
    """ModelProto from a file, every initializer's raw_data left in the file and described as external data."""
    from onnx import GraphProto, ModelProto, TensorProto

    f.seek(0, 2)
    size = f.tell()
    f.seek(0)
    model_rest, graph = bytearray(), GraphProto()
    for field, wire, at, length, start in _fields(f, size):
        if field == _MODEL_GRAPH and wire == 2:
            here = f.tell()
            f.seek(at)
            graph_rest, inits = bytearray(), []
            for gfield, gwire, gat, glen, gstart in _fields(f, at + length):
                if gfield == _GRAPH_INITIALIZER and gwire == 2:
                    after = f.tell()
                    f.seek(gat)
                    tensor_rest, raw = bytearray(), None
                    for tfield, twire, tat, tlen, tstart in _fields(f, gat + glen):
                        if tfield == _TENSOR_RAW_DATA and twire == 2:
                            raw = (tat, tlen)
                        else:
                            tensor_rest += _raw(f, tstart, tat + tlen)
                    f.seek(after)
                    tensor = TensorProto.FromString(bytes(tensor_rest))
                    if raw is not None:
                        tensor.data_location = TensorProto.EXTERNAL
                        for k, v in (("location", location), ("offset", str(raw[0])), ("length", str(raw[1]))):
                            entry = tensor.external_data.add()
                            entry.key, entry.value = k, v
                    inits.append(tensor)
                else:
                    graph_rest += _raw(f, gstart, gat + glen)
            graph.MergeFromString(bytes(graph_rest))
            graph.initializer.extend(inits)
            f.seek(here)
        else:
            model_rest += _raw(f, start, at + length)
    model = ModelProto.FromString(bytes(model_rest))
    model.graph.CopyFrom(graph)
    return model
