"""The certified step in one native call (_certify.c) instead of the body graph's ~47 small ONNX Runtime nodes.

The step's work is a few microseconds; inside the graph each node costs ~1 us, which was most of what a certified
step saves on a small head (benchmarks/README.md, *Sparse LM head*). Folders whose body graph guards its own step
with If(sparse_step) (gpt2edge.sparse.guard) carry the step's tables in the .npz; the runtime then feeds
sparse_step = False (the graph skips its step) and calls this instead. Same contract as the graph's step
(fused.py's FusedReader): K row ids, their logits as exact.py computes them, and a bar above every other row. One
addition: when the bar stops the best candidate, the step reads more rows (within EXTRA_ROWS / EXTRA_GROUPS) and
returns the K best of all it read, instead of leaving the step to the full head.

The library is built by `pip install` (setuptools; optional: without a C compiler the install goes on and the
graph's own step runs); GPT2EDGE_NATIVE=0 turns it off. No onnx, no torch.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2edge.errors import ModelFolderError
from gpt2edge.runtime.sparse_head.exact import TIE
from gpt2edge.runtime.sparse_head.record import FIX, SparseTable

STEP_ARRAYS = ("group_members", "group_table", "group_q", "member_rows", "slack_coef")
# when the bar stops the best candidate, the step reads up to this many more rows (from up to this many more
# groups) before the step is left to the full head: a few hundred rows (~10-30 us) against ~0.3 ms
EXTRA_ROWS, EXTRA_GROUPS = 1024, 128
ABI = 1  # _certify.c's G2E_ABI
KIND_CODES = {("weight", "float"): 0, ("codes", "float"): 1, ("codes", "int8-activations"): 2}


class _Tables(ctypes.Structure):
    """_certify.c's g2e_tables: sizes, constants, then the tables' addresses."""

    _ints = ("C", "r", "rg", "G", "S", "m", "K", "V", "kind", "bs", "kb")
    _ptrs = ("q", "qg", "qt", "qgt", "mu", "gtab", "members", "rowt", "weight", "codes", "zps", "scales")
    _fields_ = [
        *[(n, ctypes.c_int32) for n in _ints],
        ("slack_coef", ctypes.c_float),
        ("tie", ctypes.c_float),
        ("extra_rows", ctypes.c_int32),
        ("extra_groups", ctypes.c_int32),
        *[(n, ctypes.c_void_p) for n in _ptrs],
    ]


def _library() -> ctypes.CDLL | None:
    """The built _certify library next to this file, or None (not built, or turned off)."""
    if os.environ.get("GPT2EDGE_NATIVE", "1") == "0":
        return None
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_certify{suffix}"
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
                lib.g2e_abi  # noqa: B018  (a library without it is from an older build)
            except (OSError, AttributeError):
                return None
            lib.g2e_abi.restype = ctypes.c_int64
            if lib.g2e_abi() != ABI * 1_000_000 + ctypes.sizeof(_Tables):
                return None  # built from other sources (stale): `pip install -e .` rebuilds it
            lib.g2e_certify.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int32] * 2 + [ctypes.c_void_p] * 5
            lib.g2e_certify.restype = ctypes.c_int
            sizes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_double]
            lib.g2e_rows.argtypes = sizes + [ctypes.c_void_p] * 8
            lib.g2e_rows.restype = ctypes.c_int
            lib.g2e_scratch_floats.argtypes = [ctypes.c_void_p]
            lib.g2e_scratch_floats.restype = ctypes.c_int64
            return lib
    return None


LIBRARY = _library()


@dataclass(frozen=True)
class StepArrays:
    """The step's own tables from the .npz (written by `gpt2edge sparse-head`: gpt2edge.sparse.guard.step_arrays)."""

    members: np.ndarray  # (G, S) int32 row ids
    group_table: np.ndarray  # (r_g + 2, G) float32
    group_q: np.ndarray  # (C, r_g) float32
    member_rows: np.ndarray  # (G, r + 1, S) float32
    slack_coef: float


