"""A GPT-2 written for export: flat per-layer KV cache in and out, LM head fused with log-softmax.

The Hugging Face module is the reference we validate against; this one is what we trace. Owning the module
keeps the graph small and predictable (no Cache objects, no mask utilities that change between transformers
releases) and lets the head run on the last position only, which is what generation needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpt2edge.errors import CheckpointError
from gpt2edge.export.fused_ops import attention_lengths, bias_gelu, fused_attention, padding_bias

# Activations GPT-2 configs use, mapped to the torch function that reproduces transformers' ACT2FN.
_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

# The graph kinds this module builds (gpt2edge.manifest.records.HEAD_MODES / KV_CACHE_MODES).
# head: "last" returns the next-token log-probs only, "all" every position's, "tail" those of the positions
#       listed by one more input, `logits_to_keep` (int64 (keep,), transformers' tensor form of that argument:
#       the runtime passes the last position for generation, the last K+1 to verify K draft tokens).
# KV cache:
# concat: past (B, nh, P, hs) in, present = past + new (B, nh, P+S, hs) out (Optimum's contract).
# shared: past is a pre-allocated buffer (B, nh, capacity, hs) holding the past in its first slots; one
#         fused ONNX Runtime op per layer writes the new entries into it and attends over the valid slots, and
#         present is that buffer (the runtime binds both names to the same memory): nothing copies the cache.
#         The whole block is built from ONNX Runtime's fused ops (fused_ops.py): an ONNX Runtime-only graph.


@dataclass(frozen=True)
class Dims:
    """The model dimensions the graph and the runtime need."""

    n_layer: int
    n_head: int
    n_embd: int
    n_inner: int
    vocab_size: int
    n_positions: int
    layer_norm_epsilon: float
    activation: str
    attn_scale_by_layer: bool
    scale_attn_weights: bool

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf_config(cls, config) -> Dims:
        """Read a transformers GPT2Config, refusing options the export does not reproduce."""
        if getattr(config, "add_cross_attention", False):
            raise CheckpointError(
                "This GPT-2 checkpoint has cross-attention (add_cross_attention=True); gpt2edge exports "
                "decoder-only language models only."
            )
        act = config.activation_function
        if act not in _ACTIVATIONS:
            raise CheckpointError(f"Activation '{act}' is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}.")
        if config.n_embd % config.n_head:
            raise CheckpointError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}.")
        return cls(
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_embd=config.n_embd,
            n_inner=config.n_inner or 4 * config.n_embd,
            vocab_size=config.vocab_size,
            n_positions=config.n_positions,
            layer_norm_epsilon=config.layer_norm_epsilon,
            activation=act,
            attn_scale_by_layer=bool(config.scale_attn_by_inverse_layer_idx),
            scale_attn_weights=bool(config.scale_attn_weights),
        )


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored as (in, out), y = x @ W + b. Same layout as the HF checkpoint."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) + self.bias


class Attention(nn.Module):
    def __init__(self, dims: Dims, layer_idx: int):
        super().__init__()
        self.n_head = dims.n_head
        self.head_dim = dims.head_dim
        self.c_attn = Conv1D(dims.n_embd, 3 * dims.n_embd)
        self.c_proj = Conv1D(dims.n_embd, dims.n_embd)
        scale = 1.0 / math.sqrt(dims.head_dim) if dims.scale_attn_weights else 1.0
        if dims.attn_scale_by_layer:
            scale /= float(layer_idx + 1)
        self.scale = scale

    def forward(self, x, past_k, past_v, allowed):
        B, S, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, S, C) -> (B, nh, S, hs)
        q = q.view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        # the cache grows along the sequence axis: (B, nh, P, hs) + (B, nh, S, hs) -> (B, nh, P+S, hs)
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        att = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # (B, nh, S, P+S)
        # a finite floor, not -inf: a fully masked row (a padded query) gives a uniform softmax, not NaN
        att = torch.where(allowed, att, torch.finfo(att.dtype).min)
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v)  # (B, nh, S, hs)
        y = y.transpose(1, 2).reshape(B, S, C)
        return self.c_proj(y), k, v


class MLP(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        self.c_fc = Conv1D(dims.n_embd, dims.n_inner)
        self.c_proj = Conv1D(dims.n_inner, dims.n_embd)
        self.act = _ACTIVATIONS[dims.activation]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, dims: Dims, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dims.n_embd, eps=dims.layer_norm_epsilon)
        self.attn = Attention(dims, layer_idx)
        self.ln_2 = nn.LayerNorm(dims.n_embd, eps=dims.layer_norm_epsilon)
        self.mlp = MLP(dims)

    def forward(self, x, past_k, past_v, allowed):
        a, k, v = self.attn(self.ln_1(x), past_k, past_v, allowed)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, k, v


class ExportableGPT2(nn.Module):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logprobs, *presents).

    past / presents are flat: key_0, value_0, key_1, value_1, ... each (B, nh, T, hs); see the KV cache modes above.
    """

    def __init__(self, dims: Dims, head: str = "last", tied_head: bool = True, kv_cache: str = "concat"):
        super().__init__()
        self.dims = dims
        self.head = head
        self.kv_cache = kv_cache
        self.wte = nn.Embedding(dims.vocab_size, dims.n_embd)
        self.wpe = nn.Embedding(dims.n_positions, dims.n_embd)
        self.h = nn.ModuleList(Block(dims, i) for i in range(dims.n_layer))
        self.ln_f = nn.LayerNorm(dims.n_embd, eps=dims.layer_norm_epsilon)
        # an untied head (rare in fine-tunes) gets its own matrix; a tied one reuses wte, stored once
        self.lm_head = None if tied_head else nn.Parameter(torch.empty(dims.vocab_size, dims.n_embd))

    def forward(self, input_ids, attention_mask, position_ids, *past):
        if self.head == "tail":
            *past, logits_to_keep = past  # the tail head's extra input comes after the cache
        B, S = input_ids.shape
        T = attention_mask.shape[1]  # past + current length
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, S, C)
        # query i sits at absolute slot T-S+i and may look at key slots j <= T-S+i that are not padding
        if self.kv_cache == "shared":  # the fused attention masks the causal part itself: the padding only
            floor = torch.finfo(x.dtype).min / 2  # finite after adding a score: a padded query gets no NaN
            x, presents = self._fused_blocks(x, past, padding_bias(attention_mask, input_ids, floor).to(x.dtype))
        else:
            key_slot = torch.arange(T, device=x.device)
            query_slot = torch.arange(S, device=x.device) + (T - S)
            causal = key_slot.unsqueeze(0) <= query_slot.unsqueeze(1)  # (S, T)
            allowed = causal.unsqueeze(0).unsqueeze(0) & attention_mask.bool().unsqueeze(1).unsqueeze(2)  # (B,1,S,T)
            presents = []
            for i, block in enumerate(self.h):
                x, k, v = block(x, past[2 * i], past[2 * i + 1], allowed)
                presents += [k, v]
        if self.head == "last":
            x = x[:, -1, :]  # (B, C): generation needs the next-token distribution only
        elif self.head == "tail":
            x = x.index_select(1, logits_to_keep)  # (B, keep, C): the head runs on the kept positions only
        x = self.ln_f(x)
        head_weight = self.wte.weight if self.lm_head is None else self.lm_head
        logits = F.linear(x, head_weight)  # (B, V), (B, S, V) or (B, keep, V)
        return (torch.log_softmax(logits.float(), dim=-1), *presents)

    def _fused_blocks(self, x, past, bias):
        """The blocks with ONNX Runtime's fused attention and GELU (fused_ops.py): same maths, ~10 nodes per
        layer, and the attention writes the cache in place. bias: (B, 1, S, T) additive padding mask, every layer's."""
        last_slot, total = attention_lengths(bias)
        act = self.dims.activation
        presents = []
        for i, block in enumerate(self.h):
            attn, mlp = block.attn, block.mlp
            qkv = attn.c_attn(block.ln_1(x))  # (B, S, 3C)
            y, k, v = fused_attention(
                qkv, past[2 * i], past[2 * i + 1], bias, last_slot, total, attn.n_head, attn.scale
            )
            presents += [k, v]
            x = x + attn.c_proj(y)
            h = block.ln_2(x)
            if act in _TANH_GELUS or act == "gelu":
                a = bias_gelu(h @ mlp.c_fc.weight, mlp.c_fc.bias, act in _TANH_GELUS)  # (B, S, n_inner)
            else:
                a = mlp.act(mlp.c_fc(h))
            x = x + mlp.c_proj(a)
        return x, presents


