"""Graph surgery for the sparse head: cut the LM head off a generation graph, keep it as a graph of its own, and
read its table.

Every gpt2edge graph ends  hidden -> head (x @ table^T) -> [Cast] -> LogSoftmax -> [Casts] -> logprobs
(gpt2edge.trim.graph.find_head). The body graph returns `hidden` (the head's input: the last position after
ln_f; a --head tail graph's kept positions, (B, keep, C)) in place of `logprobs`; the head graph is those last
nodes alone, hidden (N, C) -> logprobs (N, V), one row per position: the same ops on the same weights, so it
gives the parent's log-probs bit for bit (the runtime's full-head path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2edge.errors import SparseHeadError, TrimError
from gpt2edge.quantize.primitives import unpack_codes
from gpt2edge.trim.graph import OUTPUT, find_head

HIDDEN = "hidden"  # the body graph's first output, and the head graph's input
BOUND_INPUT, BOUND_OUTPUT = "bound_input", "upper_bounds"  # (B, r + 2) -> (B, V): the bound graph


@dataclass
class HeadTable:
    """The head's table as its kernel reads it. kind "float": logits = weight . h in float (a Gemm, or a
    MatMulNBits at accuracy level 0/1: dequantized codes); kind "int8-activations": MatMulNBits at accuracy
    level 4, which quantizes h per block to int8 first. codes (V, C) uint8, zero_points / scales (V, kb);
    weight (V, C) float32 for a float table (codes None)."""

    kind: str
    weight: np.ndarray | None
    codes: np.ndarray | None
    zero_points: np.ndarray | None
    scales: np.ndarray | None
    bits: int
    block_size: int

    def dequantized(self) -> np.ndarray:
        """(V, C) float32 rows as the kernel multiplies them."""
        if self.codes is None:
            return self.weight
        V, C = self.codes.shape
        kb = self.scales.shape[1]
        pad = kb * self.block_size - C
        codes = np.pad(self.codes, ((0, 0), (0, pad))).reshape(V, kb, self.block_size).astype(np.float32)
        w = (codes - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        return np.ascontiguousarray(w.reshape(V, -1)[:, :C])


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def read_table(head: onnx.NodeProto, inits: dict[str, onnx.TensorProto], vocab_size: int, width: int) -> HeadTable:
    """The head node's table; refuses a head the sparse runtime cannot reproduce."""
    a = _attrs(head)

    def init(i: int) -> np.ndarray:
        name = head.input[i] if len(head.input) > i else ""
        if name not in inits:
            raise SparseHeadError(f"The head reads {name or 'nothing'} as input {i}, not a stored weight; re-export.")
        return numpy_helper.to_array(inits[name])

    if head.op_type == "Gemm" and a.get("transB") == 1 and not a.get("transA", 0) and len(head.input) == 2:
        w = init(1)
        if w.dtype != np.float32 or w.shape != (vocab_size, width):
            raise SparseHeadError(
                f"The head's table is {w.dtype} {w.shape}; the sparse head runs fp32, int8 and int4 folders "
                "(quantize the fp32 folder to int8 or int4, or use the fp32 folder)."
            )
        return HeadTable("float", np.ascontiguousarray(w), None, None, None, 32, 0)
    if head.op_type == "MatMulNBits" and a.get("N") == vocab_size and a.get("K") == width:
        level = int(a.get("accuracy_level", 0))
        if level not in (0, 1, 4) or (len(head.input) > 4 and head.input[4]) or (len(head.input) > 5):
            raise SparseHeadError(
                f"The head's MatMulNBits (accuracy level {level}, {len(head.input)} inputs) is not one the sparse "
                "head reproduces (levels 0, 1 and 4, no g_idx or bias); quantize with gpt2edge quantize."
            )
        bits, bs = int(a["bits"]), int(a["block_size"])
        packed = init(1)
        kb = packed.shape[1]
        codes = unpack_codes(packed, bits).reshape(vocab_size, kb * bs)[:, :width]
        scales = init(2).reshape(vocab_size, kb).astype(np.float32)
        if len(head.input) > 3 and head.input[3]:
            zp = unpack_codes(init(3).reshape(vocab_size, -1), bits)[:, :kb]
        else:
            zp = np.full((vocab_size, kb), 1 << (bits - 1), dtype=np.uint8)
        kind = "int8-activations" if level == 4 else "float"
        return HeadTable(kind, None, np.ascontiguousarray(codes), np.ascontiguousarray(zp), scales, bits, bs)
    raise SparseHeadError(
        f"The head is a {head.op_type} {a}; the sparse head supports Gemm, MatMul(x, Transpose(table)) and "
        "MatMulNBits heads."
    )


def _transposed_table(g: onnx.GraphProto, head: onnx.NodeProto, inits: dict) -> onnx.NodeProto | None:
    """The Transpose node of a stored (V, C) table that a MatMul head multiplies by (a --head tail export's fp32
    head, and --keep-head-fp32), or None."""
    if head.op_type != "MatMul" or len(head.input) != 2:
        return None
    node = next((n for n in g.node if head.input[1] in n.output), None)
    if node is None or node.op_type != "Transpose" or node.input[0] not in inits:
        return None
    perm = [helper.get_attribute_value(a) for a in node.attribute if a.name == "perm"]
    return node if perm in ([], [[1, 0]]) else None


