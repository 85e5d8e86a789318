"""Graph surgery for a vocabulary-trimmed head: the LM head reads only the kept rows of its table.

Every gpt2edge graph ends  h_last -> head (x @ table^T) -> [Cast] -> LogSoftmax -> [Casts] -> logprobs.  Giving
the head the kept rows only makes LogSoftmax normalise over the kept logits, which is exactly the full model's
log-softmax restricted to the kept ids and renormalised. The head is a Gemm (fp32, fp16, a head kept fp32) or
a MatMulNBits over the packed table (int8 / int4): its packed rows, scales and zero points are all indexed by
the output column (the N axis), so slicing axis 0 of each trims it.

The input embedding stays whole (prompts encode and embed unchanged): when the head's table is also read by
the token-embedding Gather (tied weights), the head gets a sliced copy and the Gather keeps the full table,
which adds K/V of the table to the file but is never read whole again; a table only the head reads (an untied
head) is replaced by its slice.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2edge.errors import TrimError
from gpt2edge.quantize.graph import producers

OUTPUT = "logprobs"
_PASS_THROUGH = ("Cast", "LogSoftmax")  # ops between the head and the output, each keeping the (B, V) shape


def find_head(graph: onnx.GraphProto) -> tuple[onnx.NodeProto, list[str]]:
    """The node computing the logits, and the tensors from its output to `logprobs` (all (B, V))."""
    made_by = producers(graph)
    path, t, softmax = [], OUTPUT, 0
    while t in made_by and made_by[t].op_type in _PASS_THROUGH:
        softmax += made_by[t].op_type == "LogSoftmax"
        path.append(t)
        t = made_by[t].input[0]
    if softmax != 1 or t not in made_by:
        raise TrimError("The graph does not end in a log-softmax head; export it again with this gpt2edge.")
    path.append(t)
    return made_by[t], path


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _sliced_inputs(head: onnx.NodeProto, vocab_size: int) -> list[int]:
    """Positions of the head's inputs indexed by the output column; refuses a head this module cannot trim."""
    a = _attrs(head)
    if head.op_type == "Gemm" and a.get("transB") == 1 and not a.get("transA", 0):
        return [1, 2] if len(head.input) > 2 and head.input[2] else [1]  # (V, C) table, (V,) bias
    if head.op_type == "MatMulNBits" and a.get("N") == vocab_size:
        if len(head.input) > 4 and head.input[4]:
            raise TrimError("The head's MatMulNBits has a g_idx input; trim the fp32 parent and quantize after.")
        # packed (N, kb, blob), scales (N, kb), zero points (N, ...), [g_idx], bias (N,)
        return [i for i in (1, 2, 3, 5) if len(head.input) > i and head.input[i]]
    raise TrimError(f"The head is a {head.op_type} {a}; gpt2edge trims Gemm and MatMulNBits heads only.")


def _slice_rows(init: onnx.TensorProto, kept: np.ndarray, vocab_size: int) -> np.ndarray:
    """The kept rows of a tensor indexed by output column (a flat one is viewed as (V, -1) first)."""
    arr = numpy_helper.to_array(init)
    flat = arr.ndim == 1 and arr.size != vocab_size and arr.size % vocab_size == 0  # e.g. scales stored flat
    rows = arr.reshape(vocab_size, -1) if flat else arr
    if rows.shape[0] != vocab_size:
        raise TrimError(f"The head's {init.name} has shape {arr.shape}, not {vocab_size} rows; re-export the model.")
    out = np.ascontiguousarray(rows[kept])
    return out.reshape(-1) if flat else out


def trim_head(model: onnx.ModelProto, kept: np.ndarray, vocab_size: int) -> onnx.ModelProto:
    """A copy of `model` whose `logprobs` cover the ascending ids `kept` only: (B, K), renormalised over them."""
    kept = np.asarray(kept, dtype=np.int64)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    head, path = find_head(g)
    inits = {i.name: i for i in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    dropped = set()
    for pos in _sliced_inputs(head, vocab_size):
        name = head.input[pos]
        if name not in inits:
            raise TrimError(f"The head reads {name}, which is not a stored weight; re-export the model.")
        sliced = numpy_helper.from_array(_slice_rows(inits[name], kept, vocab_size), f"{name}.kept")
        g.initializer.append(sliced)
        head.input[pos] = sliced.name
        if readers[name] == 1:  # only the head read it (an untied head): the slice replaces it
            dropped.add(name)
    if head.op_type == "MatMulNBits":
        for a in head.attribute:
            if a.name == "N":
                a.i = int(kept.size)
    kept_inits = [i for i in g.initializer if i.name not in dropped]
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    # the (B, V) shapes recorded along the head's path are now (B, K): drop them, and set the output's
    stale = set(path) | dropped
    kept_info = [v for v in g.value_info if v.name not in stale]
    del g.value_info[:]
    g.value_info.extend(kept_info)
    out = next(o for o in g.output if o.name == OUTPUT)
    last = out.type.tensor_type.shape.dim[-1]
    last.Clear()
    last.dim_value = int(kept.size)
    return model
