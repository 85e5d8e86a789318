"""Temperature and top-k, the first two warpers (transformers' TemperatureLogitsWarper and TopKLogitsWarper), and
the two at once on a candidate pool (scaled_top_k: a step's top-k sampling never divides the whole row)."""

from __future__ import annotations

import numpy as np

from gpt2edge.runtime.decoding.processors import NEG_INF


def take(ids: np.ndarray | None, vals: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep positions `keep` (indices or a mask into vals) of the surviving tokens."""
    keep = keep.nonzero()[0] if keep.dtype == bool else keep  # (np.flatnonzero's Python layer: ~8 us a call)
    return (keep if ids is None else ids[keep]), vals[keep]


def apply_temperature(row: np.ndarray, temperature: float) -> np.ndarray:
    """TemperatureLogitsWarper: float32 division, as torch divides a float32 tensor by a Python float. A
    temperature so small (1e-45) that every score overflows to -inf gives its T -> 0 limit, the best token(s),
    where torch would have nothing left to sample."""
    if temperature == 1.0:
        return row
    with np.errstate(over="ignore"):  # 1e308 -> inf: every score / inf = -0, uniform, as torch gives
        t = np.float32(temperature)
    if t == 0:  # below float32's range (5e-324): the T -> 0 limit, not a division by zero
        return np.where(row == row.max(), np.float32(0.0), NEG_INF).astype(np.float32)
    with np.errstate(over="ignore"):  # overflow to -inf is the division's honest float32 result
        out = row / t
    if out.max() == NEG_INF and row.max() > NEG_INF:
        out = np.where(row == row.max(), np.float32(0.0), NEG_INF).astype(np.float32)
    return out


def top_k_pool(vals: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest vals plus every tie with the k-th (TopKLogitsWarper removes only vals < k-th).

    A strided sample gives a threshold that about 4k values pass; if at least k do, the k-th value is among
    them (exact); otherwise the whole row is partitioned.
    """
    n = vals.size
    stride = max(1, n // (16 * k))
    sample = vals[::stride]
    rank = min(len(sample) - 1, 4 * -(-k // stride))
    pool = (vals >= np.partition(sample, len(sample) - 1 - rank)[len(sample) - 1 - rank]).nonzero()[0]
    if len(pool) < k:
        pool = np.arange(n)
    kth = np.partition(vals[pool], len(pool) - k)[len(pool) - k]
    return pool[vals[pool] >= kth]


def apply_top_k(ids: np.ndarray | None, vals: np.ndarray, k: int) -> tuple[np.ndarray | None, np.ndarray]:
    """TopKLogitsWarper: keep the k best (and ties with the k-th); 0 disables it."""
    if k <= 0 or k >= vals.size:
        return ids, vals
    return take(ids, vals, top_k_pool(vals, k))


def scaled_top_k(row: np.ndarray, temperature: float, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """apply_top_k(None, apply_temperature(row, temperature), k), the same arrays, without dividing the whole row:
    float32 division by t > 0 is monotone, so the k-th quotient is the k-th score's, and only scores a few ulps
    below the k-th round onto it (found by stepping down). None: the edge cases (no cut, an overflow, -inf or NaN
    in the pool), left to the full path."""
    with np.errstate(over="ignore"):
        t = np.float32(temperature)
    if not 0 < k < row.size or not 0 < t < np.inf:
        return None
    pool = top_k_pool(row, k)
    kth = row[pool].min()  # the k-th score: the pool holds it and the scores that tie or beat it
    with np.errstate(over="ignore", invalid="ignore"):
        vals, q, lo = row[pool] / t, kth / t, kth
        for _ in range(8):  # the scores just below kth whose quotient is still q (TopK keeps ties with the k-th)
            below = np.nextafter(lo, NEG_INF)
            if not below / t >= q:
                break
            lo = below
        else:
            return None
    if not np.isfinite(vals).all():
        return None
    if lo < kth:  # a score below the k-th rounds onto its quotient: the pool as the divided row gives it
        pool = (row >= lo).nonzero()[0]
        vals = row[pool] / t
    return pool, vals
