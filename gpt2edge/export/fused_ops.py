"""The shared-cache graph's fused ops: PyTorch reference implementations that export as ONNX Runtime's
`com.microsoft` kernels, one node where the plain graph has many.
The residual adds and LayerNorms stay plain PyTorch (Add + the standard LayerNormalization): ONNX Runtime's
fused SkipLayerNormalization costs the same per decode step but ~4x more at a 128-token prefill on AVX2
(measured: 7.5 ms against 2.8 ms over 24 norms).

| custom op | PyTorch (validation compares against it) | exported as |
|---|---|---|
| padding_bias | (B, 1, S, T) additive mask of the padding only | Cast/Unsqueeze/Where/Expand, once per step |
| attention_lengths | each row's last slot, the total length | Shape/Sub/Cast, once per step |
| fused_attention | write new k/v into the cache buffer, attend over valid causal slots | GroupQueryAttention |
| bias_gelu | GELU(x + bias), tanh or erf form | FastGelu / BiasGelu |

fused_attention contract (T = the attention mask's length = past tokens + S new ones):
  qkv (B, S, 3C) as c_attn writes it, past_k / past_v (B, nh, P, hs) with P >= T (a buffer) or P = T - S (the
  past itself), bias (B, 1, S, T) additive (0 allowed, very negative masked: the padding)
  -> y (B, S, C), present_k / present_v (B, nh, max(P, T), hs): past with slots T-S..T-1 written.
Query i (slot T-S+i) sees key slots <= T-S+i: GroupQueryAttention applies that causal rule itself (from seqlens_k
and the step's length), so the bias leaves it out: a graph without the ~10 Range/Unsqueeze/LessOrEqual/And nodes
that built the causal part every step.
When the runtime binds past and present to the same buffer, ONNX Runtime updates the cache in place: no step
copies it. Every row has the same physical length; left padding is masked by the bias, not by the lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

OP_DOMAIN = "com.microsoft"


@torch.library.custom_op("gpt2edge::padding_bias", mutates_args=())
def padding_bias(attention_mask: torch.Tensor, input_ids: torch.Tensor, floor: float) -> torch.Tensor:
    B, S, T = input_ids.shape[0], input_ids.shape[1], attention_mask.shape[1]
    keep = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
    return torch.where(keep, 0.0, floor).float().expand(B, 1, S, T).contiguous()


@padding_bias.register_fake
def _(attention_mask, input_ids, floor):
    B, S, T = input_ids.shape[0], input_ids.shape[1], attention_mask.shape[1]
    return attention_mask.new_empty(B, 1, S, T, dtype=torch.float32)


@torch.library.custom_op("gpt2edge::attention_lengths", mutates_args=())
def attention_lengths(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = bias.shape[0], bias.shape[-1]
    return torch.full((B,), T - 1, dtype=torch.int32), torch.tensor(T, dtype=torch.int32)


@attention_lengths.register_fake
def _(bias):
    return bias.new_empty(bias.shape[0], dtype=torch.int32), bias.new_empty((), dtype=torch.int32)


@torch.library.custom_op("gpt2edge::fused_attention", mutates_args=())
def fused_attention(
    qkv: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    bias: torch.Tensor,
    last_slot: torch.Tensor,
    total: torch.Tensor,
    n_head: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, C3 = qkv.shape
    C, T = C3 // 3, bias.shape[-1]
    hs, P = C // n_head, past_k.shape[2]
    start = T - S  # slot of the first new token
    # (B, S, 3C) -> three (B, nh, S, hs)
    q, k, v = (t.reshape(B, S, n_head, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
    presents = []
    for past, new in ((past_k, k), (past_v, v)):
        present = past.new_zeros(B, n_head, max(P, T), hs)
        present[:, :, : min(P, start)] = past[:, :, : min(P, start)]
        present[:, :, start:T] = new
        presents.append(present)
    keys, values = presents[0][:, :, :T], presents[1][:, :, :T]  # (B, nh, T, hs)
    causal = torch.arange(T)[None, :] <= torch.arange(start, T)[:, None]  # (S, T), as GroupQueryAttention masks
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale + bias
    att = torch.softmax(scores.masked_fill(~causal, torch.finfo(scores.dtype).min), dim=-1)  # (B, nh, S, T)
    y = torch.matmul(att, values).transpose(1, 2).reshape(B, S, C)
    return y, presents[0], presents[1]


@fused_attention.register_fake
def _(qkv, past_k, past_v, bias, last_slot, total, n_head, scale):
    B, S, C3 = qkv.shape
    _, nh, P, hs = past_k.shape
    slots = torch.sym_max(P, bias.shape[-1])
    return qkv.new_empty(B, S, C3 // 3), past_k.new_empty(B, nh, slots, hs), past_v.new_empty(B, nh, slots, hs)


@torch.library.custom_op("gpt2edge::bias_gelu", mutates_args=())
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh" if tanh else "none")


@bias_gelu.register_fake
def _(x, bias, tanh):
    return torch.empty_like(x)


def onnx_translation() -> dict:
    """{op: onnxscript function} for torch.onnx.export's custom_translation_table (imports onnxscript)."""
    from onnxscript import BOOL, INT32
    from onnxscript import opset18 as op
    from onnxscript.values import Op, Opset

    ms = Opset(OP_DOMAIN, 1)
    gqa_in = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    gqa_in += ["cos_cache", "sin_cache", "position_ids", "attention_bias"]
    gqa = Op(ms, "GroupQueryAttention", _schema(
        "GroupQueryAttention", gqa_in, ["output", "present_key", "present_value"],
        optional=set(gqa_in) - {"query", "seqlens_k", "total_sequence_length"},
        types={"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "P"},
        attributes={"num_heads": ("INT", True), "kv_num_heads": ("INT", True), "scale": ("FLOAT", False)},
    ))  # fmt: skip
    fast_gelu = Op(ms, "FastGelu", _schema("FastGelu", ["X", "bias"], ["Y"], optional={"bias"}))
    erf_gelu = Op(ms, "BiasGelu", _schema("BiasGelu", ["A", "B"], ["C"]))

    def attention_lengths_onnx(bias):
        length = op.Shape(bias, start=3, end=4)  # (1,) int64
        last = op.Expand(op.Sub(length, op.Constant(value_ints=[1])), op.Shape(bias, start=0, end=1))
        return op.Cast(last, to=INT32.dtype), op.Cast(op.Squeeze(length), to=INT32.dtype)

    def padding_bias_onnx(attention_mask, input_ids, floor: float):
        keep = op.Unsqueeze(op.Cast(attention_mask, to=BOOL.dtype), op.Constant(value_ints=[1, 2]))  # (B, 1, 1, T)
        bias = op.Where(keep, op.Constant(value_float=0.0), op.Constant(value_float=floor))
        batch, total = op.Shape(attention_mask, start=0, end=1), op.Shape(attention_mask, start=1, end=2)
        shape = op.Concat(batch, op.Constant(value_ints=[1]), op.Shape(input_ids, start=1, end=2), total, axis=0)
        return op.Expand(bias, shape)  # GroupQueryAttention takes a (B, 1, S, T) bias, not (B, 1, 1, T)

    def fused_attention_onnx(qkv, past_k, past_v, bias, last_slot, total, n_head: int, scale: float):
        return gqa(
            qkv, None, None, past_k, past_v, last_slot, total, None, None, None, bias,
            num_heads=n_head, kv_num_heads=n_head, scale=scale,
        )  # fmt: skip

    def bias_gelu_onnx(x, bias, tanh: bool):
        return fast_gelu(x, bias) if tanh else erf_gelu(x, bias)

    ops = torch.ops.gpt2edge
    return {
        ops.padding_bias.default: padding_bias_onnx,
        ops.attention_lengths.default: attention_lengths_onnx,
        ops.fused_attention.default: fused_attention_onnx,
        ops.bias_gelu.default: bias_gelu_onnx,
    }


# type parameters of the schemas below: float tensors, int32 lengths, int64 positions
_TYPE_PARAMS = {
    "T": (["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float tensors"),
    "M": (["tensor(int32)"], "lengths"),
    "P": (["tensor(int64)"], "positions"),
}


def _schema(
    name: str,
    inputs: list[str],
    outputs: list[str],
    optional: set[str] = frozenset(),
    types: dict[str, str] | None = None,
    attributes: dict[str, tuple[str, bool]] | None = None,
):
    """An onnx OpSchema for the part of a com.microsoft op the graph uses (the onnx package does not ship
    ONNX Runtime's schemas). Parameters are of type T unless `types` says otherwise; `attributes` maps a name
    to (onnx AttrType name, required)."""
    from onnx.defs import OpSchema

    types = types or {}
    opt, one = OpSchema.FormalParameterOption.Optional, OpSchema.FormalParameterOption.Single

    def params(names):
        return [
            OpSchema.FormalParameter(n, types.get(n, "T"), param_option=opt if n in optional else one) for n in names
        ]

    used = {"T", *types.values()}
    return OpSchema(
        name,
        OP_DOMAIN,
        1,
        inputs=params(inputs),
        outputs=params(outputs),
        type_constraints=[(t, *_TYPE_PARAMS[t]) for t in _TYPE_PARAMS if t in used],
        attributes=[
            OpSchema.Attribute(a, getattr(OpSchema.AttrType, t), a, required=req)
            for a, (t, req) in (attributes or {}).items()
        ],
    )
