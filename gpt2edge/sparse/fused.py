"""The certified step inside the body graph: hidden -> bounds -> TopK -> exact logits of K candidates.

One ONNX Runtime run of the body then returns, besides `hidden` and the cache, per row:
  sparse_ids     (B, K) int64    the K rows of best upper bound;
  sparse_logits  (B, K) float64  their logits: the kernel's activation (h_eff) times the rows in float32,
                                 within ~1e-6 of exact.py's exact arithmetic (the load-time check allows TIE / 8);
  sparse_bar     (B, 1) float64  an upper bound on the logit of every other row: the least candidate's upper
                                 bound or the least selected group's, whichever is higher, plus h . mu and the
                                 float allowance (exact.py's slack).
The runtime certifies a greedy step when the best candidate beats the runner-up and the bar by more than TIE,
and else runs the full head (head.onnx) on `hidden`: one session run for a certified step, no V-wide work in
Python either way. The arithmetic follows gpt2edge.runtime.sparse_head.exact:
  h_eff  the activation the kernel multiplies (level 4: h per block to int8, scale max|h_b| / 127, times the
         reciprocal, round half to even: ONNX Round is numpy's rint), the one thing that must match exactly;
  bounds the projection terms, groups of rows bounded as a whole (Groups), then the selected groups' members'
         bounds, all in float32 (exact.py's slack, ~1e-3 ||h_eff||, covers their rounding: ~1e-5 ||h_eff||);
  logits per block (codes - zero points, exact in float16) . h_eff_b, times the row's block scale, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2edge.sparse.graph import HIDDEN, HeadTable

IDS, LOGITS, BAR = "sparse_ids", "sparse_logits", "sparse_bar"
OUTPUTS = (IDS, LOGITS, BAR)
DEFAULT_CANDIDATES = 128  # k: exact rows per step
DEFAULT_GROUPS = 32  # M: groups whose members' bounds are computed per step
GROUP_SIZE = 64  # S: rows per group
CLUSTERS = 256  # k-means clusters the groups are cut from
GROUP_RANK = 16  # the group bounds' rank (at most the table's): higher ranks widen the groups' radii
PERP_UP = 1 + 1e-5  # ||h_perp|| is computed in float: eps_i is scaled up by this much (as lm.py's first pass does)
P = "sparse_head."  # name prefix of every node and initializer added here
F32, F64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE


class _Builder:
    """Nodes and initializers with unique prefixed names; reductions written for the graph's opset."""

    def __init__(self, opset: int) -> None:
        self.opset, self.nodes, self.inits, self.n, self.names = opset, [], [], 0, set()

    def const(self, name: str, value) -> str:
        if P + name not in self.names:  # one initializer per name (axes are asked for more than once)
            self.names.add(P + name)
            self.inits.append(numpy_helper.from_array(np.asarray(value), P + name))
        return P + name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        self.n += 1
        out = f"{P}{op_type.lower()}_{self.n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def reduce(self, op_type: str, x: str, axis: int, keepdims: int = 1) -> str:
        # ReduceSum takes axes as an input from opset 13, the other reductions from opset 18
        if op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18:
            return self.op(op_type, [x, self.const(f"axes{axis}", np.array([axis], np.int64))], keepdims=keepdims)
        return self.op(op_type, [x], axes=[axis], keepdims=keepdims)


@dataclass
class Groups:
    """The rows cut into G groups of `size` (k-means clusters of the projected rows a_i, cut into chunks; the
    chunks' leftovers pooled), each with a bound on its members' upper bounds (less the common h . mu):
        max_{i in g} (Q^T h) . a_i + ||h_perp|| eps_i  <=  (Q^T h) . c_g + ||Q^T h|| rad_g + ||h_perp|| eps_g
    (c_g the members' mean, rad_g = max ||a_i - c_g||, eps_g = max eps_i: Cauchy-Schwarz), at the coarse rank.
    members (G, size) row ids (the last group padded with its own rows); rows (V, r + 1) float32 [a_i, eps_i] at
    the fine rank, against [Q^T h, ||h_perp||]; table (r_g + 2, G) float32 [c_g; eps_g; rad_g] against
    [Q_g^T h, ||h_perp_g||, ||Q_g^T h||]."""

    members: np.ndarray
    rows: np.ndarray
    table: np.ndarray
    size: int
    q: np.ndarray  # (C, r_g) the group bound's directions (the first r_g of the rank-r table's: nested PCA)
    eps_par: float


