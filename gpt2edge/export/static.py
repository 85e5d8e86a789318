"""Static-shape graphs (`gpt2edge export --static BATCHxCHUNKxCAPACITY`): no symbolic dimension anywhere, for
NNAPI / CoreML and other compilers that need every shape at load time.

Contract of one graph (B = batch, C = chunk, N = capacity; every shape fixed):

    in  input_ids              int64    (B, C)          a chunk of tokens; a prompt's last chunk is padded at its end
    in  attention_mask         int64    (B, N)          1 = the slot holds a real token once this chunk is written
    in  position_ids           int64    (B, C)          positions of the chunk's tokens (pads: any valid position)
    in  cache_position         int64    (C,)            the slot each chunk token is written to (start + 0..C-1)
    in  past_key_values.i.key  float32  (B, nh, N, hs)  the fixed-capacity cache (and .value)
    out logprobs               float32  (B, V)          next-token log-probs after the chunk's last real token
    out present.i.key          float32  (B, nh, N, hs)  the cache with the chunk's slots written (and .value)

The cache is written by position, not concatenated: a one-hot (N, C) matrix built from cache_position moves
the chunk's keys/values into their slots with a MatMul and a blend, so no shape depends on how much of the
cache is used, and no Scatter (poorly supported by NNAPI/CoreML) is needed. Attention always spans all N
slots, masked by attention_mask and causality on slots; the row of the last real token is picked with a
one-hot MatMul too, so a padded last chunk needs no extra input. LayerNorm is written out (NNAPI has no
LayerNormalization). Two graphs: prefill (chunk C) and decode (chunk 1; with C = 1 the prefill graph decodes
too), whose weights are stored once, in WEIGHTS_FILE. The runtime side is gpt2edge.runtime.model.static_lm.

Reuses ExportableGPT2's modules (same weights, same maths as the dynamic `concat` graph); model.py is not
touched.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from gpt2edge.errors import ExportError
from gpt2edge.export.model import ExportableGPT2
from gpt2edge.export.onnx_graph import io_names
from gpt2edge.export.options import (
    DEFAULT_OPSET,
    StaticShape,
    check_opset,
    check_static_capacity,
    parse_static_spec,
)
from gpt2edge.manifest import current_umask

PREFILL_FILE = "prefill.onnx"
DECODE_FILE = "decode.onnx"
WEIGHTS_FILE = "weights.data"  # the weights of both graphs, each tensor stored once


def parse_static(spec: str, n_positions: int) -> StaticShape:
    """'1x64x1024' -> StaticShape(1, 64, 1024), checked against the model's position table."""
    shape = parse_static_spec(spec)
    check_static_capacity(shape, n_positions)
    return shape


