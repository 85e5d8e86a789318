"""The manifest's `sparse_head` record and its .npz table, read and checked (no onnx, no torch)."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest.records import Manifest, check_relpath

HEAD_FILE = "head.onnx"
BOUND_FILE = "bound.onnx"
TABLE_FILE = "sparse_head.npz"
KINDS = ("float", "int8-activations")  # how the head's kernel computes a logit (exact.py)
MAX_RANK = 256
FIX = "build it again with `gpt2edge sparse-head`"


@dataclass(frozen=True)
class SparseHeadInfo:
    head_file: str
    bound_file: str
    table_file: str
    kind: str
    rank: int
    candidates: int | None = None  # K: the body graph computes the certified step (fused.py); None: older folders
    groups: int | None = None  # M: groups whose members' bounds the step computes (with candidates)

    @classmethod
    def of(cls, info: Manifest, where: str) -> SparseHeadInfo | None:
        """The record of a sparse-head folder; None for any other folder."""
        rec = info.raw.get("sparse_head")
        if rec is None:
            return None
        if not isinstance(rec, dict):
            raise ModelFolderError(f"{where}: 'sparse_head' is not a record; {FIX}.")
        head = check_relpath(rec.get("head_file"), where, "sparse_head.head_file")
        bound = check_relpath(rec.get("bound_file"), where, "sparse_head.bound_file")
        table = check_relpath(rec.get("table_file"), where, "sparse_head.table_file")
        kind, rank = rec.get("kind"), rec.get("rank")
        if kind not in KINDS or type(rank) is not int or not 1 <= rank <= min(MAX_RANK, info.dims.n_embd):
            raise ModelFolderError(f"{where}: sparse_head kind {kind!r} / rank {rank!r} is not valid; {FIX}.")
        for f in (head, bound, table):
            if f not in info.files:
                raise ModelFolderError(f"{where}: {f} is loaded but not listed in 'files'; {FIX}.")
        fused = rec.get("fused")
        k, m = (fused.get("candidates"), fused.get("groups")) if isinstance(fused, dict) else (None, None)
        if fused is not None and (type(k) is not int or not 1 <= k < info.dims.vocab_size or
                                  type(m) is not int or not 1 <= m <= info.dims.vocab_size):  # fmt: skip
            raise ModelFolderError(f"{where}: sparse_head.fused {fused!r} is not valid; {FIX}.")
        return cls(head, bound, table, kind, rank, k, m)


@dataclass(frozen=True)
class SparseTable:
    """The arrays of the .npz, shapes checked against the model: the bound table's projection (mu, q) and
    constants (eps, eps_par, a_norm_max, eps_max; the projected rows live in the bound graph) and the head's table
    (weight, or codes / zero_points / scales with bits and block_size)."""

    mu: np.ndarray  # (C,)
    q: np.ndarray  # (C, r)
    eps: np.ndarray  # (V,) each row's residual norm (also inside the bound graph's table)
    eps_par: float
    a_norm_max: float
    eps_max: float
    weight: np.ndarray | None  # (V, C) float32
    codes: np.ndarray | None  # (V, C) uint8
    zero_points: np.ndarray | None  # (V, kb) uint8
    scales: np.ndarray | None  # (V, kb) float32
    bits: int
    block_size: int


def _arr(z: Any, name: str, dtype, shape: tuple, path: Path) -> np.ndarray:
    try:
        a = z[name]
    except KeyError:
        raise ModelFolderError(f"{path} has no array {name!r}; {FIX}.") from None
    if a.dtype != dtype or a.shape != shape or (a.dtype.kind == "f" and not np.isfinite(a).all()):
        raise ModelFolderError(
            f"{path}: {name} is {a.dtype} {a.shape}, expected finite {np.dtype(dtype)} {shape}; {FIX}."
        )
    return a


def load_table(path: Path, rec: SparseHeadInfo, vocab_size: int, width: int) -> SparseTable:
    """Read the .npz (no pickles) and check every shape and dtype against the model."""
    V, C, r = vocab_size, width, rec.rank
    try:
        with np.load(path, allow_pickle=False) as z:
            scalars = {k: _arr(z, k, np.int64 if k in ("bits", "block_size") else np.float32, (), path)
                       for k in ("bits", "block_size", "eps_par", "a_norm_max", "eps_max")}  # fmt: skip
            bits, bs = int(scalars["bits"]), int(scalars["block_size"])
            common = dict(
                mu=_arr(z, "mu", np.float32, (C,), path),
                q=_arr(z, "q", np.float32, (C, r), path),
                eps=_arr(z, "eps", np.float32, (V,), path),
                eps_par=float(scalars["eps_par"]),
                a_norm_max=float(scalars["a_norm_max"]),
                eps_max=float(scalars["eps_max"]),
                bits=bits,
                block_size=bs,
            )
            if "weight" in z.files:
                return SparseTable(**common, weight=_arr(z, "weight", np.float32, (V, C), path),
                                   codes=None, zero_points=None, scales=None)  # fmt: skip
            if bits not in (4, 8) or bs < 16 or bs & (bs - 1):
                raise ModelFolderError(f"{path}: bits {bits} / block_size {bs} are not a MatMulNBits table; {FIX}.")
            kb = -(-C // bs)
            return SparseTable(
                **common,
                weight=None,
                codes=_arr(z, "codes", np.uint8, (V, C), path),
                zero_points=_arr(z, "zero_points", np.uint8, (V, kb), path),
                scales=_arr(z, "scales", np.float32, (V, kb), path),
            )
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ModelFolderError(f"{path} cannot be read as the sparse head's table ({e}); {FIX}.") from e
