"""The head's logits for a subset of rows, computed the way its kernel computes them, and the bound scores.

kind "float" (a Gemm, or MatMulNBits at accuracy level 0/1): logit_i = w_i . h in float.
kind "int8-activations" (MatMulNBits at accuracy level 4, gpt2edge quantize's default): the kernel first
quantizes h per block of the table's block size to int8 (scale = max|h_b| / 127, round to nearest even), then
logit_i = sum_b scale_b * scale_ib * (q_b . (code_ib - zero_point_ib)). The integer dots are exact in float32
(|sum| < 2^24 for blocks up to 256), so only the last few float additions can differ from ONNX Runtime's order:
~1e-6 of a logit. The runtime treats two logits closer than TIE as undecided and lets the full head choose.

The bound (gpt2edge.sparse.bounds) holds for the activation the kernel multiplies, h_eff (the dequantized
int8 h at level 4), so it bounds the kernel's logit itself, not the float one.
"""

from __future__ import annotations

import numpy as np

from gpt2edge.runtime.sparse_head.record import SparseTable

TIE = 1e-3  # logits closer than this (nats) may order differently in the kernel's float arithmetic: not certified


class HeadKernel:
    """prepare(h) once per row, then exact(rows) as often as needed (not thread-safe: one per SparseLM)."""

    def __init__(self, table: SparseTable, kind: str, width: int) -> None:
        self.t, self.kind, self.C = table, kind, width
        self.kb = 0 if table.codes is None else table.scales.shape[1]
        self._qa = self._sa = self._qsum = self._h = None
        # float rounding of the bound scores (float32, r + 2 terms): a generous relative allowance
        self.scale = (
            (table.q.shape[1] + 2) * 1e-5 * (float(np.linalg.norm(table.mu)) + table.a_norm_max + table.eps_max)
        )

    def prepare(self, h: np.ndarray) -> np.ndarray:
        """(C,) hidden -> (C,) float32 activation the kernel multiplies by (h, or h dequantized from int8)."""
        h = np.asarray(h, dtype=np.float32)
        self._h = h
        if self.kind != "int8-activations":
            return h
        bs = self.t.block_size
        if self.kb * bs == self.C:
            hb = h.reshape(self.kb, bs)
        else:
            hb = np.zeros(self.kb * bs, dtype=np.float32)
            hb[: self.C] = h
            hb = hb.reshape(self.kb, bs)
        sa = np.abs(hb).max(1) / np.float32(127)  # (kb,) float32
        with np.errstate(divide="ignore"):
            inv = np.where(sa != 0, np.float32(1) / sa, np.float32(0))
        qa = np.rint(hb * inv[:, None])  # (kb, bs) exact ints in [-127, 127]
        self._qa, self._sa, self._qsum = qa, sa, qa.sum(1)
        return (qa * sa[:, None]).reshape(-1)[: self.C]

    def exact(self, rows: np.ndarray) -> np.ndarray:
        """(n,) row ids -> (n,) float64 logits of those rows for the prepared h."""
        t = self.t
        if t.codes is None:
            # einsum, not BLAS: a threaded BLAS call beside ONNX Runtime's spinning threads can take 1000x longer
            return np.einsum("nc,c->n", t.weight[rows].astype(np.float64), self._h.astype(np.float64))
        codes = t.codes[rows].astype(np.float32)  # (n, C)
        bs = t.block_size
        pad = self.kb * bs - self.C
        if pad:
            codes = np.pad(codes, ((0, 0), (0, pad)))
        codes = codes.reshape(len(rows), self.kb, bs)
        zp = t.zero_points[rows].astype(np.float32)  # (n, kb)
        sc = t.scales[rows]  # (n, kb)
        if self.kind == "float":  # dequantized rows times h, in float
            w = (codes - zp[..., None]) * sc[..., None]
            hb = np.zeros(self.kb * bs, dtype=np.float64)
            hb[: self.C] = self._h
            return np.einsum("nc,c->n", w.reshape(len(rows), -1).astype(np.float64), hb)
        dots = np.einsum("nkb,kb->nk", codes, self._qa) - zp * self._qsum  # exact integers, (n, kb)
        return (dots.astype(np.float64) * (sc * self._sa).astype(np.float64)).sum(1)

    def full(self) -> np.ndarray:
        """(V,) every row's logit for the prepared h (the load-time self-check)."""
        n = len(self.t.weight if self.t.codes is None else self.t.codes)
        return self.exact(np.arange(n))
