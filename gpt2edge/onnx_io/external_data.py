"""Every file an ONNX graph will open is a listed, checksummed file of its folder.

A graph's initializers (and Constant attributes, sparse tensors, subgraph and function bodies) may keep their
bytes in another file, named by the tensor's external_data "location". ONNX Runtime opens whatever that names,
so a location rewritten to an unlisted file would run weights no checksum covers. `external_locations` lists
the locations of one .onnx file by reading its protobuf wire format directly: no onnx package (the runtime
does not need it), no weights read (raw_data fields are skipped, the file is memory-mapped), a few ms for a
GPT-2 graph (gpt2edge.manifest.external_data compares them with the manifest's graph files before any session
exists). ORT-format (.ort) graphs hold their initializers inline and are not parsed here.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from gpt2edge.errors import ModelFolderError
from gpt2edge.onnx_io.wire import read_varint

# the message fields on the way to a TensorProto: {field number: message kind}
_MODEL = {7: "graph", 20: "training", 25: "function"}
_TRAINING = {1: "graph", 2: "graph"}  # TrainingInfoProto.initialization / .algorithm
_GRAPH = {1: "node", 5: "tensor", 15: "sparse"}  # node, initializer, sparse_initializer
_FUNCTION = {7: "node"}
_NODE = {5: "attribute"}
_ATTRIBUTE = {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"}  # t g tensors graphs
_SPARSE = {1: "tensor", 2: "tensor"}  # values, indices
_KINDS = {
    "model": _MODEL,
    "training": _TRAINING,
    "graph": _GRAPH,
    "function": _FUNCTION,
    "node": _NODE,
    "attribute": _ATTRIBUTE,
    "sparse": _SPARSE,
}
_TENSOR_EXTERNAL_DATA, _ENTRY_KEY, _ENTRY_VALUE = 13, 1, 2
_MAX_DEPTH = 64  # subgraphs nest; a hostile file must not recurse without end


class _Malformed(ValueError):
    pass


def _fields(buf, start: int, end: int):
    """(field number, wire type, start, end) of each field of the message in buf[start:end]; for a
    length-delimited field, start:end is its content (offsets only: nothing is copied)."""
    pos, groups = start, []
    while pos < end:
        key, pos = read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed("field number 0")
        begin = pos
        if wire == 0:
            _, pos = read_varint(buf, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, begin = read_varint(buf, pos, end)
            pos = begin + n
        elif wire == 3:  # a group (unused by onnx.proto, but valid protobuf): its fields are skipped
            groups.append(number)
            continue
        elif wire == 4 and groups and groups[-1] == number:
            groups.pop()
            continue
        else:
            raise _Malformed(f"wire type {wire}")
        if pos > end:
            raise _Malformed("a field runs past the end")
        if not groups:
            yield number, wire, begin, pos
    if groups:
        raise _Malformed("an unterminated group")


def _tensor_location(buf, start: int, end: int) -> str | None:
    """The external_data "location" of a TensorProto, or None when its bytes are inline."""
    for number, wire, a, b in _fields(buf, start, end):
        if number == _TENSOR_EXTERNAL_DATA and wire == 2:
            entry = {n: bytes(buf[x:y]) for n, w, x, y in _fields(buf, a, b) if w == 2}
            if entry.get(_ENTRY_KEY) == b"location":
                return entry.get(_ENTRY_VALUE, b"").decode("utf-8", "replace")
    return None


def _walk(buf, start: int, end: int, kind: str, found: set[str], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise _Malformed("nested too deep")
    if kind == "tensor":
        loc = _tensor_location(buf, start, end)
        if loc is not None:
            found.add(loc)
        return
    children = _KINDS[kind]
    for number, wire, a, b in _fields(buf, start, end):
        if wire == 2 and number in children:
            _walk(buf, a, b, children[number], found, depth + 1)


def external_locations(path: Path) -> set[str]:
    """The external-data locations named anywhere in the ONNX model file `path` (relative to its folder)."""
    found: set[str] = set()
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            raise ModelFolderError(f"{path} is empty, not an ONNX graph; re-export the model.")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                _walk(mm, 0, size, "model", found, 0)
            except ValueError as e:  # _Malformed, or a varint past the end
                raise ModelFolderError(f"{path} is not a valid ONNX graph ({e}); re-export the model.") from None
    return found
