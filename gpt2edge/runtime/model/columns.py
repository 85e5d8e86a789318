"""The log-prob columns of a vocabulary-trimmed head and the full token ids they score.

A trimmed graph (gpt2edge trim-vocab) returns (B, K) log-probs: column j scores token `ids[j]`, ids ascending.
The generate loops sample, record and beam-search on those K columns and map only what leaves them (the chosen
tokens, logprobs records, beam tokens) back to full ids; the processors map the full ids they read (seen
tokens, bans, EOS) to columns. Because the map is increasing, "lower column" and "lower id" order ties alike,
so every choice is the one the full (B, V) row with -inf at the dropped ids gives (gpt2edge.runtime.decoding.sampling
says where the float arithmetic must still see the full row's layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)  # arrays inside: compared and hashed by identity
class Columns:
    """ids: (K,) int64 ascending, the full id of each column; vocab_size: V; col: (V,) int64, each full id's
    column, -1 for a dropped id."""

    ids: np.ndarray
    vocab_size: int
    col: np.ndarray

    @classmethod
    def of(cls, kept_ids: np.ndarray, vocab_size: int) -> Columns:
        col = np.full(vocab_size, -1, dtype=np.int64)
        col[kept_ids] = np.arange(len(kept_ids))
        return cls(np.asarray(kept_ids, dtype=np.int64), int(vocab_size), col)

    @property
    def width(self) -> int:
        return len(self.ids)

    def cols(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Full ids -> the columns of those that are kept, in their order; a dropped id (or one past the
        vocabulary) has no column: it cannot be generated, so nothing needs to be done to its score."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        c = self.col[ids[(ids >= 0) & (ids < self.vocab_size)]]
        return c[c >= 0]

    def value(self, row: np.ndarray, token_id: int) -> float:
        """A (K,) row's entry for full id token_id; -inf (probability 0) for a dropped id."""
        c = self.col[token_id] if 0 <= token_id < self.vocab_size else -1
        return float(row[c]) if c >= 0 else float("-inf")

    def scatter(self, x: np.ndarray) -> np.ndarray:
        """(K,) values -> a new (V,) array, 0 at the dropped ids (a probability row in the full layout)."""
        out = np.zeros(self.vocab_size, dtype=x.dtype)
        out[self.ids] = x
        return out

    def full(self, lp: np.ndarray) -> np.ndarray:
        """(..., K) log-probs -> a new (..., V) float32 array, -inf at the dropped ids (probability 0)."""
        out = np.full((*lp.shape[:-1], self.vocab_size), -np.inf, dtype=np.float32)
        out[..., self.ids] = lp
        return out


def lm_columns(lm) -> Columns | None:
    """The columns forward_columns(lm, ...) returns: None when they are the full vocabulary (column j is token
    j: an untrimmed head, a static graph, or the full-vocabulary path forced on a trimmed OrtLM)."""
    return None if lm.kept_ids is None else lm.columns


def forward_columns(lm, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """lm.forward, but on a trimmed head the graph's own (B, K) log-probs (see lm_columns), never scattered to
    (B, V): what the generate loops sample from."""
    if lm_columns(lm) is None:
        return lm.forward(input_ids, attention_mask, position_ids)
    return lm.forward_kept(input_ids, attention_mask, position_ids)