class StaticGPT2(nn.Module):
    """forward(input_ids, attention_mask, position_ids, cache_position, *past) -> (logprobs, *presents) for
    one chunk size and capacity (see the module docstring).

    NNAPI partitioning: the only nodes with operators NNAPI lacks (Equal, LessOrEqual, the final LogSoftmax)
    read graph inputs and constants only, or end the graph; everything else (MatMul, Add, Mul, Sub, Softmax,
    ReduceMean, Sqrt, Div, Tanh, Pow, Cast, Reshape, Transpose, Split, Gather) is supported, so ONNX Runtime's
    partitioner can give NNAPI the whole body as one partition."""

    def __init__(self, model: ExportableGPT2, chunk: int, capacity: int) -> None:
        super().__init__()
        if model.kv_cache != "concat" or model.head != "last":
            raise ExportError("Static graphs are built from the plain graph (--kv-cache concat, --head last).")
        self.m = model
        # constants, so that the comparisons below read only inputs and initializers
        self.register_buffer("slots", torch.arange(capacity).view(capacity, 1), persistent=False)  # (N, 1)
        self.register_buffer("ones", torch.ones(chunk, 1), persistent=False)  # (C, 1)
        self.register_buffer("shift", torch.diag(torch.ones(chunk - 1), -1), persistent=False)  # (C, C)

    def forward(self, input_ids, attention_mask, position_ids, cache_position, *past):
        m = self.m
        x = m.wte(input_ids) + m.wpe(position_ids)  # (B, C, E)
        to_slot, keep, bias, pick = self._masks(attention_mask, cache_position, x.dtype)
        presents = []
        for i, block in enumerate(m.h):
            h = _layer_norm(block.ln_1, x)
            a, k, v = _attention(block.attn, h, past[2 * i], past[2 * i + 1], to_slot, keep, bias)
            x = x + a
            x = x + block.mlp(_layer_norm(block.ln_2, x))
            presents += [k, v]
        x = torch.matmul(pick, x).squeeze(1)  # (B, 1, C) @ (B, C, E) -> (B, E): the last real token's row
        x = _layer_norm(m.ln_f, x)
        head = m.wte.weight if m.lm_head is None else m.lm_head
        return (torch.log_softmax(torch.nn.functional.linear(x, head).float(), dim=-1), *presents)

    def _masks(self, attention_mask, cache_position, dtype):
        """What the layers need from the integer inputs, computed once:
        to_slot (N, C) one-hot chunk token -> slot; keep (1, 1, N, 1) 0 where the chunk writes, else 1;
        bias (B, 1, C, N) 0 where query i may see slot j (a real slot, j <= its own), else -1e4 (a padded
        query's row stays finite: its softmax is uniform); pick (B, 1, C) one-hot of the chunk's last real token."""
        B, N = attention_mask.shape
        to_slot = (self.slots == cache_position).to(dtype)  # (N, 1) vs (C,) -> (N, C)
        causal = (self.slots <= cache_position).to(dtype).t()  # (C, N): slot j <= query i's slot
        keep = (1 - torch.matmul(to_slot, self.ones)).view(1, 1, N, 1)
        mask = attention_mask.to(dtype)  # (B, N)
        allowed = causal.unsqueeze(0).unsqueeze(0) * mask.view(B, 1, 1, N)  # (B, 1, C, N)
        # -1e4, not the dtype's minimum: exp() of it is exactly 0 in float32 and it survives float16 accelerators
        bias = allowed * 1e4 - 1e4
        # a chunk token is real if its slot is marked; the last real one is real with no real successor
        real = torch.matmul(mask, to_slot)  # (B, C)
        pick = real - real * torch.matmul(real, self.shift)  # shift: column i holds row i+1
        return to_slot, keep, bias, pick.unsqueeze(1)


