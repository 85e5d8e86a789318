"""The certified step the body graph computes itself (folders with a `fused` record, gpt2edge.sparse.fused).

Each body run also writes, per row, the ids of the K rows of best upper bound, their logits (within FUSED_TOL
of exact.py's, checked at load) and a bar above every other row's logit (bound rounding included). Here a row is
certified when its choice depends only on candidates that beat the bar by more than TIE and are themselves
apart by more than TIE. TIE = 1e-3 covers FUSED_TOL plus the head kernel's float rounding against exact.py
(TIE / 4, checked at load): so the kernel cannot order the candidates, or any other row, differently.
  greedy (k = 1):  best - TIE > bar  and  best - TIE > the runner-up candidate;
  top-k (k < K):   k-th best - TIE > bar  and  k-th best - TIE > (k+1)-th best candidate.
Then the full head's k best are exactly these candidates, in this order, so greedy and top-k draws are the full
head's (top-k softmax within ~1e-5). Otherwise the row runs the
full head. The outputs are bound once per batch size to buffers of this object (no copies, no V-wide work).
"""

from __future__ import annotations

import numpy as np

from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.runtime.sparse_head.exact import TIE

IDS, LOGITS, BAR = "sparse_ids", "sparse_logits", "sparse_bar"
# the body graph's switches (bool inputs; OrtGraph feeds them True): run the graph's own certified step; skip the
# full head inside the body graph (gpt2edge.sparse.guard), whose log-probs come out as FULL_OUTPUT when it runs
STEP_INPUT, HEAD_SWITCH, FULL_OUTPUT = "sparse_step", "sparse_skip_head", "logprobs"
FUSED_TOL = TIE / 8  # the graph's float32 logits against exact.py's (measured ~1e-6 on trained-gpt2-py)


class FusedReader:
    """The sparse outputs of one OrtLM's body runs (not thread-safe: one per SparseLM)."""

    def __init__(self, body_lm: OrtLM, k: int, vocab_size: int, native: bool = False) -> None:
        self.body, self.K, self.V = body_lm, k, vocab_size
        self.native = native  # the outputs come from native.py, not the graph: the graph's step is switched off
        # the body graph holds the full head too (guard.py): switched on, its log-probs land in _full_buf
        self.head_in_graph = HEAD_SWITCH in body_lm.switches and body_lm.binding is not None
        self._full_buf = np.empty((0, vocab_size), dtype=np.float32)
        self._full_mode: tuple[bool, int] | None = None  # how FULL_OUTPUT is bound: (on, B)
        self.B = 0
        self.ids = self.logits = self.bar = self.read = None
        self.ok = self.last = self.last_ok = None
        self.rows = np.empty((0, vocab_size), dtype=np.float32)  # the returned rows: -inf but at the last ids
        self._written: list[np.ndarray | None] = []  # per row: the ids written last step (None: the whole row)

    def arm(self, B: int) -> bool:
        """Before a body run of B rows: (re)bind the outputs when B changed, and mark them unwritten (a run
        that does not write them, such as a row-by-row shared-cache step, leaves NaN: not certified).
        False when this LM runs without IO binding (the outputs are not fetched: every step is full)."""
        b = self.body.binding
        if b is None:
            return False
        if self.native and STEP_INPUT in self.body.switches:  # the graph's own step off (read by address each run)
            self.body.switches[STEP_INPUT][...] = False
        # native buffers hold at least B rows (a tail body's verify steps change B * keep nearly every step: no
        # (B, V) row buffer is re-made for fewer rows); the graph's outputs are bound at exactly B
        if B > self.B or (B != self.B and not self.native):
            self.ids = np.zeros((B, self.K), dtype=np.int64)
            self.logits = np.empty((B, self.K), dtype=np.float64)
            self.bar = np.empty((B, 1), dtype=np.float64)
            self.read = np.full(B, self.K, dtype=np.int32)  # exact rows per row (native.py writes more)
            for name, arr in ((IDS, self.ids), (LOGITS, self.logits), (BAR, self.bar)):
                if not self.native:
                    b.bind_output(name, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)
            self.rows = np.full((B, self.V), -np.inf, dtype=np.float32)
            self._written = [None] * B
            if self.native:  # native.py's rows(): its verdicts and the ids it wrote last (last_ok 0: unknown)
                self.ok = np.zeros(B, dtype=np.int8)
                self.last = np.zeros((B, self.K), dtype=np.int64)
                self.last_ok = np.zeros(B, dtype=np.int8)
            self.B = B
        self.bar.fill(np.nan)
        return True

    def switch_head(self, full: bool, B: int) -> None:
        """Before a body run: the body graph's full head on, its (B, V) log-probs written into our buffer, or off
        (ORT allocates the (1, 1) placeholder; a bound buffer of another shape would fail the run)."""
        self.body.switches[HEAD_SWITCH][...] = not full
        if not self.native and STEP_INPUT in self.body.switches:
            # the graph's own step is not read on a full-head step; its (1, K) placeholders fit the bound buffers
            # only at B = 1 (so at B > 1 it runs anyway)
            self.body.switches[STEP_INPUT][...] = not (full and B == 1)
        mode = (full, B if full else 0)
        if mode == self._full_mode:
            return
        if full:
            if len(self._full_buf) != B:
                self._full_buf = np.empty((B, self.V), dtype=np.float32)
            buf = self._full_buf
            self.body.binding.bind_output(FULL_OUTPUT, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        else:
            self.body.binding.bind_output(FULL_OUTPUT, "cpu")
        self._full_mode = mode

    def full_logprobs(self, B: int) -> np.ndarray | None:
        """The (B, V) log-probs of the body's last run, when switch_head put its full head on for B rows."""
        return self._full_buf if self._full_mode == (True, B) else None

    def certified(self, b: int, k: int) -> bool:
        """Whether row b's k best tokens (in order) are its best candidates, by more than TIE. (A repeated
        candidate carries the same logit both times: a repeated best is no better than its runner-up.)"""
        bar, ex = self.bar[b, 0], self.logits[b]
        if not bar == bar or k >= self.K:  # NaN: the run did not write the outputs
            return False
        if k == 1:
            j = int(ex.argmax())
            best = ex[j]
            ex[j] = -np.inf  # our own buffer, rewritten by the next run: the runner-up without a copy
            second = ex.max()
            ex[j] = best
            return bool(best - TIE > bar and best - TIE > second)
        order = np.argpartition(ex, self.K - k - 1)[self.K - k - 1 :]  # the k + 1 best, the (k+1)-th first
        kth = ex[order[1:]].min()
        # a short group repeats rows, so a row may be a candidate twice: the k best must be k rows
        distinct = np.unique(self.ids[b, order[1:]]).size == k
        return bool(distinct and kth - TIE > bar and kth - TIE > ex[order[0]])

    def row(self, b: int) -> np.ndarray:
        """Row b of the returned (B, V) rows: the candidates' exact logits shifted so the best is 0, -inf
        elsewhere (only the ids written last step are reset)."""
        out = self.rows[b]
        last = self._written[b]
        if last is None:
            out.fill(-np.inf)
        else:
            out[last] = -np.inf
        ids = self.ids[b].copy()
        ex = self.logits[b]
        out[ids] = ex - ex.max()
        self._written[b] = ids
        return out

    def full_row(self, b: int, logprobs: np.ndarray) -> None:
        """Row b gets the full head's log-probs (an uncertified row)."""
        self.rows[b] = logprobs
        self._written[b] = None
        if self.last_ok is not None:
            self.last_ok[b] = 0