def from_hf_model(hf_model, head: str = "last", kv_cache: str = "concat") -> ExportableGPT2:
    """Copy a transformers GPT2LMHeadModel's weights into an ExportableGPT2, checking every key and shape."""
    dims = Dims.from_hf_config(hf_model.config)
    sd = hf_model.state_dict()
    head_w = sd.get("lm_head.weight")
    wte = sd["transformer.wte.weight"]
    tied = head_w is None or head_w.data_ptr() == wte.data_ptr() or torch.equal(head_w, wte)
    # built on the meta device and given the checkpoint's own tensors (assign=True): the export holds one copy
    # of the weights, not two (gpt2-xl: 6.2 GB instead of 12.4)
    with torch.device("meta"):
        model = ExportableGPT2(dims, head=head, tied_head=tied, kv_cache=kv_cache)
    ours = model.state_dict()
    mapped = {k.removeprefix("transformer."): v for k, v in sd.items() if k.startswith("transformer.")}
    # HF keeps non-parameter buffers in some checkpoints (causal mask tables); they carry no weights
    mapped = {k: v for k, v in mapped.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    if not tied:
        mapped["lm_head"] = head_w
    missing = sorted(set(ours) - set(mapped))
    unexpected = sorted(set(mapped) - set(ours))
    if missing or unexpected:
        raise CheckpointError(
            f"The checkpoint's weights do not map onto GPT-2: missing {missing[:5]}, unexpected {unexpected[:5]}."
        )
    for k, v in mapped.items():
        if tuple(v.shape) != tuple(ours[k].shape):
            raise CheckpointError(
                f"Weight {k} has shape {tuple(v.shape)} but the config implies {tuple(ours[k].shape)}."
            )
    # .float() is the tensor itself when it is float32 already (shared); a half checkpoint is widened here. The
    # vectors (biases, LayerNorm) are copied: torch.onnx keeps references to them after export, and each view of
    # the checkpoint's memory map pins the whole file (gpt2 small: 0.5 GB held through validation); 0.1 % of it
    owned = {k: v.float() if v.dim() > 1 else v.float().clone() for k, v in mapped.items()}
    model.load_state_dict(owned, strict=True, assign=True)
    return model.eval()