def _layer_norm(ln: nn.LayerNorm, x):
    """LayerNorm from ReduceMean/Sub/Mul/Sqrt/Div (NNAPI has no LayerNormalization); same maths."""
    mean = x.mean(-1, keepdim=True)
    d = x - mean
    var = (d * d).mean(-1, keepdim=True)
    return d / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def _attention(attn, x, past_k, past_v, to_slot, keep, bias):
    """GPT-2 attention over a fixed-capacity cache: write the chunk's k/v into their slots, attend over all N."""
    B, C, E = x.shape
    q, k, v = attn.c_attn(x).split(E, dim=2)
    # (B, C, E) -> (B, nh, C, hs)
    q, k, v = (t.view(B, C, attn.n_head, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    # (N, C) @ (B, nh, C, hs) -> (B, nh, N, hs): each written slot receives its token, the others keep the past
    k = past_k * keep + torch.matmul(to_slot, k)
    v = past_v * keep + torch.matmul(to_slot, v)
    att = torch.matmul(q, k.transpose(-1, -2)) * attn.scale + bias  # (B, nh, C, N)
    y = torch.matmul(torch.softmax(att, dim=-1), v)  # (B, nh, C, hs)
    return attn.c_proj(y.transpose(1, 2).reshape(B, C, E)), k, v


def example_inputs(model: ExportableGPT2, shape: StaticShape, chunk: int) -> tuple:
    """Inputs of the traced shapes (a prefill chunk, or 1 for the decode graph)."""
    d = model.dims
    B, N = shape.batch, shape.capacity
    ids = torch.zeros(B, chunk, dtype=torch.long)
    mask = torch.zeros(B, N, dtype=torch.long)
    mask[:, :chunk] = 1
    pos = torch.arange(chunk).expand(B, chunk).contiguous()
    cache_position = torch.arange(chunk)
    past = tuple(torch.zeros(B, d.n_head, N, d.head_dim) for _ in range(2 * d.n_layer))
    return ids, mask, pos, cache_position, *past


def static_io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """The dynamic graph's names with cache_position after position_ids."""
    inputs, outputs = io_names(n_layer)
    return [*inputs[:3], "cache_position", *inputs[3:]], outputs


def export_static(model: ExportableGPT2, out_dir: Path, shape: StaticShape, opset: int = DEFAULT_OPSET) -> list[str]:
    """Write the prefill graph (chunk C) and, when C > 1, the decode graph (chunk 1) into out_dir, their
    weights once in WEIGHTS_FILE; returns the file names (the prefill graph first)."""
    check_opset(opset)
    out_dir = Path(out_dir)
    graphs = [(PREFILL_FILE, shape.chunk)] + ([(DECODE_FILE, 1)] if shape.chunk > 1 else [])
    inputs, outputs = static_io_names(model.dims.n_layer)
    for name, chunk in graphs:
        module = StaticGPT2(model, chunk, shape.capacity).eval()
        try:
            # as onnx_graph.export_graph: progress prints off stdout, exporter registration warnings silenced
            with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
                program = torch.onnx.export(
                    module,
                    example_inputs(model, shape, chunk),
                    input_names=inputs,
                    output_names=outputs,
                    opset_version=opset,
                    dynamo=True,
                    verbose=False,
                )
                # external data from the start: a graph over 2 GB cannot be one protobuf
                program.save(str(out_dir / name), external_data=True)
        except Exception as e:  # the exporter raises many types; name the step that failed
            msg = str(e).splitlines()[0] if str(e) else ""
            raise ExportError(f"Tracing the static {name} graph failed: {type(e).__name__}: {msg}") from e
    return _share_weights(out_dir, [name for name, _ in graphs])


def _share_weights(out_dir: Path, names: list[str]) -> list[str]:
    """Store the first graph's large initializers in WEIGHTS_FILE, and point every other graph's identical
    initializers (same name, same bytes) at the same bytes: two graphs, one copy of the weights. The
    exporter's own per-graph data files are removed."""
    import hashlib

    import onnx
    from onnx.external_data_helper import set_external_data

    def digest(t) -> str:
        return hashlib.sha256(onnx.numpy_helper.to_array(t).tobytes()).hexdigest()

    exporter_data = {p for name in names for p in out_dir.glob(name + "*.data")}
    first = onnx.load(str(out_dir / names[0]))
    stored = {t.name: digest(t) for t in first.graph.initializer}
    onnx.save_model(first, str(out_dir / names[0]), save_as_external_data=True, location=WEIGHTS_FILE)
    del first
    first = onnx.load(str(out_dir / names[0]), load_external_data=False)
    where = {
        t.name: {e.key: e.value for e in t.external_data}
        for t in first.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    }
    for name in names[1:]:
        model = onnx.load(str(out_dir / name))
        for t in model.graph.initializer:
            if t.name in where and digest(t) == stored[t.name]:
                e = where[t.name]
                set_external_data(t, WEIGHTS_FILE, int(e.get("offset", 0)), int(e["length"]))
                t.ClearField("raw_data")
                t.data_location = onnx.TensorProto.EXTERNAL
        onnx.save_model(model, str(out_dir / name))
    for p in exporter_data - {out_dir / WEIGHTS_FILE}:
        p.unlink()
    # onnx's C++ writer creates the data file private (0600); it gets the permissions of the folder's other files
    (out_dir / WEIGHTS_FILE).chmod(0o666 & ~current_umask())
    return [*names, WEIGHTS_FILE]


def static_io_spec(model: ExportableGPT2, shape: StaticShape) -> dict[str, list[dict]]:
    """Names, dtypes and (all numeric) shapes of the prefill graph's inputs and outputs, for the manifest; the
    decode graph's are the same with chunk 1."""
    d = model.dims
    B, C, N = shape.batch, shape.chunk, shape.capacity
    kv = [B, d.n_head, N, d.head_dim]
    inputs, outputs = static_io_names(d.n_layer)
    first = [([B, C], inputs[0]), ([B, N], inputs[1]), ([B, C], inputs[2]), ([C], inputs[3])]
    return {
        "inputs": [
            *({"name": n, "dtype": "int64", "shape": s} for s, n in first),
            *({"name": n, "dtype": "float32", "shape": kv} for n in inputs[4:]),
        ],
        "outputs": [
            {"name": outputs[0], "dtype": "float32", "shape": [B, d.vocab_size]},
            *({"name": n, "dtype": "float32", "shape": kv} for n in outputs[1:]),
        ],
    }


def symbolic_values(path: Path) -> list[str]:
    """Names of every input, output and inferred value whose shape is not fully fixed (empty = all static)."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    g = model.graph
    values = [*g.input, *g.output, *g.value_info]
    return [
        v.name
        for v in values
        if v.type.HasField("tensor_type")
        and (
            not v.type.tensor_type.HasField("shape")
            or any(not d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)
        )
    ]
