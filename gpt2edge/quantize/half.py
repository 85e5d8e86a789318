"""FP16: weights, activations and the KV cache in float16; the overflow-prone parts stay float32.

Kept in float32: LayerNorm (variance of the residual stream), Softmax (the attention probabilities and the
masked scores' floor), LogSoftmax (the output), and the GELU between each MLP's two matmuls (its x**3 term
overflows float16 once |x| > 40). `logprobs` stays a float32 output; the past/present tensors become float16.
"""

from __future__ import annotations

import onnx

from gpt2edge.quantize.graph import producers

FP32_OPS = ["LayerNormalization", "Softmax", "LogSoftmax"]


def gelu_node_names(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes computing each MLP's activation: everything between c_fc's bias Add and the
    c_proj MatMul. Found from the weight names the export gives (h.{i}.mlp.c_fc / c_proj)."""
    g = model.graph
    made_by = producers(g)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    names: list[str] = []
    for fc in (n for n in g.node if n.op_type == "MatMul" and n.input[1].endswith("mlp.c_fc.weight")):
        bias_add = next(c for c in consumers[fc.output[0]] if c.op_type == "Add")
        start = bias_add.output[0]
        # c_proj's MatMul is the one consumer downstream that multiplies by mlp.c_proj.weight
        proj = _downstream(start, consumers, lambda n: n.op_type == "MatMul" and "mlp.c_proj" in n.input[1])
        stack, seen = [proj.input[0]], set()
        while stack:  # walk back from c_proj's input to the bias Add, collecting the activation's nodes
            t = stack.pop()
            if t == start or t in seen or t not in made_by:
                continue
            seen.add(t)
            node = made_by[t]
            names.append(node.name)
            stack += list(node.input)
    return names


def _downstream(start: str, consumers, match) -> onnx.NodeProto:
    frontier, seen = [start], set()
    while frontier:
        t = frontier.pop()
        for n in consumers.get(t, []):
            if match(n):
                return n
            if n.name not in seen:
                seen.add(n.name)
                frontier += list(n.output)
    raise ValueError(f"no matching node downstream of {start}")


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Convert with ONNX Runtime's float16 converter, blocking the parts listed in the module docstring."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    return convert_float_to_float16(
        model,
        keep_io_types=["logprobs"],
        op_block_list=DEFAULT_OP_BLOCK_LIST + FP32_OPS,
        node_block_list=gelu_node_names(model),
    )
