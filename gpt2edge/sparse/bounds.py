"""The bound table: a rank-r projection of the head's rows with a per-row error bound (Cauchy-Schwarz).

Each row w_i of the (dequantized) table is written exactly as  w_i = mu + Q a_i + R_i  (mu the mean row, Q the
top r principal directions, a_i = Q^T (w_i - mu) stored in float32, R_i what is left, computed in float64 from
the stored values). For any h, since h = (h - Q Q^T h) + Q Q^T h,
    h . w_i = h . mu + (Q^T h) . a_i + (h - Q Q^T h) . R_i + (Q^T h) . (Q^T R_i)
so |h . w_i - s_i| <= ||h - Q Q^T h|| eps_i + ||Q^T h|| eps_par,  s_i = h . mu + (Q^T h) . a_i,
with eps_i = ||R_i|| per row and eps_par = max_i ||Q^T R_i|| (float32 rounding of a_i; ~1e-7). The runtime
scores all V rows with s (r multiply-adds each: a table r/C of the head's size) and reads exactly the rows whose
upper bound can still win. Trained embeddings share a few dominant directions (rare tokens collapse together),
which is what makes the bound tight enough to pay; random tables have none (see docs/sparse-head.md).
"""

from __future__ import annotations

import numpy as np

TABLE_VERSION = 1


def bound_table(w: np.ndarray, rank: int) -> dict[str, np.ndarray]:
    """(V, C) float32 rows -> the arrays of the bound table (float32, eps rounded up)."""
    w64 = w.astype(np.float64)
    mu = w64.mean(0)
    _, _, vt = np.linalg.svd(w64 - mu, full_matrices=False)  # (C, C): rows are the principal directions
    q = vt[:rank].T.astype(np.float32)  # (C, r)
    mu32 = mu.astype(np.float32)
    a = ((w64 - mu32) @ q.astype(np.float64)).astype(np.float32)  # (V, r)
    r = w64 - mu32.astype(np.float64) - a.astype(np.float64) @ q.T.astype(np.float64)  # exact residual, (V, C)
    eps = np.linalg.norm(r, axis=1)
    eps_par = float(np.linalg.norm(r @ q.astype(np.float64), axis=1).max())
    return {
        "mu": mu32,
        "q": np.ascontiguousarray(q),
        "a_t": np.ascontiguousarray(a.T),  # (r, V): the runtime's h-projection @ a_t reads it row-major
        "eps": np.nextafter(eps.astype(np.float32), np.float32(np.inf)),  # rounded up: still a bound
        "eps_par": np.array(np.nextafter(np.float32(eps_par), np.float32(np.inf)), dtype=np.float32),
        "a_norm_max": np.array(np.linalg.norm(a.astype(np.float64), axis=1).max(), dtype=np.float32),
        "eps_max": np.array(np.nextafter(np.float32(eps.max()), np.float32(np.inf)), dtype=np.float32),
        "version": np.array(TABLE_VERSION, dtype=np.int64),
    }
