"""Left-padded batches: the ids and attention mask of a batch of prompts, and the position ids the mask implies.

Every row ends at the same column, so one (B, 1) step serves all rows; position ids count each row's own
tokens. The model's rule (the export checks its graph with it, SlotLM and the decoding loops feed it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, S) ids and a (B, total) mask whose first S columns mark real prompt tokens (pads on the left)."""
    S = max(len(p) for p in prompts)
    ids = np.full((len(prompts), S), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), total), dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, S - len(p) :] = p
        mask[b, S - len(p) : S] = 1
    return ids, mask


def position_ids_from_mask(mask: np.ndarray, seq: int) -> np.ndarray:
    """Left padding: each row counts its own tokens, pads get 0. Returns the last `seq` columns."""
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return pos[:, -seq:].astype(np.int64)
