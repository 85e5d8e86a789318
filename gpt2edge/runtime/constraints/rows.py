"""The decode loops' side of a constraint: one matcher per generated row, the (B, W) allowed mask of a step, and
the rule that ends a row whose grammar is complete.

Where the mask sits: after the processors (repetition penalty, n-gram and word bans, min_new_tokens) and before
the warpers (temperature, top-k, top-p, min-p, typical-p), where transformers' generate() places a user
LogitsProcessor: disallowed tokens get score -inf, so the warpers filter and renormalise among allowed tokens
only, and greedy takes the best allowed token. End tokens are allowed only where the grammar accepts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from gpt2edge.runtime.constraints.engine import CompiledConstraint, allowed_masks
from gpt2edge.runtime.constraints.spec import ConstraintError
from gpt2edge.runtime.model.columns import Columns

# the next step's masks are computed here while ONNX Runtime runs the step's forward (both release the GIL)
_prefetcher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpt2edge-mask")
# what handing one mask to the worker and back costs (submit, wake-up, result: ~0.05 ms on 2 cores, where the worker
# also takes a core from ONNX Runtime's threads): a single row's mask cheaper than this is computed in line
HANDOFF_MS = 0.1


class ConstrainedRows:
    """Matchers of a batch's B rows (several sequences per prompt: one each), fresh at the start of a call."""

    def __init__(self, compiled: CompiledConstraint, rows: int, eos_ids: Sequence[int], columns: Columns | None):
        self.matchers = [compiled.matcher() for _ in range(rows)]
        self.eos_ids, self.columns = tuple(int(t) for t in eos_ids), columns
        self._pending: tuple[np.ndarray, Future] | None = None
        self._mask_ms = 0.0  # what the last masks took to compute

    def prefetch(self, active: np.ndarray, rows_in_step: int) -> None:
        """Start the masks of the rows' current states in the background (the loop calls this right before the
        forward that the masks do not depend on); masks() with the same rows collects them. A forward of one row
        whose last mask took less than the handoff (HANDOFF_MS: a JSON Schema's or a sliced class's ~0.05 ms)
        leaves it for masks() to compute in line: the same mask, without the thread's cost. rows_in_step: the
        rows that forward runs (a server's batch holds other requests' rows, whose masks overlap one another)."""
        if rows_in_step <= 1 and self._mask_ms < HANDOFF_MS:
            return
        self._pending = (active.copy(), _prefetcher.submit(self._masks, active.copy()))

    def masks(self, active: np.ndarray) -> np.ndarray:
        """(B, W) bool: each active row's allowed tokens in the head's columns (W = V, or a trimmed head's K);
        finished rows allow everything (their token is ignored)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            done = pending[1].result()  # waited for even when unused: no matcher is touched by two threads
            if np.array_equal(pending[0], active):
                return done
        return self._masks(active)

    def _masks(self, active: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        try:
            return self._allowed_columns(active)
        finally:
            self._mask_ms = (time.perf_counter() - start) * 1e3

    def _allowed_columns(self, active: np.ndarray) -> np.ndarray:
        live = np.flatnonzero(active)
        V = self.matchers[0].compiled.vocab_size
        full = np.ones((len(self.matchers), V), dtype=bool)
        full[[b for b in live if self.matchers[b].dead]] = False  # a beam its grammar refused: nothing goes on
        live = np.array([b for b in live if not self.matchers[b].dead], dtype=np.int64)
        if len(live):
            full[live] = allowed_masks([self.matchers[b] for b in live], self.eos_ids)
        if self.columns is None:
            return full
        kept = full[:, self.columns.ids]
        stuck = [b for b in live if full[b].any() and not kept[b].any()]
        if stuck:  # the grammar's next token is one the trimmed head dropped
            needed = np.flatnonzero(full[stuck[0]])[:5].tolist()
            raise ConstraintError(
                f"The constraint needs token(s) {needed} here, which this vocabulary-trimmed head dropped; use the "
                "untrimmed export, or trim with these tokens kept."
            )
        return kept

    def follow(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Beam search: new row i continues old row rows[i] with tokens[i]. A beam whose token its grammar cannot
        take (an end token, or one the beam search kept at score -inf) gets no allowed token: it ends there."""
        new = []
        for r, t in zip(rows.tolist(), tokens.tolist()):
            m = self.matchers[r].copy()
            if t in self.eos_ids or not m.try_advance(t):
                m.dead = True
            new.append(m)
        self.matchers = new

    def advance(self, row: int, token: int) -> bool:
        """Feed the row's sampled token; True when the grammar is now complete (nothing may follow)."""
        m = self.matchers[row]
        m.advance(token)
        return m.done
