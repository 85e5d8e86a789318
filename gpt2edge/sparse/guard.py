"""The body graph's certified step behind `If(sparse_step)`, the full head behind `If(sparse_skip_head)`, and the
step's tables for the native path.

ONNX Runtime runs every node of a graph whatever outputs are fetched, so the fused step (fused.py) would cost its
~0.065 ms on every body run. Behind an If on a bool input (OrtGraph feeds its bool inputs True: switches), a
runtime that computes the step natively (gpt2edge.runtime.sparse_head.native) feeds False and the graph skips it;
any other gets the graph's own step, as before. (An input with a default, an initializer of the same name, would
spare other runtimes the feed, but ONNX Runtime's IO binding cannot bind such an input.) The else branch returns
(1, K) placeholders with a NaN bar, which is never certified; only a caller that does not read the outputs
switches the step off.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2edge.runtime.sparse_head.fused import FULL_OUTPUT, HEAD_SWITCH, STEP_INPUT
from gpt2edge.sparse.fused import BAR, IDS, LOGITS, OUTPUTS, Groups, P

TYPES = {IDS: onnx.TensorProto.INT64, LOGITS: onnx.TensorProto.DOUBLE, BAR: onnx.TensorProto.DOUBLE}


def guard_step(body: onnx.ModelProto, first_node: int, k: int) -> None:
    """Move the body's nodes from `first_node` on (the fused step, writing OUTPUTS) into the then branch of an If
    on the new bool input STEP_INPUT, in place."""
    g = body.graph
    nodes = list(g.node[first_node:])
    del g.node[first_node:]
    inner = {name: f"{P}then_{name}" for name in OUTPUTS}
    for n in nodes:
        n.output[:] = [inner.get(o, o) for o in n.output]
    then = helper.make_graph(nodes, "sparse_step_then", [],
                             [helper.make_tensor_value_info(inner[o], TYPES[o], None) for o in OUTPUTS])  # fmt: skip
    placeholders = {
        IDS: np.zeros((1, k), dtype=np.int64),
        LOGITS: np.zeros((1, k), dtype=np.float64),
        BAR: np.full((1, 1), np.nan),  # NaN: FusedReader never certifies it
    }
    g.initializer.extend(numpy_helper.from_array(a, f"{P}none_{name}") for name, a in placeholders.items())
    els = helper.make_graph(
        [helper.make_node("Identity", [f"{P}none_{o}"], [f"{P}else_{o}"], name=f"{P}else_{o}") for o in OUTPUTS],
        "sparse_step_else", [], [helper.make_tensor_value_info(f"{P}else_{o}", TYPES[o], None) for o in OUTPUTS],
    )  # fmt: skip
    g.input.append(helper.make_tensor_value_info(STEP_INPUT, onnx.TensorProto.BOOL, []))
    g.node.append(helper.make_node("If", [STEP_INPUT], list(OUTPUTS), name=f"{P}step", then_branch=then,
                                   else_branch=els))  # fmt: skip


def guard_head(body: onnx.ModelProto, head: onnx.ModelProto) -> None:
    """The parent's head (the head graph's nodes, reading `hidden`) into the body graph too, behind an If on the
    new bool input HEAD_SWITCH: fed True (the default), the If returns a (1, 1) placeholder and no head node runs;
    fed False, the body's run also returns the full head's log-probs as FULL_OUTPUT, computed by the body's own
    thread pool (head.onnx is a second session on one thread: ~2x slower). In place; weights the body already
    holds (a tied fp32 table) are not stored twice."""
    g = body.graph
    have = {i.name for i in g.initializer}
    g.initializer.extend(i for i in head.graph.initializer if i.name not in have)
    out = head.graph.output[0].name
    inner = f"{P}full_{out}"
    nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in head.graph.node]
    for n in nodes:
        n.output[:] = [inner if o == out else o for o in n.output]
    f32 = onnx.TensorProto.FLOAT
    full = helper.make_graph(nodes, "sparse_full_head", [], [helper.make_tensor_value_info(inner, f32, None)])
    g.initializer.append(numpy_helper.from_array(np.zeros((1, 1), dtype=np.float32), f"{P}none_{out}"))
    placeholder = helper.make_node("Identity", [f"{P}none_{out}"], [f"{P}skip_{out}"], name=f"{P}skip_head")
    skip = helper.make_graph([placeholder], "sparse_skip_head", [],
                             [helper.make_tensor_value_info(f"{P}skip_{out}", f32, None)])  # fmt: skip
    g.input.append(helper.make_tensor_value_info(HEAD_SWITCH, onnx.TensorProto.BOOL, []))
    g.node.append(helper.make_node("If", [HEAD_SWITCH], [FULL_OUTPUT], name=f"{P}head", then_branch=skip,
                                   else_branch=full))  # fmt: skip
    g.output.append(helper.make_tensor_value_info(FULL_OUTPUT, f32, None))


def step_arrays(bounds: dict[str, np.ndarray], groups: Groups, slack_scale: float) -> dict[str, np.ndarray]:
    """The arrays the native step reads (runtime/sparse_head/native.py STEP_ARRAYS), as the graph's nodes use them:
    the groups' members and bound table, the group bound's directions, each group's members' [a_i; eps_i]
    transposed to (G, r + 1, S) (one contiguous block per group), and the float allowance per unit ||h_eff||."""
    eps_par = max(float(bounds["eps_par"]), groups.eps_par)
    return {
        "group_members": groups.members.astype(np.int32),
        "group_table": groups.table.astype(np.float32),
        "group_q": groups.q.astype(np.float32),
        "member_rows": np.ascontiguousarray(groups.rows[groups.members].transpose(0, 2, 1), dtype=np.float32),
        "slack_coef": np.array(slack_scale + eps_par, dtype=np.float32),
    }