def load_step_arrays(path: Path, vocab_size: int, width: int, rank: int) -> StepArrays | None:
    """The step's arrays, shapes checked; None when the .npz has none (a folder built before them)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if not all(name in z.files for name in STEP_ARRAYS):
                return None
            arrays = {name: z[name] for name in STEP_ARRAYS}
    except (OSError, ValueError, EOFError) as e:  # load_table read the file just before: a race or a pickle
        raise ModelFolderError(f"{path} cannot be read as the sparse step's tables ({e}); {FIX}.") from e
    mem, gt, gq, rows, coef = (arrays[n] for n in STEP_ARRAYS)
    G = len(mem) if mem.ndim == 2 else 0
    ok = (
        mem.dtype == np.int32 and mem.ndim == 2 and mem.size > 0 and mem.min() >= 0 and mem.max() < vocab_size
        and gq.dtype == np.float32 and gq.ndim == 2 and gq.shape[0] == width and 1 <= gq.shape[1] <= rank
        and gt.dtype == np.float32 and gt.shape == (gq.shape[1] + 2, G)
        and rows.dtype == np.float32 and rows.shape == (G, rank + 1, mem.shape[1])
        and coef.dtype == np.float32 and coef.shape == ()
        and all(np.isfinite(a).all() for a in (gt, gq, rows, coef))
    )  # fmt: skip
    if not ok:
        raise ModelFolderError(f"{path}: the sparse step's tables ({', '.join(STEP_ARRAYS)}) are malformed; {FIX}.")
    return StepArrays(mem, gt, gq, rows, float(coef))


class NativeStep:
    """The certified step for one folder's tables; certify(h, ids, logits, bar) fills the caller's buffers.
    Stateless between calls (its scratch aside): one per SparseLM."""

    def __init__(self, table: SparseTable, arrays: StepArrays, kind: str, k: int, m: int) -> None:
        if LIBRARY is None:
            raise RuntimeError("the native sparse step is not built")
        V, C = (table.weight if table.codes is None else table.codes).shape
        G, S = arrays.members.shape
        if not (1 <= m <= G and 1 <= k <= m * S and table.q.shape[1] + 1 == arrays.member_rows.shape[1]):
            raise ModelFolderError(
                f"the sparse step's {k} candidates from {m} groups do not fit its tables ({G} groups of {S}); {FIX}."
            )
        store = "weight" if table.codes is None else "codes"
        bs = C if table.codes is None else table.block_size
        own = (table.q, arrays.group_q, table.q.T, arrays.group_q.T, table.mu, arrays.group_table, arrays.members,
               arrays.member_rows)  # fmt: skip
        heads = (table.weight,) if table.codes is None else (table.codes, table.zero_points, table.scales)
        self._keep = [np.ascontiguousarray(a) for a in (*own, *heads)]  # alive as long as the pointers
        ptr = [a.ctypes.data for a in self._keep]
        n = len(own)
        head_ptrs = [ptr[n], None, None, None] if table.codes is None else [None, *ptr[n : n + 3]]
        self.K, self.C = k, C
        sizes = (C, table.q.shape[1], arrays.group_q.shape[1], G, S, m, k, V, KIND_CODES[store, kind], bs, -(-C // bs))
        consts = (arrays.slack_coef, TIE, EXTRA_ROWS, EXTRA_GROUPS)
        self._t = _Tables(*sizes, *consts, *ptr[:n], *head_ptrs)
        self._tp = ctypes.addressof(self._t)
        self._work = np.empty(LIBRARY.g2e_scratch_floats(self._tp), dtype=np.float32)
        self._wp = self._work.ctypes.data
        self._h, self._out = None, (None,) * 4  # the last arrays, whose addresses are cached (certify)
        self._hp, self._ptrs = 0, (0,) * 4
        self._rows_of, self._rows_ptrs = None, ()  # rows(): the reader's ids array, and its arrays' addresses

    def certify(
        self, h: np.ndarray, ids: np.ndarray, logits: np.ndarray, bar: np.ndarray, read: np.ndarray, k: int = 1
    ) -> None:
        """h (B, C) float32 -> ids (B, K) int64, logits (B, K) float64, bar (B, 1) float64 and read (B,) int32, the
        exact rows each row's step computed (C-contiguous arrays), in place; k: the best k must clear the bar (1:
        greedy, top-k sampling's k), which decides how far the step reads on. The arrays' addresses are kept between
        calls while they are the same objects (the body's and the reader's own buffers, rewritten every step):
        ~0.6 us a call instead of ~4 us."""
        if h is not self._h:
            if not (h.flags.c_contiguous and h.dtype == np.float32):
                h = np.ascontiguousarray(h, dtype=np.float32)  # a copy: its address is not kept
            else:
                self._h, self._hp = h, h.ctypes.data
            hp = h.ctypes.data
        else:
            hp = self._hp
        out = (ids, logits, bar, read)
        if any(a is not b for a, b in zip(out, self._out)):
            want = ((np.int64, (self.K,)), (np.float64, (self.K,)), (np.float64, (1,)), (np.int32, ()))
            B = len(ids)
            if any(a.dtype != d or a.shape != (B, *n) or not a.flags.c_contiguous for a, (d, n) in zip(out, want)):
                raise ValueError("the sparse step's outputs must be C-contiguous (B, K) int64, (B, K) float64, "
                                 "(B, 1) float64 and (B,) int32 arrays")  # fmt: skip
            self._out, self._ptrs = out, tuple(a.ctypes.data for a in out)
        if len(h) > len(ids) or h.shape[-1] != self.C:
            raise ValueError(f"h must be (B, {self.C}) with B <= the outputs' {len(ids)} rows, got {h.shape}")
        LIBRARY.g2e_certify(self._tp, hp, len(h), k, *self._ptrs, self._wp)

    def rows(self, r, B: int, k: int) -> None:
        """The runtime's check and rows for the first B rows of reader r's outputs (fused.py's FusedReader, native
        mode: ids, logits, bar, ok, rows, last, last_ok), in one call: r.ok[b] = 1 where row b's k best are
        certified, and then r.rows[b] holds them (see _certify.c g2e_rows)."""
        if r.ids is not self._rows_of:
            self._rows_of = r.ids
            self._rows_ptrs = tuple(a.ctypes.data for a in (r.ids, r.logits, r.bar, r.ok, r.rows, r.last, r.last_ok))
        LIBRARY.g2e_rows(B, self.K, r.V, k, TIE, *self._rows_ptrs, self._wp)
