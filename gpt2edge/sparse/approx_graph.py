"""The approximate (cluster) head as one ONNX graph: hidden (B, C) -> log-probs (B, V), fixed shapes.

  1. the activation the parent's head kernel multiplies: h, or at MatMulNBits accuracy level 4 h quantized to
     int8 per block (scale max|h_b| / 127, round to nearest even: gpt2edge.runtime.sparse_head.exact's rule);
  2. cluster scores h . centroid_k (B, K) and the best M of them (TopK);
  3. the M clusters' rows gathered from the cluster-ordered table (K, S, C): float32 rows, or the parent's
     MatMulNBits codes (a byte each), zero points and scales; per-block dots against a block-diagonal (C, kb)
     activation (MatMulInteger at level 4, u8 x u8 around a zero point: exact integers, as the kernel's), then
     logit = sum_b scale_b * (dot_b - zero_point_b * sum(h_b)): no per-element dequantization;
  4. every token's logit starts as its cluster's score (the mean logit of its cluster: the estimated tail) and
     the probed tokens' exact logits are scattered over it. A cluster with fewer than S rows is padded with
     copies of one of its rows, which write that row's own logit again;
  5. LogSoftmax over V: a proper log-prob row of the approximate distribution.
With M = K every token is exact and the row is the full head's log-probs (up to float summation order).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2edge.sparse.approx_cluster import Clusters
from gpt2edge.sparse.graph import HIDDEN, HeadTable

OUTPUT = "logprobs"
OPSET = 17  # ReduceMax / ReduceSum(axes input) as used here, ScatterElements, GatherElements, TopK with a K input


class _Graph:
    """Nodes and initializers being collected."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output


def _activation(g: _Graph, table: HeadTable, width: int) -> tuple[str, str | None, str | None]:
    """(h padded to whole blocks (B, Cp) float, the block-diagonal activation (B, Cp, kb) or None for a float
    table, per-block factor (B, 1, kb): the int8 scale at level 4, else None)."""
    if table.codes is None:
        return HIDDEN, None, None
    bs, kb = table.block_size, table.scales.shape[1]
    cp = kb * bs
    x = HIDDEN
    if cp != width:
        x = g.op("Pad", [HIDDEN, g.const("apx_pad", np.array([0, 0, 0, cp - width], np.int64))], "apx_hp")
    hb = g.op("Reshape", [x, g.const("apx_blocks", np.array([-1, kb, bs], np.int64))], "apx_hb")  # (B, kb, bs)
    onehot = np.zeros((kb, bs, kb), np.float32)  # block b of the activation goes to column b
    onehot[np.arange(kb), :, np.arange(kb)] = 1
    ax3 = g.const("apx_ax3", np.array([3], np.int64))
    col, factor = hb, None
    if table.kind == "int8-activations":
        amax = g.op("ReduceMax", [g.op("Abs", [hb], "apx_abs")], "apx_amax", axes=[2], keepdims=1)
        sa = g.op("Div", [amax, g.const("apx_127", np.float32(127))], "apx_sa")  # (B, kb, 1)
        is0 = g.op("Equal", [sa, g.const("apx_0f", np.float32(0))], "apx_is0")
        safe = g.op("Where", [is0, g.const("apx_1f", np.float32(1)), sa], "apx_sa1")  # an all-zero block stays 0
        inv = g.op("Div", [g.const("apx_1f_", np.float32(1)), safe], "apx_inv")
        q = g.op("Round", [g.op("Mul", [hb, inv], "apx_scaled")], "apx_q")  # exact integers in [-127, 127]
        col = q
        factor = g.op("Transpose", [sa], "apx_factor", perm=[0, 2, 1])  # (B, 1, kb)
    col = g.op("Unsqueeze", [col, ax3], "apx_col")  # (B, kb, bs, 1)
    bd = g.op("Mul", [col, g.const("apx_onehot", onehot)], "apx_bd4")  # (B, kb, bs, kb)
    bd = g.op("Reshape", [bd, g.const("apx_bd_shape", np.array([-1, cp, kb], np.int64))], "apx_bd")
    if factor is not None:  # uint8 around a zero point of 128: MatMulInteger's u8u8 GEMM, exact on every CPU
        bd = g.op("Add", [bd, g.const("apx_128f", np.float32(128))], "apx_bd128")
        bd = g.op("Cast", [bd], "apx_bd8", to=onnx.TensorProto.UINT8)
    return x, bd, factor


