"""The decode loops' side of a constraint: one matcher per generated row, the (B, W) allowed mask of a step, and
the rule that ends a row whose grammar is complete.

Where the mask sits: after the processors (repetition penalty, n-gram and word bans, min_new_tokens) and before
the warpers (temperature, top-k, top-p, min-p, typical-p), where transformers' generate() places a user
LogitsProcessor: disallowed tokens get score -inf, so the warpers filter and renormalise among allowed tokens
only, and greedy takes the best allowed token. End tokens are allowed only where the grammar accepts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpt2edge.runtime.constraints.engine import CompiledConstraint, allowed_masks
from gpt2edge.runtime.constraints.spec import ConstraintError
from gpt2edge.runtime.model.columns import Columns


class ConstrainedRows:
    """Matchers of a batch's B rows (several sequences per prompt: one each), fresh at the start of a call."""

    def __init__(self, compiled: CompiledConstraint, rows: int, eos_ids: Sequence[int], columns: Columns | None):
        self.matchers = [compiled.matcher() for _ in range(rows)]
        self.eos_ids, self.columns = tuple(int(t) for t in eos_ids), columns

    def masks(self, active: np.ndarray) -> np.ndarray:
        """(B, W) bool: each active row's allowed tokens in the head's columns (W = V, or a trimmed head's K);
        finished rows allow everything (their token is ignored)."""
        live = np.flatnonzero(active)
        V = self.matchers[0].compiled.vocab_size
        full = np.ones((len(self.matchers), V), dtype=bool)
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

    def advance(self, row: int, token: int) -> bool:
        """Feed the row's sampled token; True when the grammar is now complete (nothing may follow)."""
        m = self.matchers[row]
        m.advance(token)
        return m.done
