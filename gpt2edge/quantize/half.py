"""FP16: weights, activations and the KV cache in float16; the overflow-prone parts stay float32.

Kept in float32: LayerNorm (variance of the residual stream), Softmax (the attention probabilities and the
masked scores' floor), LogSoftmax (the output), and the GELU between each MLP's two matmuls (its x**3 term
overflows float16 once |x| > 40). `logprobs` stays a float32 output; the past/present tensors become float16.

Streamed like int8/int4: the graph is converted without its weights (ONNX Runtime's converter only flips the
type of a tensor it cannot see), and each weight is read, rounded to float16 and written when the folder is
saved (`Fp16Weights`), so memory holds one fp32 tensor at a time, never the model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from gpt2edge.onnx_io.stream import _external_info, passthrough, tensor_array
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


# elements rounded at a time: ORT's rounding makes ~5 temporaries of its input (the 321 MB gpt2-xl table: 1.6 GB)
CHUNK = 1 << 22


class Fp16Weights:
    """bytes_of for the writer (gpt2edge.onnx_io.stream.save_streaming): a weight the converter turned float16
    while it was still stored outside is read from the parent as float32 and rounded now; any other tensor is
    read as it is (`passthrough`)."""

    def __init__(self, sources: dict[str, onnx.TensorProto], base_dir: Path):
        self.sources, self.base_dir = sources, Path(base_dir)
        self.rest = passthrough(self.base_dir)

    def __call__(self, init: onnx.TensorProto):
        source = self.sources.get(init.name)
        if source is None:
            return self.rest(init)
        return round_fp16(tensor_array(source, self.base_dir))


def round_fp16(w: np.ndarray) -> np.ndarray:
    """float32 -> float16 exactly as ONNX Runtime's converter rounds (tiny magnitudes kept non-zero, overflow
    clipped to +-65504), a chunk at a time."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    flat = w.reshape(-1)
    out = np.empty(flat.shape, np.float16)
    for a in range(0, flat.size, CHUNK):
        out[a : a + CHUNK] = convert_np_to_float16(flat[a : a + CHUNK])
    return out.reshape(w.shape)


def to_fp16(model: onnx.ModelProto, base_dir: Path | None = None) -> tuple[onnx.ModelProto, Fp16Weights]:
    """Convert with ONNX Runtime's float16 converter, blocking the parts listed in the module docstring.

    `model` may be loaded without its external data (gpt2edge.onnx_io.stream.load_graph, weights in `base_dir`).
    The converter reads every tensor it turns float16 (for its shape), so each external float tensor is shown
    to it as an empty stand-in of the same name, after shape inference ran on the real descriptions; the
    converter's choice (float16 or not) is then carried back to the real description, whose bytes the returned
    bytes_of rounds when the model is written. (A Cast the converter puts after an initializer takes its
    value_info from shape inference's, not the stand-in's: tests/folders/test_scale_export.py compares the graphs.)
    Inline tensors are converted by the converter itself. Returns (the float16 model, its bytes_of)."""
    from onnx.shape_inference import infer_shapes
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    blocked = gelu_node_names(model)
    model = infer_shapes(model)  # what the converter would run first; it reads dims, not bytes
    real: dict[str, onnx.TensorProto] = {}
    for init in model.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT and _external_info(init) is not None:
            name = init.name
            real[name] = onnx.TensorProto()
            real[name].CopyFrom(init)  # the fp32 description: where the bytes are, how many
            init.Clear()
            init.name, init.data_type = name, onnx.TensorProto.FLOAT
            init.dims.append(0)  # (0,): an empty array to the converter
    converted = convert_float_to_float16(
        model,
        keep_io_types=["logprobs"],
        disable_shape_infer=True,
        op_block_list=DEFAULT_OP_BLOCK_LIST + FP32_OPS,
        node_block_list=blocked,
    )
    sources = {}
    for init in converted.graph.initializer:
        if init.name not in real:
            continue
        half = init.data_type == onnx.TensorProto.FLOAT16
        init.CopyFrom(real[init.name])
        if half:
            sources[init.name] = real[init.name]
            init.data_type = onnx.TensorProto.FLOAT16
            for entry in init.external_data:  # the description says what will be written: half the bytes
                if entry.key == "length":
                    entry.value = str(int(entry.value) // 2)
    return converted, Fp16Weights(sources, base_dir or Path("."))