def split_head(
    model: onnx.ModelProto, vocab_size: int, width: int, tail: bool = False
) -> tuple[onnx.ModelProto, onnx.ModelProto, HeadTable]:
    """(body graph returning `hidden` first, head graph hidden -> logprobs, the head's table). tail: a --head tail
    graph, whose `hidden` is (batch, keep, C); its head graph still takes rows, (N, C)."""
    g = model.graph
    try:
        head, path = find_head(g)
    except TrimError as e:
        raise SparseHeadError(str(e)) from e
    hidden_in = head.input[0]
    head_outputs = set(path)
    inits = {i.name: i for i in g.initializer}
    table_in = _transposed_table(g, head, inits)
    if table_in is not None:
        # a tail export's fp32 head, MatMul(x, Transpose(wte)): the (V, C) table itself; the Transpose goes with it
        head_outputs.add(table_in.output[0])
        w = numpy_helper.to_array(inits[table_in.input[0]])
        if w.dtype != np.float32 or w.shape != (vocab_size, width):
            raise SparseHeadError(f"The head's table is {w.dtype} {w.shape}, not float32 ({vocab_size}, {width}).")
        table = HeadTable("float", np.ascontiguousarray(w), None, None, None, 32, 0)
    else:
        table = read_table(head, inits, vocab_size, width)
    head_nodes = [n for n in g.node if set(n.output) & head_outputs]

    # the head graph: the cut nodes and the weights they read, on an input named `hidden`
    head_inits = [inits[n] for node in head_nodes for n in node.input if n in inits]
    hnodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in head_nodes]
    for n in hnodes:
        n.input[:] = [HIDDEN if i == hidden_in else i for i in n.input]
    for n in hnodes:  # the head graph's rows are (N, V) whatever the parent's rank (the log-softmax's axis last)
        for attr in n.attribute:
            if n.op_type == "LogSoftmax" and attr.name == "axis":
                attr.i = -1
    elem = next(o for o in g.output if o.name == OUTPUT).type.tensor_type.elem_type
    out = helper.make_tensor_value_info(OUTPUT, elem, ["batch", vocab_size])
    rows_info = helper.make_tensor_value_info(HIDDEN, onnx.TensorProto.FLOAT, ["batch", width])
    head_graph = helper.make_graph(
        hnodes, "gpt2edge_head", [rows_info], [out], list({i.name: i for i in head_inits}.values())
    )
    hidden_info = helper.make_tensor_value_info(
        HIDDEN, onnx.TensorProto.FLOAT, ["batch", "keep", width] if tail else ["batch", width]
    )
    head_model = helper.make_model(head_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)

    # the body: everything but the cut nodes, `hidden` (an Identity of the head's input) first among the outputs
    body = onnx.ModelProto.FromString(model.SerializeToString())
    bg = body.graph
    keep = [n for n in bg.node if not set(n.output) & head_outputs]
    keep.append(helper.make_node("Identity", [hidden_in], [HIDDEN], name="sparse_head.hidden"))
    del bg.node[:]
    bg.node.extend(keep)
    read = {i for n in bg.node for i in n.input}
    kept_inits = [i for i in bg.initializer if i.name in read]
    del bg.initializer[:]
    bg.initializer.extend(kept_inits)
    outputs = [hidden_info, *[o for o in bg.output if o.name != OUTPUT]]
    del bg.output[:]
    bg.output.extend(outputs)
    stale = head_outputs | {HIDDEN}
    vi = [v for v in bg.value_info if v.name not in stale]
    del bg.value_info[:]
    bg.value_info.extend(vi)
    return body, head_model, table


def bound_model(a_t: np.ndarray, eps: np.ndarray, opset: onnx.OperatorSetIdProto) -> onnx.ModelProto:
    """The first pass as one MatMul (run single-threaded beside the body): [Q^T h, ||h - Q Q^T h||, h . mu] (B, r+2)
    times [a_t; eps; 1] (r+2, V) = every row's upper bound s_i + ||h - Q Q^T h|| eps_i, in one read of the table."""
    f = onnx.TensorProto.FLOAT
    r, V = a_t.shape
    table = np.concatenate([a_t, eps[None], np.ones((1, V), dtype=np.float32)]).astype(np.float32)
    node = helper.make_node("MatMul", [BOUND_INPUT, "bound_table"], [BOUND_OUTPUT])
    graph = helper.make_graph(
        [node],
        "gpt2edge_sparse_bounds",
        [helper.make_tensor_value_info(BOUND_INPUT, f, ["batch", r + 2])],
        [helper.make_tensor_value_info(BOUND_OUTPUT, f, ["batch", V])],
        [numpy_helper.from_array(table, "bound_table")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(opset.version, 13))], ir_version=8)
