"""SparseGraph and SparseLM: a sparse-head folder as the runtime's graph and generation context.

The body graph (an OrtGraph returning `hidden`) runs the blocks; the head runs here, per row:
  1. h_eff = the activation the head's kernel multiplies (exact.py); every row's upper bound
     ub_i = h_eff . mu + (Q^T h_eff) . a_i + ||h_eff - Q Q^T h_eff|| eps_i in one single-threaded MatMul, the
     bound graph (r + 2 multiply-adds a row; a threaded BLAS beside ONNX Runtime's spinning threads stalls);
  2. the k rows of best bound get their exact logit; L = the k-th best of them; when many rows still reach L,
     the best REFINE of them by the bound's centre s_i = ub_i - ||.|| eps_i raise L (a loose bound can top ub);
  3. every row with ub_i >= L - slack gets its exact logit; the rest provably score below the k-th best;
  4. certified when the k-th and (k+1)-th best exact logits differ by more than TIE (exact.py), else that
     row falls back to the full head (the parent's head graph) and the fallback is counted.
The result row holds the exact logits of the rows read (the best at 0, -inf elsewhere): the full head's greedy token
and top-k distribution. Calls that need more (sparse_k says which) run the full head: the parent's log-probs.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest import resolve_inside
from gpt2edge.runtime.model.ort_session import create_session, quiet_run_options, run_errors
from gpt2edge.runtime.sparse_head.body import BodyGraph, BodyLM
from gpt2edge.runtime.sparse_head.exact import TIE, HeadKernel
from gpt2edge.runtime.sparse_head.fused import FUSED_TOL, IDS, STEP_INPUT, FusedReader
from gpt2edge.runtime.sparse_head.native import LIBRARY, NativeStep, load_step_arrays
from gpt2edge.runtime.sparse_head.policy import sparse_k
from gpt2edge.runtime.sparse_head.record import FIX, SparseHeadInfo, load_table

# past this share of the rows to read exactly (but at least MIN_ROWS), a step runs the full head: NumPy's exact
# rows cost ~0.1 us each against ~3 ns a row for ONNX Runtime's int8 head, so beyond ~2 % the full head is faster
MAX_FRACTION = 0.02
MIN_ROWS = 64
REFINE = 16  # rows whose exact logits raise the floor when the first one leaves many candidates
MAX_SKIP = 64  # at most this many steps run the full head before the sparse head is tried again


@dataclass
class SparseStats:
    """Counters over every step since load (or reset()): `steps` head evaluations (one per row per forward),
    `certified` of them served by the sparse head, `fallbacks` that could not be certified and ran the full head,
    `full` that ran the full head because the call needs it; `skipped` that ran it (in the body's run) because the
    steps before them did not certify; `rows_read` exact rows summed over certified steps."""

    steps: int = 0
    certified: int = 0
    fallbacks: int = 0
    full: int = 0
    skipped: int = 0
    rows_read: int = 0

    def to_json(self, vocab_size: int) -> dict:
        out = asdict(self)
        out["certified_fraction"] = self.certified / self.steps if self.steps else 0.0
        out["rows_read_fraction"] = self.rows_read / (self.certified * vocab_size) if self.certified else 0.0
        return out


class SparseGraph(BodyGraph):
    """A sparse-head folder loaded once (shared by threads): the body graph (an OrtGraph whose first output is
    `hidden`, from gpt2edge.runtime.open_model.load_graph), the head graph, the bound graph and the tables."""

    def __init__(
        self,
        body,
        device: str = "cpu",
        threads: int | None = None,
        spin: bool = True,
        max_fraction: float = MAX_FRACTION,
    ) -> None:
        if not 0.0 < max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in (0, 1], got {max_fraction!r}")
        folder = body.folder
        rec = SparseHeadInfo.of(folder.info, str(folder.path / "manifest.json"))
        if rec is None:
            raise ModelFolderError(f"{folder.path} has no sparse head; load it with load_graph.")
        self._take_body(body)
        self.rec, self.device = rec, device
        out = body.session.get_outputs()[0]
        width = out.shape[-1] if out.shape else None
        if out.name != "hidden" or (isinstance(width, int) and width != folder.dims.n_embd):
            raise ModelFolderError(
                f"{folder.path}: the graph's first output is {out.name} {out.shape}, not the (batch, "
                f"{folder.dims.n_embd}) hidden state its sparse_head record describes; {FIX}."
            )
        self.head_path = resolve_inside(folder.path, rec.head_file)
        # one thread, on the caller's: a second pool spinning beside the body's would take its cores (2x slower)
        kw = dict(device=device, kleidiai=folder.kleidiai)
        self.head = create_session(self.head_path, threads=1 if device == "cpu" else threads, **kw)
        self.bound_path = resolve_inside(folder.path, rec.bound_file)
        self.bound = create_session(self.bound_path, threads=1, **kw)
        self.run_options = quiet_run_options()
        d = folder.dims
        self.table_path = resolve_inside(folder.path, rec.table_file)
        self.table = load_table(self.table_path, rec, d.vocab_size, d.n_embd)
        self.max_rows = max(min(MIN_ROWS, d.vocab_size), int(max_fraction * d.vocab_size))
        self.stats = SparseStats()
        self._lock = threading.Lock()
        self.certify = self._self_check()
        # K when the body graph computes the certified step itself (fused.py), after its own check; the step runs
        # natively (native.py) where the library is built and the graph can skip its own
        outputs = {o.name for o in body.session.get_outputs()}
        # a --head tail body (speculative verify: hidden (B, keep, C)) has no step of its own: native only
        self.tail = body.keeps
        in_graph = IDS in outputs or (self.tail and LIBRARY is not None)
        self.fused_k = rec.candidates if rec.candidates and in_graph and self.certify else None
        self.step_arrays = None
        if self.fused_k and (STEP_INPUT in body.switches or self.tail) and rec.groups and LIBRARY is not None:
            self.step_arrays = load_step_arrays(self.table_path, d.vocab_size, d.n_embd, rec.rank)
        if self.fused_k and self.tail and self.step_arrays is None:
            self.fused_k = None  # the NumPy path (_select), row by row
        if self.fused_k and not self._check_fused():
            self.fused_k = None

    def new_lm(self, io_binding: bool = True) -> SparseLM:
        return SparseLM(self, io_binding=io_binding)

    def full_head(self, h: np.ndarray) -> np.ndarray:
        """(B, C) hidden -> (B, V) float32 log-probs from the parent's head graph."""
        with run_errors(self.head_path):
            return self.head.run(None, {"hidden": np.ascontiguousarray(h, dtype=np.float32)}, self.run_options)[0]

    def count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = SparseStats()

    def _self_check(self) -> bool:
        """On two seeded probes: the bound table must bound every row's exact logit (a table built for another
        model, or edited and loaded without verification, is refused), and the exact logits must agree with this
        machine's head kernel within TIE / 4 (else the sparse path is off: every step runs the full head)."""
        kernel = HeadKernel(self.table, self.rec.kind, self.folder.dims.n_embd)
        rng = np.random.default_rng(0)
        agree = True
        for scale in (1.0, 8.0):
            h = (rng.standard_normal(self.folder.dims.n_embd) * scale).astype(np.float32)
            he = kernel.prepare(h)
            exact = kernel.full()
            ub, _, slack = self.first_pass(kernel, he)
            if ub.shape != exact.shape or np.any(ub + slack < exact):
                raise ModelFolderError(
                    f"{self.folder.path}: the sparse head's bound table does not bound the head's logits (built for "
                    "another model, or edited); build it again with `gpt2edge sparse-head`."
                )
            d = exact - self.full_head(h[None])[0].astype(np.float64)
            agree &= bool(d.max() - d.min() < TIE / 4)
        if not agree:
            warnings.warn(
                f"{self.folder.path}: this ONNX Runtime's head kernel differs from the sparse head's arithmetic by "
                f"more than {TIE / 4}; every step runs the full head.",
                stacklevel=3,
            )
        return agree

    def _check_fused(self) -> bool:
        """One body run on a short prompt: the graph's bar must be above every other row's logit (else a graph
        built for another table: refused), and its candidates' logits within FUSED_TOL of exact.py's (else
        warned: every step runs the NumPy path)."""
        lm = SparseLM(self)
        ids = (np.arange(3, dtype=np.int64) * 7919 % self.folder.dims.vocab_size)[None]
        lm.start(1, 3)
        lm.fused.arm(1)
        h = lm.body.forward(ids, np.ones_like(ids), np.arange(3)[None])
        if lm.native is not None:
            lm.native.certify(h, lm.fused.ids, lm.fused.logits, lm.fused.bar, lm.fused.read)
        kernel = HeadKernel(self.table, self.rec.kind, self.folder.dims.n_embd)
        kernel.prepare(h[0])
        f, exact = lm.fused, kernel.full()
        if np.delete(exact, f.ids[0]).max() > f.bar[0, 0]:
            raise ModelFolderError(
                f"{self.folder.path}: the body graph's sparse step does not bound the head's logits (built for "
                f"another model, or edited); {FIX}."
            )
        err = float(np.abs(exact[f.ids[0]] - f.logits[0]).max())
        if err > FUSED_TOL and lm.native is not None and not self.tail:  # native off: the graph's own, checked again
            self.step_arrays = None
            return self._check_fused()
        if err > FUSED_TOL:
            warnings.warn(f"{self.folder.path}: the body graph's sparse logits are off the head's arithmetic by "
                          f"{err:.2g} (> {FUSED_TOL}); the sparse step runs in NumPy.", stacklevel=3)  # fmt: skip
        return err <= FUSED_TOL

    def first_pass(self, kernel: HeadKernel, he: np.ndarray) -> tuple[np.ndarray, float, float]:
        """(ub, residual norm, slack): every row's upper bound for the activation he (C,), the norm that scales
        eps, and the allowance for float rounding."""
        t = self.table
        q = t.q.astype(np.float64)
        hq = he.astype(np.float64) @ q  # (r,), tiny: no BLAS threads
        perp = float(np.linalg.norm(he - q @ hq)) * (1 + 1e-5)
        x = np.empty((1, len(hq) + 2), dtype=np.float32)
        x[0, :-2], x[0, -2], x[0, -1] = hq, perp, he.astype(np.float64) @ t.mu
        with run_errors(self.bound_path):
            ub = self.bound.run(None, {"bound_input": x}, self.run_options)[0][0]
        slack = kernel.scale * float(np.linalg.norm(he)) + float(np.linalg.norm(hq)) * t.eps_par
        return ub, perp, slack


class SparseLM(BodyLM):
    """OrtLM's contract on a sparse-head folder: forward() -> (B, V) rows for the next token.

    By default (and after every start()) each step runs the full head: log-probs, as OrtLM gives. A generate
    loop calls configure_head(params, logprobs) after start(); when sparse_k allows, steps run the certified
    sparse head and return exact logits shifted so the best is 0 (-inf at rows not read): the same argmax and
    top-k softmax, not log-probs. Not thread-safe (one per generation, like OrtLM)."""

    def __init__(self, graph: SparseGraph, io_binding: bool = True) -> None:
        super().__init__(graph, io_binding)
        self.kernel = HeadKernel(graph.table, graph.rec.kind, graph.folder.dims.n_embd)
        arrays = graph.step_arrays if graph.fused_k else None
        self.native = None if arrays is None else NativeStep(graph.table, arrays, graph.rec.kind, graph.fused_k,
                                                             graph.rec.groups)  # fmt: skip
        self.fused = FusedReader(self.body, graph.fused_k, graph.vocab_size, self.native is not None) \
            if graph.fused_k else None  # fmt: skip
        self.k: int | None = None
        self._skip = self._backoff = 0  # steps left to run the full head in the body's run, and the last such run

    def start(self, batch: int, length: int) -> None:
        self.k = None  # a loop that never configures the head (beam search, scoring) gets log-probs
        self._skip = self._backoff = 0
        self.body.start(batch, length)

    def configure_head(self, params, logprobs: bool = False) -> None:
        """Serve the coming steps sparsely when the call's choice depends only on the k best logits."""
        self.k = sparse_k(params, logprobs) if self.graph.certify else None

    def forward(self, input_ids, attention_mask, position_ids, keep: int | None = None) -> np.ndarray:
        # the sparse outputs stay bound at the batch size of every run (beam search grows it), used or not
        B, S = input_ids.shape
        # a tail body's step returns `keep` rows a sequence, each certified on its own
        armed = self.fused is not None and self.fused.arm(B * (keep or 1) if self.graph.tail else B)
        fused = armed and self.k is not None and self.k < self.fused.K and bool(self.graph.fused_k)
        # the full head in the body's own run (guard.py): for calls that need it, and after uncertified steps
        in_graph = armed and self.fused.head_in_graph and not self.body.runs_by_row(B, S)
        skipped = fused and in_graph and self._skip > 0
        if skipped:
            self._skip -= 1
            fused = False
        full = in_graph and (self.k is None or skipped)
        if in_graph:
            self.fused.switch_head(full, B)
        h = self.body.forward(input_ids, attention_mask, position_ids, keep)
        if keep is not None and not self.graph.tail:  # a last-position graph: keep is 1 (OrtLM refuses more)
            h = h[:, -1]
        lp = self.fused.full_logprobs(B) if full else None
        if lp is not None:
            self.graph.count(steps=B, **{"skipped" if skipped else "full": B})
            return lp if keep is None else lp[:, None]
        shape = h.shape[:-1]  # (B,), or a tail body's (B, keep): each kept position is a row of its own
        h = h.reshape(-1, h.shape[-1])  # (N, C), a view
        if fused and self.native is not None:
            self.native.certify(h, self.fused.ids, self.fused.logits, self.fused.bar, self.fused.read, self.k)
        rows = self._head_fused(h) if fused else self._head(h)  # (N, V)
        return rows.reshape(*shape, -1) if keep is None or self.graph.tail else rows[:, None]

    def _head_fused(self, h: np.ndarray) -> np.ndarray:
        """(B, C) hidden -> (B, V) rows from the body graph's certified step; a row it cannot certify runs the
        full head (its log-probs)."""
        f, g = self.fused, self.graph
        read = 0
        if self.native is not None:  # the check and the rows in the native call too
            self.native.rows(f, len(h), self.k)
        missed = []
        for b in range(len(h)):
            if f.ok[b] if self.native is not None else f.certified(b, self.k):
                if self.native is None:
                    f.row(b)
                read += int(f.read[b])
            else:
                missed.append(b)
        if missed:  # one run of the full head for every row it must serve (a verify step's positions)
            for b, lp in zip(missed, g.full_head(h[missed])):
                f.full_row(b, lp)
        certified = len(h) - len(missed)
        g.count(steps=len(h), certified=certified, fallbacks=len(missed), rows_read=read)
        # after an uncertified step the next ones run the full head in the body's run, 1, 2, 4 ... MAX_SKIP of them
        # while they keep failing (top-k 40 almost never certifies); a certified step starts over
        self._backoff = 0 if certified == len(h) else min(max(1, 2 * self._backoff), MAX_SKIP)
        self._skip = self._backoff
        return f.rows[: len(h)]  # the reader's buffers may hold more rows (fused.py arm)

    def _head(self, h: np.ndarray) -> np.ndarray:
        """(B, C) hidden -> (B, V) rows: log-probs from the full head, or certified sparse rows."""
        g = self.graph
        if self.k is None:
            g.count(steps=len(h), full=len(h))
            return g.full_head(h)
        V = g.folder.dims.vocab_size
        out = np.full((len(h), V), -np.inf, dtype=np.float32)
        for b in range(len(h)):
            picked = self._select(h[b], self.k)
            if picked is None:
                g.count(steps=1, fallbacks=1)
                out[b] = g.full_head(h[b : b + 1])[0]
                continue
            rows, vals = picked
            g.count(steps=1, certified=1, rows_read=len(rows))
            out[b, rows] = (vals - vals.max()).astype(np.float32)
        return out

    def _select(self, h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows read, their exact logits) with every row that can be among the k best; None: not certified."""
        kernel, g = self.kernel, self.graph
        he = kernel.prepare(h)
        ub, perp, slack = g.first_pass(kernel, he)
        V = len(ub)
        k = min(k, V)
        first = np.array([int(ub.argmax())]) if k == 1 else np.argpartition(ub, V - k)[V - k :]
        floor = kernel.exact(first).min()  # the k-th best logit is at least this
        rows = np.flatnonzero(ub >= floor - slack - TIE)
        if len(rows) > REFINE + k:  # raise the floor with the rows of best bound centre among them
            centre = ub[rows] - perp * g.table.eps[rows]
            best = rows[np.argpartition(centre, len(rows) - REFINE - k)[len(rows) - REFINE - k :]]
            vals = kernel.exact(best)
            floor = max(floor, np.partition(vals, len(vals) - k)[len(vals) - k])
            rows = rows[ub[rows] >= floor - slack - TIE]
        if len(rows) > g.max_rows:
            return None
        vals = kernel.exact(rows)
        if len(rows) > k:  # the k-th and the next best must be apart by more than the kernel's rounding
            top = -np.partition(-vals, k)[: k + 1]
            top.sort()
            if top[1] - top[0] <= TIE:
                return None
        return rows, vals
