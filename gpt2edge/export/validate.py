"""Check an exported graph against the PyTorch source on fixed inputs, printing maxdiff per output.

Cases: a left-padded batch of 2 with an empty past (prefill), then one decode step per row with the past
that PyTorch produced. Presents are compared at non-padded positions only: padded slots are never attended.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gpt2edge.errors import ValidationError
from gpt2edge.export.options import DEFAULT_ATOL
from gpt2edge.manifest.records import KEEP_INPUT
from gpt2edge.runtime.model.positions import position_ids_from_mask  # the runtime's own rule, so both agree

if TYPE_CHECKING:
    import torch


@dataclass
class Check:
    case: str
    output: str
    maxdiff: float
    atol: float

    @property
    def ok(self) -> bool:
        return bool(self.maxdiff <= self.atol)


def hf_step(hf_model, ids, mask, pos, past: list[torch.Tensor] | None):
    """One forward of the transformers model; returns (logprobs (B, S, V), flat presents)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    if past:
        for i in range(0, len(past), 2):
            cache.update(past[i], past[i + 1], i // 2)
    with torch.no_grad():
        # cache passed by position: transformers renamed the keyword (past_key_values -> cache) in 5.x
        out = hf_model(ids, cache, attention_mask=mask, position_ids=pos, use_cache=True)
    out_cache = getattr(out, "cache", None) or out.past_key_values
    presents = []
    for layer in out_cache.layers:
        presents += [layer.keys, layer.values]
    return torch.log_softmax(out.logits.float(), dim=-1), presents


def fixed_inputs(vocab_size: int, n_positions: int, seed: int = 0):
    """A left-padded batch of 2 (row 1 has 2 pads) and one next token per row."""
    rng = np.random.default_rng(seed)
    S = max(2, min(7, n_positions - 2))
    ids = rng.integers(0, vocab_size, size=(2, S), dtype=np.int64)
    mask = np.ones((2, S), dtype=np.int64)
    mask[1, : min(2, S - 1)] = 0
    nxt = rng.integers(0, vocab_size, size=(2, 1), dtype=np.int64)
    return ids, mask, nxt


@dataclass
class Reference:
    """PyTorch's outputs on the fixed cases, as NumPy: computed before ONNX Runtime loads the graph, so the torch
    model can be freed first and validation never holds two full copies of the weights."""

    ids: np.ndarray
    mask: np.ndarray
    nxt: np.ndarray
    prefill: tuple[np.ndarray, list[np.ndarray]]  # logprobs (B, S, V), presents (B, nh, S, hs) each
    decode: tuple[np.ndarray, list[np.ndarray]]  # logprobs (B, 1, V), presents (B, nh, S + 1, hs) each
    n_layer: int
    n_head: int
    head_dim: int


def reference_outputs(hf_model) -> Reference:
    """Run PyTorch on the two cases (prefill of a left-padded batch, then one decode step on its past)."""
    import torch

    cfg = hf_model.config
    ids, mask, nxt = fixed_inputs(cfg.vocab_size, cfg.n_positions)
    S = ids.shape[1]
    pos = position_ids_from_mask(mask, S)
    lp1, pres1 = hf_step(hf_model, *map(torch.from_numpy, (ids, mask, pos)), None)
    mask2 = np.concatenate([mask, np.ones((ids.shape[0], 1), np.int64)], axis=1)
    pos2 = position_ids_from_mask(mask2, 1)
    lp2, pres2 = hf_step(hf_model, *map(torch.from_numpy, (nxt, mask2, pos2)), list(pres1))
    return Reference(
        ids,
        mask,
        nxt,
        (lp1.numpy(), [p.numpy().copy() for p in pres1]),
        (lp2.numpy(), [p.numpy().copy() for p in pres2]),
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd // cfg.n_head,
    )


def validate(
    onnx_path: Path, hf_model, head: str = "last", atol: float = DEFAULT_ATOL, log=None, kv_cache: str = "concat"
) -> list[Check]:
    """Run ORT and PyTorch side by side; returns every check (raise_on_failure turns them into an error)."""
    return validate_against(onnx_path, reference_outputs(hf_model), head, atol, log, kv_cache)


def validate_against(
    onnx_path: Path, ref: Reference, head: str = "last", atol: float = DEFAULT_ATOL, log=None, kv_cache: str = "concat"
) -> list[Check]:
    """Run ORT on the cases of `ref` and compare; returns every check.

    A shared-cache graph gets the same cases; at decode its past is PyTorch's cache placed at the start of a
    larger zeroed buffer, and the valid slots of the buffer it returns are compared with PyTorch's cache."""
    import onnxruntime as ort

    L, H, D = ref.n_layer, ref.n_head, ref.head_dim
    opts = ort.SessionOptions()
    # no arena: the activations of two small cases would otherwise stay reserved next to the weights
    opts.enable_cpu_mem_arena = False
    # no prepacked copies of the matrices (fp32 MatMul keeps both, ~1.7x the weights): two small cases gain nothing
    opts.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    in_names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    ids, mask, nxt = ref.ids, ref.mask, ref.nxt
    B, S = ids.shape
    checks: list[Check] = []

    def feed_of(values: list[np.ndarray], seq: int) -> dict[str, np.ndarray]:
        """Inputs by name; a --head tail graph is asked for every position, compared as --head all."""
        feed = dict(zip(in_names, values))
        if KEEP_INPUT in in_names:
            feed[KEEP_INPUT] = np.arange(seq, dtype=np.int64)
        return feed

    def compare(case, ort_out, ref_logprobs, ref_presents, step_mask, seq):
        real = step_mask[:, -seq:].astype(bool)  # (B, seq): which query positions are real tokens
        T = step_mask.shape[1]
        got = ort_out[0]
        if head == "last":
            diff = np.abs(got - ref_logprobs[:, -1]).max()
        else:
            diff = np.abs(got - ref_logprobs)[real].max()
        checks.append(Check(case, "logprobs", float(diff), atol))
        keep = step_mask.astype(bool)  # (B, T): cache slots that hold real tokens
        worst = 0.0
        for o, r in zip(ort_out[1:], ref_presents):
            # a shared-cache graph returns its whole buffer: compare the slots filled so far
            d = np.abs(o[:, :, :T] - r).transpose(0, 2, 1, 3)[keep]  # (n_real, nh, hs)
            worst = max(worst, float(d.max()))
        checks.append(Check(case, f"present.* ({2 * L} tensors)", worst, atol))

    # case 1: prefill, empty past, left-padded batch of 2
    pos = position_ids_from_mask(mask, S)
    empty = [np.zeros((B, H, 0, D), np.float32) for _ in range(2 * L)]
    ort_out = sess.run(out_names, feed_of([ids, mask, pos, *empty], S))
    compare("prefill, left-padded batch of 2, empty past", ort_out, *ref.prefill, mask, S)

    # case 2: decode one token per row on PyTorch's past
    mask2 = np.concatenate([mask, np.ones((B, 1), np.int64)], axis=1)
    pos2 = position_ids_from_mask(mask2, 1)
    past = ref.prefill[1]
    if kv_cache == "shared":  # a buffer with spare slots, as the runtime allocates it
        spare = 3
        past = [np.concatenate([p, np.zeros((B, H, spare, D), np.float32)], axis=2) for p in past]
    ort_out = sess.run(out_names, feed_of([nxt, mask2, pos2, *past], 1))
    compare("decode 1 token with past", ort_out, *ref.decode, mask2, 1)

    if log is not None:
        print_checks(checks, log)
    return checks


def print_checks(checks: list[Check], file=sys.stderr) -> None:
    """The validation table: one row per case and output, maxdiff against the tolerance, ✓ or ✗."""
    width = max(len(c.case) for c in checks)
    for c in checks:
        mark = "✓" if c.ok else "✗"
        print(f"  {mark} {c.case:<{width}}  {c.output:<24} maxdiff {c.maxdiff:.2e}  (atol {c.atol:.0e})", file=file)


def raise_on_failure(checks: list[Check]) -> None:
    bad = [c for c in checks if not c.ok]
    if bad:
        worst = max(bad, key=lambda c: c.maxdiff)
        raise ValidationError(
            f"ONNX Runtime differs from PyTorch beyond atol: {worst.output} in '{worst.case}' "
            f"has maxdiff {worst.maxdiff:.3g} > {worst.atol:g} ({len(bad)} check(s) failed). "
            "Hint: try another --opset, or raise --atol if the model is large and the gap is float rounding."
        )


def checks_to_json(checks: list[Check]) -> list[dict]:
    return [{**asdict(c), "ok": c.ok} for c in checks]
