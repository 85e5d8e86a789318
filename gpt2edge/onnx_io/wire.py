"""The protobuf wire format's varint, read from a buffer and written, for the ONNX readers and writers here and in
the runtime (gpt2edge.onnx_io.stream, gpt2edge.onnx_io.external_data, gpt2edge.runtime.model.mapped_graph);
gpt2edge.onnx_io.scan reads its own from a file stream, a byte at a time."""

from __future__ import annotations


def read_varint(buf, i: int, end: int | None = None) -> tuple[int, int]:
    """(value, index after it) of the varint at buf[i] (bytes, or an mmap); ValueError when it runs past `end`
    (default: the buffer's end) or past 64 bits."""
    end = len(buf) if end is None else end
    shift = value = 0
    while True:
        if i >= end or shift > 63:
            raise ValueError("truncated or malformed varint in the ONNX file")
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


def varint(n: int) -> bytes:
    """n as a protobuf varint."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