def _kmeans(x: np.ndarray, n: int, iters: int = 8) -> np.ndarray:
    """(V, r) -> (V,) cluster labels (Lloyd's iterations from a seeded sample; deterministic)."""
    c = x[np.random.default_rng(0).choice(len(x), n, replace=False)]
    for _ in range(iters):
        lab = ((c * c).sum(1)[None] - 2 * x @ c.T).argmin(1)  # squared distances less the rows' own norms
        for j in range(n):
            m = lab == j
            if m.any():
                c[j] = x[m].mean(0)
    return lab


def group_rows(
    coarse: dict[str, np.ndarray], bounds: dict[str, np.ndarray], size: int = GROUP_SIZE, clusters: int = CLUSTERS
) -> Groups:
    """The groups, bounded with the rank-r_g bound table `coarse` (a low rank keeps the groups' radii small), of
    the rows whose upper bounds come from the rank-r table `bounds` (tables of gpt2edge.sparse.bounds)."""
    a = coarse["a_t"].T.astype(np.float64)
    eps = coarse["eps"].astype(np.float64)
    V, r = a.shape
    lab = _kmeans(a, min(clusters, V))
    chunks, rest = [], []
    for j in range(lab.max() + 1):
        idx = np.flatnonzero(lab == j)
        idx = idx[np.argsort(eps[idx], kind="stable")]  # like eps together: a tighter eps_g
        full = len(idx) // size * size
        chunks += list(idx[:full].reshape(-1, size))
        rest.append(idx[full:])
    rest = np.concatenate(rest)  # leftovers in cluster order: neighbours stay neighbours
    chunks += [rest[s : s + size] for s in range(0, len(rest), size)]
    G = len(chunks)
    members = np.empty((G, size), dtype=np.int64)
    table = np.zeros((r + 2, G))
    for g, idx in enumerate(chunks):
        members[g] = np.resize(idx, size)  # a short group repeats its rows: a repeated best is never certified
        c = a[idx].mean(0).astype(np.float32).astype(np.float64)  # the centre the graph stores
        rad = np.linalg.norm(a[idx] - c, axis=1).max()
        table[:, g] = [*c, eps[idx].max() * PERP_UP, rad * (1 + 1e-6) + 1e-9]  # rounded up: still a bound
    R = bounds["a_t"].shape[0]
    rows = np.empty((V, R + 1), dtype=np.float32)
    rows[:, :R], rows[:, R] = bounds["a_t"].T, bounds["eps"] * np.float32(PERP_UP)
    table = table.astype(np.float32)
    table[-2:] = np.nextafter(table[-2:], np.float32(np.inf))  # eps_g and rad_g stay upper bounds in float32
    return Groups(members, rows, table, size, coarse["q"].astype(np.float32), float(coarse["eps_par"]))


