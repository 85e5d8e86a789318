"""Weight-only block quantization of an exported graph: every weight MatMul becomes a MatMulNBits.

The tied embedding / LM head is quantized once: the head's Gemm becomes a MatMulNBits over the packed table,
and the embedding lookup becomes one GatherBlockQuantized reading rows of that same packed table (a lookup of
a few rows costs nothing next to the head's full read). The file holds the table once, at the head's width.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2edge.errors import QuantizeError
from gpt2edge.onnx_io.stats import reader_ops
from gpt2edge.onnx_io.stream import tensor_array
from gpt2edge.quantize.primitives import (
    POSITION_BLOCK_SIZE,
    BlockQuantized,
    embedding_block_size,
    quantize_blockwise,
    unpack_codes,
)

MS_DOMAIN = "com.microsoft"


def matmulnbits_node(
    name: str, a: str, prefix: str, q: BlockQuantized, out: str, accuracy_level: int
) -> tuple[list, list]:
    """The MatMulNBits node for y = a @ W and its initializers (packed, scales, zero points)."""
    inits = [
        numpy_helper.from_array(q.packed, f"{prefix}.q{q.bits}"),
        numpy_helper.from_array(q.scales, f"{prefix}.scales"),
    ]
    inputs = [a, inits[0].name, inits[1].name]
    if q.zero_points is not None:
        inits.append(numpy_helper.from_array(q.zero_points, f"{prefix}.zero_points"))
        inputs.append(inits[2].name)
    attrs = dict(K=q.K, N=q.N, bits=q.bits, block_size=q.block_size)
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    node = helper.make_node("MatMulNBits", inputs, [out], name=name, domain=MS_DOMAIN, **attrs)
    return [node], inits


def dynamic_int8_node(name: str, a: str, prefix: str, w: np.ndarray, out: str) -> tuple[list, list]:
    """y = a @ W as DynamicQuantizeMatMul: W (K, N) as int8 codes with one symmetric scale per column; the
    activations are quantized to uint8 at run time (ONNX Runtime's u8s8 GEMM, which has AMX kernels)."""
    scale = np.abs(w).max(axis=0) / 127.0  # (N,)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)  # (K, N)
    inits = [numpy_helper.from_array(codes, f"{prefix}.i8"), numpy_helper.from_array(scale, f"{prefix}.colscale")]
    node = helper.make_node(
        "DynamicQuantizeMatMul", [a, inits[0].name, inits[1].name], [out], name=name, domain=MS_DOMAIN
    )
    return [node], inits


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _gather_rows(node: onnx.NodeProto, prefix: str, q: BlockQuantized) -> tuple[list, list]:
    """Replace Gather(table, ids) by a lookup in the packed table that dequantizes the rows: (..., C) float32."""
    if q.k_blocks * q.block_size != q.K:
        raise QuantizeError(f"n_embd={q.K} must be a multiple of --block-size {q.block_size} for the embedding.")
    if q.bits == 4 and q.zero_points is not None:
        return _dequant_gather_4bit_zp(node, prefix, q)
    return _gather_block_quantized(node, prefix, q)


def _gather_block_quantized(node: onnx.NodeProto, prefix: str, q: BlockQuantized) -> tuple[list, list]:
    """One GatherBlockQuantized (ONNX Runtime >= 1.23) on the packed table (rows, k_blocks, blob) that
    MatMulNBits reads too; each block is its last axis. It wants scales / zero points of the table's rank:
    Reshapes of the 2-D ones (folded into constants at load; the file keeps one copy)."""
    ids, out = node.input[1], node.output[0]
    p = f"{prefix}.embed"
    inits = [_const(f"{p}.per_block", [0, 0, 1]), _const(f"{p}.flat", [0, 0, -1])]
    nodes = [helper.make_node("Reshape", [f"{prefix}.scales", f"{p}.per_block"], [f"{p}.scales"])]  # (rows, kb, 1)
    inputs = [f"{prefix}.q{q.bits}", ids, f"{p}.scales"]
    if q.zero_points is not None:  # 8-bit: one byte per block, (rows, kb) -> (rows, kb, 1)
        nodes.append(helper.make_node("Reshape", [f"{prefix}.zero_points", f"{p}.per_block"], [f"{p}.zero_points"]))
        inputs.append(f"{p}.zero_points")
    attrs = dict(bits=q.bits, block_size=q.block_size, gather_axis=0, quantize_axis=2)
    nodes += [
        helper.make_node("GatherBlockQuantized", inputs, [f"{p}.blocks"], domain=MS_DOMAIN, **attrs),  # (B, S, kb, bs)
        helper.make_node("Reshape", [f"{p}.blocks", f"{p}.flat"], [out]),  # (B, S, C)
    ]
    return nodes, inits


def _dequant_gather_4bit_zp(node: onnx.NodeProto, prefix: str, q: BlockQuantized) -> tuple[list, list]:
    """4-bit rows with zero points, dequantized by hand: ONNX Runtime before 1.27 reads GatherBlockQuantized's
    4-bit zero points packed across blocks (wrong rows for this table's layout), so only this form keeps it."""
    ids, out = node.input[1], node.output[0]
    p = f"{prefix}.embed"
    nodes = [helper.make_node("Gather", [f"{prefix}.q4", ids], [f"{p}.codes"], axis=0)]  # (B, S, kb, blob)
    inits = [_const(f"{p}.shape", [0, 0, q.k_blocks * q.block_size]), _const(f"{p}.last_axis", [-1])]
    # two codes per byte, low nibble first: split, interleave on a new last axis, flatten it back
    inits += [_const(f"{p}.lowmask", np.uint8(0x0F)), _const(f"{p}.four", np.uint8(4))]
    inits += [_const(f"{p}.unpacked_shape", [0, 0, q.k_blocks, q.block_size])]
    # zero points are packed two per byte too: keep an unpacked copy for the rows (rows x k_blocks bytes)
    zp = unpack_codes(q.zero_points, q.bits)[:, : q.k_blocks]
    inits.append(numpy_helper.from_array(np.ascontiguousarray(zp), f"{p}.zero_points_u8"))
    nodes += [
        helper.make_node("BitwiseAnd", [f"{p}.codes", f"{p}.lowmask"], [f"{p}.lo"]),
        helper.make_node("BitShift", [f"{p}.codes", f"{p}.four"], [f"{p}.hi"], direction="RIGHT"),
        helper.make_node("Unsqueeze", [f"{p}.lo", f"{p}.last_axis"], [f"{p}.lo1"]),
        helper.make_node("Unsqueeze", [f"{p}.hi", f"{p}.last_axis"], [f"{p}.hi1"]),
        helper.make_node("Concat", [f"{p}.lo1", f"{p}.hi1"], [f"{p}.pairs"], axis=-1),
        helper.make_node("Reshape", [f"{p}.pairs", f"{p}.unpacked_shape"], [f"{p}.codes4"]),
        helper.make_node("Cast", [f"{p}.codes4"], [f"{p}.codes_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", [f"{prefix}.scales", ids], [f"{p}.scale"], axis=0),  # (B, S, kb)
        helper.make_node("Unsqueeze", [f"{p}.scale", f"{p}.last_axis"], [f"{p}.scale1"]),
        helper.make_node("Gather", [f"{p}.zero_points_u8", ids], [f"{p}.zp"], axis=0),
        helper.make_node("Cast", [f"{p}.zp"], [f"{p}.zp_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [f"{p}.zp_f", f"{p}.last_axis"], [f"{p}.zp1"]),
        helper.make_node("Sub", [f"{p}.codes_f", f"{p}.zp1"], [f"{p}.centered"]),
        helper.make_node("Mul", [f"{p}.centered", f"{p}.scale1"], [f"{p}.blocks"]),  # (B, S, kb, bs)
        helper.make_node("Reshape", [f"{p}.blocks", f"{p}.shape"], [out]),  # (B, S, C)
    ]
    return nodes, inits


def _axis(node: onnx.NodeProto) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)


def _is_float_table(init: onnx.TensorProto | None, readers: set[str] | None) -> bool:
    """A 2-D float initializer that only Gathers read (a table the fp32 head also reads stays fp32)."""
    return (
        init is not None and len(init.dims) == 2 and init.data_type == onnx.TensorProto.FLOAT and readers == {"Gather"}
    )


def _transposed_tables(g: onnx.GraphProto, inits: dict[str, onnx.TensorProto]) -> dict[str, str]:
    """Transpose(perm [1, 0]) outputs of 2-D float initializers read only as a MatMul's weight -> the
    initializer: the head of a graph that returns several positions."""
    heads = {
        n.output[0]: n.input[0]
        for n in g.node
        if n.op_type == "Transpose"
        and n.input[0] in inits
        and len(inits[n.input[0]].dims) == 2
        and inits[n.input[0]].data_type == onnx.TensorProto.FLOAT
        and [int(v) for a in n.attribute if a.name == "perm" for v in a.ints] == [1, 0]
    }
    for n in g.node:
        for i, name in enumerate(n.input):
            if name in heads and (n.op_type != "MatMul" or i != 1):
                del heads[name]  # read otherwise too: left as it is
    return heads


def quantize_weights(
    model: onnx.ModelProto,
    bits: int,
    block_size: int,
    head_bits: int | None,
    head_block_size: int,
    accuracy_level: int = 0,
    symmetric: bool = False,
    layer_op: str = "MatMulNBits",
    base_dir: Path | None = None,
    in_place: bool = False,
) -> onnx.ModelProto:
    """Rewrite `model` (an fp32 gpt2edge export) and return the new model (the input is not modified):
    - every MatMul with a 2-D weight -> MatMulNBits at `bits` / `block_size`;
    - the head Gemm (tied embedding), or a --head tail/all graph's MatMul(x, Transpose(table)), -> MatMulNBits
      at `head_bits` / `head_block_size` (None: stays fp32), and the token-embedding Gather reads the same packed
      table;
    - other embedding tables (positions) -> 8-bit rows dequantized in the graph;
    - layer_op "DynamicQuantizeMatMul" (8 bits only): the layers' MatMuls become per-column int8
      DynamicQuantizeMatMul instead (the head and tables as above).

    Streaming: `model` may be loaded without its external data (gpt2edge.onnx_io.stream.load_graph); each weight
    is then read from `base_dir` when it is quantized, so only one fp32 matrix is in memory at a time, and the
    fp32 tensors kept (LayerNorm, biases) stay external references for the writer to copy. `in_place`: rewrite
    `model` itself instead of a copy (a copy of a loaded 1.4 GB graph is 1.4 GB more)."""
    if not in_place:
        model = onnx.ModelProto.FromString(model.SerializeToString())

    def array(init) -> np.ndarray:
        return tensor_array(init, base_dir) if base_dir is not None else numpy_helper.to_array(init)

    g = model.graph
    inits = {i.name: i for i in g.initializer}

    new_nodes, new_inits, dropped = [], [], set()
    tables: dict[str, BlockQuantized] = {}  # embedding tables (row-major (V, C)), read by head and Gather
    packed: dict[str, BlockQuantized] = {}  # every quantized weight, by initializer name
    # a --head tail (or all) export's head is MatMul(x, Transpose(table)) on (B, keep, C): the same x @ table.T
    # as the last-position head's Gemm, so it becomes the same MatMulNBits (which takes a 3-D A); the Transpose
    # goes with it. Without head_bits both stay fp32.
    head_of = _transposed_tables(g, inits) if head_bits is not None else {}
    for n in g.node:
        if n.op_type == "Transpose" and n.output[0] in head_of:
            continue  # the head's MatMulNBits reads the packed table itself
        weight = n.input[1] if len(n.input) > 1 else None
        tail_head = n.op_type == "MatMul" and weight in head_of
        if tail_head:
            weight = head_of[weight]  # the table itself: packed as the Gemm head's, shared with its Gather
        if n.op_type == "MatMul" and layer_op == "DynamicQuantizeMatMul" and weight in inits and not tail_head:
            if bits != 8:
                raise QuantizeError("DynamicQuantizeMatMul layers are 8-bit; use MatMulNBits for int4.")
            if len(inits[weight].dims) == 2:
                nodes, qi = dynamic_int8_node(n.name, n.input[0], weight, array(inits[weight]), n.output[0])
                if weight in dropped:  # shared by two nodes: the codes are already there
                    qi = []
                new_nodes += nodes
                new_inits += qi
                dropped.add(weight)
                continue
        if weight in packed and n.op_type in ("MatMul", "Gemm"):
            q = packed[weight]  # a weight the exporter shared between two nodes: packed once, read twice
        elif tail_head or (n.op_type == "Gemm" and weight in inits and head_bits is not None):
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            if not tail_head and (attrs.get("transB") != 1 or attrs.get("transA", 0) or len(n.input) > 2):
                raise QuantizeError(f"Unexpected head Gemm {n.name} {attrs}; re-export with this gpt2edge.")
            table = array(inits[weight])  # (V, C): the head is x @ table.T
            block = embedding_block_size(table.shape[1], head_block_size)
            q = tables[weight] = quantize_blockwise(table.T, head_bits, block, symmetric)
        elif n.op_type == "MatMul" and weight in inits and len(inits[weight].dims) == 2:
            w = array(inits[weight])  # (K, N)
            q = quantize_blockwise(w, bits, block_size, symmetric)
        else:
            new_nodes.append(n)
            continue
        nodes, qi = matmulnbits_node(n.name, n.input[0], weight, q, n.output[0], accuracy_level)
        new_nodes += nodes
        if weight not in packed:
            new_inits += qi
            packed[weight] = q
            dropped.add(weight)

    # embedding Gathers: the head's table is already packed; float tables read only by Gathers get 8-bit rows
    readers = reader_ops(g)
    final_nodes = []
    for n in new_nodes:
        table = n.input[0] if n.op_type == "Gather" and _axis(n) == 0 else None
        if table is not None and table not in tables and _is_float_table(inits.get(table), readers.get(table)):
            w = array(inits[table])  # (rows, C)
            block = embedding_block_size(w.shape[1], POSITION_BLOCK_SIZE)
            q = tables[table] = quantize_blockwise(w.T, 8, block, symmetric)
            new_inits += [
                numpy_helper.from_array(q.packed, f"{table}.q8"),
                numpy_helper.from_array(q.scales, f"{table}.scales"),
            ]
            if q.zero_points is not None:
                new_inits.append(numpy_helper.from_array(q.zero_points, f"{table}.zero_points"))
            dropped.add(table)
        if table in tables:
            nodes, qi = _gather_rows(n, table, tables[table])
            final_nodes += nodes
            new_inits += qi
        else:
            final_nodes.append(n)

    leftover = [n.name for n in final_nodes if any(i in dropped for i in n.input)]
    if leftover:
        raise QuantizeError(f"Weights are still read by unquantized nodes {leftover[:3]}; re-export the model.")
    kept = [i for i in g.initializer if i.name not in dropped]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits)
    del g.node[:]
    g.node.extend(final_nodes)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return model
