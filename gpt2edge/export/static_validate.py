"""Check static-shape graphs against the PyTorch source, through the runtime's own StaticLM (so the chunking,
padding and cache writing that generation uses are what is checked), with the dynamic export's tolerance.

Cases: a prompt of every static row (row 1 left-padded when there are two rows or more) long enough to span a
full chunk and a padded last one (as the capacity allows), fed to the prefill graph; then one decode step per
row on that cache, through the decode graph. Log-probs are compared, and the cache slots of real tokens with
PyTorch's presents.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpt2edge.export.options import DEFAULT_ATOL, StaticShape
from gpt2edge.export.validate import Check, hf_step
from gpt2edge.runtime.model.positions import position_ids_from_mask
from gpt2edge.runtime.model.static_lm import StaticLM


def static_inputs(vocab_size: int, shape: StaticShape, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, S) ids, their (B, S) mask (row 1 with 2 pads when B >= 2) and (B, 1) next tokens; S spans one full
    chunk and half of the next (a padded last chunk) when the capacity leaves room for the decode step."""
    rng = np.random.default_rng(seed)
    B, C, N = shape.batch, shape.chunk, shape.capacity
    S = max(1, min(N - 1, C + max(1, C // 2)))
    ids = rng.integers(0, vocab_size, size=(B, S), dtype=np.int64)
    mask = np.ones((B, S), np.int64)
    if B >= 2 and S >= 2:
        mask[1, : min(2, S - 1)] = 0
    return ids, mask, rng.integers(0, vocab_size, size=(B, 1), dtype=np.int64)


def validate_static(
    prefill: Path, decode: Path, hf_model, shape: StaticShape, atol: float = DEFAULT_ATOL
) -> list[Check]:
    """Run StaticLM on the two graphs and PyTorch side by side; returns every check (see raise_on_failure)."""
    import torch

    lm = StaticLM(prefill, decode)
    ids, mask, nxt = static_inputs(hf_model.config.vocab_size, shape)
    B, S = ids.shape
    n_chunks = -(-S // shape.chunk)
    checks: list[Check] = []

    def compare(case: str, got: np.ndarray, ref_lp, ref_presents, step_mask: np.ndarray) -> None:
        checks.append(Check(case, "logprobs", float(np.abs(got - ref_lp[:, -1].numpy()).max()), atol))
        keep = step_mask.astype(bool)  # (B, T): slots that hold real tokens
        T = step_mask.shape[1]
        worst = max(
            float(np.abs(c[:, :, :T] - r.numpy()).transpose(0, 2, 1, 3)[keep].max())
            for c, r in zip(lm.cache(), ref_presents)
        )
        checks.append(Check(case, f"present.* ({len(ref_presents)} tensors)", worst, atol))

    # prefill: the prompt in chunks of C (the last one padded), empty cache
    lm.start(B, S + 1)
    pos = position_ids_from_mask(mask, S)
    got = lm.forward(ids, mask, pos).copy()
    ref_lp, ref_presents = hf_step(hf_model, *map(torch.from_numpy, (ids, mask, pos)), None)
    padded = "left-padded " if B >= 2 else ""
    compare(f"prefill, {padded}batch of {B}, {S} tokens in {n_chunks} chunk(s)", got, ref_lp, ref_presents, mask)

    # decode: one token per row on that cache (the decode graph)
    mask2 = np.concatenate([mask, np.ones((B, 1), np.int64)], axis=1)
    pos2 = position_ids_from_mask(mask2, 1)
    got = lm.forward(nxt, mask2, pos2).copy()
    ref_lp, ref_presents = hf_step(hf_model, *map(torch.from_numpy, (nxt, mask2, pos2)), list(ref_presents))
    compare("decode 1 token with past", got, ref_lp, ref_presents, mask2)
    return checks