def cluster_head(table: HeadTable, clusters: Clusters, probe: int, vocab_size: int, width: int) -> onnx.ModelProto:
    """The approximate head graph for `table` (the parent head's, as its kernel reads it) and `clusters`."""
    f = onnx.TensorProto.FLOAT
    V, K, S = vocab_size, len(clusters.centroids), clusters.size
    members = clusters.members()  # (K, S), V at padding slots
    pad = members == V
    members[pad] = np.broadcast_to(np.where(members[:, :1] < V, members[:, :1], 0), members.shape)[pad]
    g = _Graph()
    h, bd, factor = _activation(g, table, width)
    empty = np.bincount(clusters.assign, minlength=K) == 0
    cent = clusters.centroids.T  # (C, K)
    if table.codes is not None:  # padded to whole blocks like the activation
        cent = np.pad(cent, ((0, table.scales.shape[1] * table.block_size - width), (0, 0)))
    cs = g.op("MatMul", [h, g.const("apx_centroids_t", np.ascontiguousarray(cent, np.float32))], "apx_cs0")
    cs = g.op("Add", [cs, g.const("apx_cluster_bias", np.where(empty, -np.inf, 0).astype(np.float32))], "apx_cs")
    probe_k = g.const("apx_probe", np.array([probe], np.int64))
    g.nodes.append(helper.make_node("TopK", [cs, probe_k], ["apx_best", "apx_idx"], axis=-1))  # (B, M)

    def gathered(name: str, table_: np.ndarray, shape: list[int]) -> str:
        """The probed clusters' slice of a (K, S, ...) table, reshaped to `shape`."""
        rows = g.op("Gather", [g.const(f"apx_{name}", table_), "apx_idx"], f"apx_g{name}", axis=0)
        return g.op("Reshape", [rows, g.const(f"apx_{name}_shape", np.array(shape, np.int64))], f"apx_{name}_r")

    if table.codes is None:
        w = gathered("rows", np.ascontiguousarray(table.weight[members]), [-1, probe * S, width])  # (B, M*S, C)
        hcol = g.op("Unsqueeze", [h, g.const("apx_last", np.array([-1], np.int64))], "apx_hc")  # (B, C, 1)
        cand = g.const("apx_cand_shape", np.array([-1, probe * S], np.int64))
        logits = g.op("Reshape", [g.op("MatMul", [w, hcol], "apx_l3"), cand], "apx_logits")
    else:
        kb, bs = table.scales.shape[1], table.block_size
        codes = np.pad(table.codes, ((0, 0), (0, kb * bs - width)))[members]  # (K, S, Cp) uint8
        gc = gathered("codes", codes, [-1, probe * S, kb * bs])  # (B, M*S, Cp)
        if factor is not None:  # exact integer block dots, as the level-4 kernel's
            zp128 = g.const("apx_zp128", np.uint8(128))  # (its u8s8 one saturates on x86 without VNNI)
            dots = g.op("Cast", [g.op("MatMulInteger", [gc, bd, "", zp128], "apx_dots_i")], "apx_dots", to=f)
        else:
            dots = g.op("MatMul", [g.op("Cast", [gc], "apx_gcf", to=f), bd], "apx_dots")  # (B, M*S, kb)
        zp = g.op("Cast", [gathered("zp", table.zero_points[members], [-1, probe * S, kb])], "apx_zpf", to=f)
        sc = gathered("sc", table.scales[members], [-1, probe * S, kb])
        # each block's sum of the activation the dots used, (B, 1, kb): sum over the block-diagonal's rows
        ones = g.const("apx_ax1", np.array([1], np.int64))
        if factor is None:
            hsum = g.op("ReduceSum", [bd, ones], "apx_hsum", keepdims=1)
        else:
            qsum = g.op("ReduceSum", ["apx_bd4", ones], "apx_qsum4", keepdims=1)  # (B, 1, bs, kb)
            hsum = g.op("ReduceSum", [qsum, g.const("apx_ax2", np.array([2], np.int64))], "apx_hsum", keepdims=0)
        t = g.op("Sub", [dots, g.op("Mul", [zp, hsum], "apx_zsum")], "apx_t")  # integers at level 4
        scale = sc if factor is None else g.op("Mul", [sc, factor], "apx_scale")
        tb = g.op("Mul", [t, scale], "apx_tb")
        logits = g.op("ReduceSum", [tb, g.const("apx_axm1", np.array([-1], np.int64))], "apx_logits", keepdims=0)
    tok = gathered("members", members, [-1, probe * S])  # (B, M*S) token ids
    # every token's estimated logit: its cluster's score (GatherElements: a V-wide Gather is ~4x slower in ORT)
    batch = g.op(
        "Slice",
        [
            g.op("Shape", [cs], "apx_cs_shape"),
            *(g.const(n, np.array([v], np.int64)) for n, v in (("apx_0i", 0), ("apx_1i", 1))),
        ],
        "apx_b",
    )
    shape = g.op("Concat", [batch, g.const("apx_v", np.array([V], np.int64))], "apx_bv", axis=0)
    ix = g.op("Expand", [g.const("apx_token_cluster", clusters.assign[None].astype(np.int64)), shape], "apx_ix")
    base = g.op("GatherElements", [cs, ix], "apx_base", axis=1)  # (B, V)
    mixed = g.op("ScatterElements", [base, tok, logits], "apx_mixed", axis=1)
    g.op("LogSoftmax", [mixed], OUTPUT, axis=-1)
    graph = helper.make_graph(
        g.nodes,
        "gpt2edge_cluster_head",
        [helper.make_tensor_value_info(HIDDEN, f, ["batch", width])],
        [helper.make_tensor_value_info(OUTPUT, f, ["batch", V])],
        g.inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