def fused_nodes(
    table: HeadTable, bounds: dict[str, np.ndarray], groups: Groups, slack_scale: float, k: int, m: int, opset: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes (reading `hidden`, writing OUTPUTS) and their initializers; k candidates per row from the
    members of the m best groups."""
    b = _Builder(opset)
    C = len(bounds["mu"])
    G, S = groups.members.shape
    k, m = candidates(k, m, groups)
    quant = table.codes is not None
    bs = table.block_size if quant else C
    kb = -(-C // bs)
    pad = kb * bs - C

    # 1. h_eff (B, C): the activation the head's kernel multiplies
    h = HIDDEN
    if table.kind == "int8-activations":
        hp = b.op("Pad", [h, b.const("pad", np.array([0, 0, 0, pad], np.int64))]) if pad else h
        hb = b.op("Reshape", [hp, b.const("blocks", np.array([0, kb, bs], np.int64))])  # (B, kb, bs)
        sa = b.op("Div", [b.reduce("ReduceMax", b.op("Abs", [hb]), 2), b.const("c127", np.float32(127))])
        # 1 / 0 = inf for an all-zero block: its 0 * inf = NaN reaches the bar, and NaN is never certified
        inv = b.op("Div", [b.const("one", np.float32(1)), sa])
        qa = b.op("Round", [b.op("Mul", [hb, inv])])  # (B, kb, bs) integers in [-127, 127]
        he_p = b.op("Reshape", [b.op("Mul", [qa, sa]), b.const("flat", np.array([0, kb * bs], np.int64))])
        he = b.op("Slice", [he_p, b.const("s0", np.array([0], np.int64)), b.const("sC", np.array([C], np.int64)),
                            b.const("s1", np.array([1], np.int64))]) if pad else he_p  # fmt: skip
    else:
        he = h

    # 2. the bound's terms (float32, tiny): Q^T h_eff, ||h_eff - Q Q^T h_eff|| (the build folds the 1 + 1e-5 that
    #    covers its rounding into eps), h_eff . mu, ||h_eff|| for the float allowance
    q = bounds["q"].astype(np.float32)
    hq = b.op("MatMul", [he, b.const("q", q)])  # (B, r)
    perp = b.reduce("ReduceL2", b.op("Sub", [he, b.op("MatMul", [hq, b.const("q_t", np.ascontiguousarray(q.T))])]), 1)
    hmu = b.op("MatMul", [he, b.const("mu", bounds["mu"].astype(np.float32)[:, None])])  # (B, 1)
    eps_par = max(float(bounds["eps_par"]), groups.eps_par)  # times ||Q^T h|| <= ||h||
    slack = b.op("Mul", [b.reduce("ReduceL2", he, 1), b.const("slack_scale", np.float32(slack_scale + eps_par))])
    if groups.q.shape[1] == q.shape[1]:
        hqg, perpg = hq, perp
    else:  # the group bound's own (lower) rank: the same computation on the first r_g directions
        qg = groups.q.astype(np.float32)
        hqg = b.op("MatMul", [he, b.const("qg", qg)])
        perpg = b.reduce("ReduceL2", b.op("Sub", [he, b.op("MatMul", [hqg, b.const("qg_t", qg.T.copy())])]), 1)
    norm_hq = b.reduce("ReduceL2", hqg, 1)

    # 3. the M groups of best group bound (each >= its members' upper bounds), their members' upper bounds, and
    #    the k best of those: the candidates (TopK unsorted: the least selected value is the bar)
    # h . mu is common to every row: left out of the scores, added to the bar
    gb = b.op("MatMul", [b.op("Concat", [hqg, perpg, norm_hq], axis=1), b.const("group_table", groups.table)])
    gvals, gsel = (f"{P}group_values", f"{P}group_ids")
    b.nodes.append(helper.make_node("TopK", [gb, b.const("m", np.array([m], np.int64))], [gvals, gsel],
                                    name=P + "group_topk", axis=1, largest=1, sorted=0))  # fmt: skip
    # every group left out scores at most the least selected one (none is left out of a small vocabulary)
    gbar = b.const("no_group", np.full((1, 1), -3e38, np.float32)) if m == G else b.reduce("ReduceMin", gvals, 1)
    flat_m = b.const("flat_m", np.array([0, m * S], np.int64))
    members = b.op("Reshape", [b.op("Gather", [b.const("members", groups.members), gsel]), flat_m])  # (B, M*S)
    xm = b.op("Concat", [hq, perp], axis=1)  # (B, r + 1)
    # the groups' rows are stored group by group: one contiguous block per selected group
    rows = b.op("Gather", [b.const("row_table", groups.rows[groups.members]), gsel])  # (B, M, S, r + 1)
    xcol = b.op("Unsqueeze", [xm, b.const("ax13", np.array([1, 3], np.int64))])  # (B, 1, r + 1, 1)
    mub = b.op("Reshape", [b.op("MatMul", [rows, xcol]), flat_m])  # (B, M*S)
    vals, pos = (f"{P}topk_values", f"{P}topk_positions")
    b.nodes.append(helper.make_node("TopK", [mub, b.const("k", np.array([k], np.int64))], [vals, pos],
                                    name=P + "topk", axis=1, largest=1, sorted=0))  # fmt: skip
    cand = b.op("GatherElements", [members, pos], axis=1)  # (B, k) row ids
    b.nodes.append(helper.make_node("Identity", [cand], [IDS], name=P + "ids"))
    # every member left out scores at most the least candidate
    worst = b.op("Max", [b.reduce("ReduceMin", vals, 1), gbar])
    bar = b.op("Add", [worst, b.op("Add", [hmu, slack])])
    b.nodes.append(helper.make_node("Cast", [bar], [BAR], name=P + "bar", to=F64))

    # 4. the candidates' logits (B, k): their rows times the activation the kernel multiplies, in float32 (within
    #    ~1e-6 of exact.py's exact integer arithmetic: the runtime's check and margin cover it)
    ax2 = b.const("ax2", np.array([2], np.int64))
    if not quant:
        w = b.op("Gather", [b.const("weight", table.weight), cand])  # (B, k, C)
        dots = b.op("MatMul", [w, b.op("Unsqueeze", [he, ax2])])  # (B, k, 1)
        b.nodes.append(helper.make_node("Cast", [b.op("Squeeze", [dots, ax2])], [LOGITS], name=P + "logits", to=F64))
        return b.nodes, b.inits
    # codes less zero points: small integers, exact in float16; per block, times the activation's block, then the
    # row's block scales: sum_b scale_ib * (code_ib - zp_ib) . h_eff_b
    zp = np.repeat(table.zero_points.astype(np.int16), bs, axis=1)[:, :C]
    cz = (table.codes.astype(np.int16) - zp).astype(np.float16)
    rows = b.op("Cast", [b.op("Gather", [b.const("codes_less_zero_points", cz), cand])], to=F32)  # (B, k, C)
    mask = (np.arange(C)[:, None] // bs == np.arange(kb)[None]).astype(np.float32)  # (C, kb) block membership
    hbd = b.op("Mul", [b.op("Unsqueeze", [he, ax2]), b.const("blockmask", mask)])  # (B, C, kb) block-diagonal h
    dots = b.op("MatMul", [rows, hbd])  # (B, k, kb)
    sc = b.op("Gather", [b.const("scales", table.scales), cand])  # (B, k, kb)
    logits = b.reduce("ReduceSum", b.op("Mul", [dots, sc]), 2, keepdims=0)
    b.nodes.append(helper.make_node("Cast", [logits], [LOGITS], name=P + "logits", to=F64))
    return b.nodes, b.inits


def groups_for(k: int) -> int:
    """M for k candidates: enough groups that the (M+1)-th group's bound seldom sets the bar."""
    return max(DEFAULT_GROUPS, k // 4)


def slack_scale(bounds: dict[str, np.ndarray]) -> float:
    """exact.py's HeadKernel.scale: the float32 rounding of a member's bound score, per unit of ||h_eff|| (the
    group bounds' float32 rounding is of the same size, far inside it)."""
    r = bounds["q"].shape[1]
    size = float(np.linalg.norm(bounds["mu"])) + float(bounds["a_norm_max"]) + float(bounds["eps_max"])
    return (r + 2) * 1e-5 * size


def candidates(k: int, m: int, groups: Groups) -> tuple[int, int]:
    """(k, m) as the graph uses them: at most G groups, at most their m * size members."""
    G, S = groups.members.shape
    m = min(m, G)
    return max(1, min(k, m * S)), m


def add_fused(body: onnx.ModelProto, table: HeadTable, bounds: dict[str, np.ndarray], groups: Groups,
              slack_scale: float, k: int, m: int) -> None:  # fmt: skip
    """Append the fused nodes to the body graph (in place); OUTPUTS become its last outputs."""
    g = body.graph
    opset = next(o.version for o in body.opset_import if o.domain in ("", "ai.onnx"))
    nodes, inits = fused_nodes(table, bounds, groups, slack_scale, k, m, opset)
    g.node.extend(nodes)
    g.initializer.extend(inits)
    K, _ = candidates(k, m, groups)
    g.output.extend([
        helper.make_tensor_value_info(IDS, onnx.TensorProto.INT64, ["batch", K]),
        helper.make_tensor_value_info(LOGITS, F64, ["batch", K]),
        helper.make_tensor_value_info(BAR, F64, ["batch", 1]),
    ])  # fmt: skip


def standalone(table: HeadTable, bounds: dict[str, np.ndarray], groups: Groups, slack_scale: float, k: int, m: int,
               opset: int = 18) -> onnx.ModelProto:  # fmt: skip
    """The fused part alone, hidden (B, C) -> OUTPUTS (tests and profiling)."""
    C = len(bounds["mu"])
    nodes, inits = fused_nodes(table, bounds, groups, slack_scale, k, m, opset)
    g = helper.make_graph(nodes, "gpt2edge_sparse_fused", [helper.make_tensor_value_info(HIDDEN, F32, ["batch", C])],
                          [helper.make_tensor_value_info(n, t, None) for n, t in
                           zip(OUTPUTS, (onnx.TensorProto.INT64, F64, F64))], inits)  # fmt: skip
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
