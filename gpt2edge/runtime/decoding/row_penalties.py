"""Per-row score adjustments beside transformers' processors: OpenAI's presence and frequency penalties and
logit_bias, and min_tokens holding back stop_token_ids (as it holds back end-of-text).

OpenAI's rule, on the row's generated tokens only (not the prompt, as OpenAI and vLLM count them):
  score[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0);  score[j] += logit_bias[j]
applied to the graph's log-probs (a softmax is shift-invariant: adding to log-probs or logits samples alike),
before transformers' processors and warpers. The server's continuous scheduler maps its OpenAI fields here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from gpt2edge.runtime.decoding.processors import NEG_INF, token_columns
from gpt2edge.runtime.model.columns import Columns


def bias_pairs(logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None) -> tuple[tuple[int, float], ...]:
    """A dict {id: bias} or (id, bias) pairs -> (id, bias) pairs, in their order."""
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else (logit_bias or ())
    return tuple((int(t), float(b)) for t, b in items)


class RowPenalties:
    def __init__(
        self,
        width: int,
        columns: Columns | None,
        *,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None = (),
        stop_token_ids: Iterable[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self.presence, self.frequency, self.min_tokens = presence_penalty, frequency_penalty, min_tokens
        self.width, self.columns = width, columns
        pairs = bias_pairs(logit_bias)
        ids = np.array([t for t, _ in pairs], dtype=np.int64)
        bias = np.array([b for _, b in pairs], dtype=np.float32)
        if columns is not None:  # a trimmed head: only the kept ids have a column (the others cannot be drawn)
            kept = columns.col[ids] >= 0
            ids, bias = ids[kept], bias[kept]
        self.bias_cols, self.bias = token_columns(ids, width, columns), bias
        self.stop_cols = token_columns(list(stop_token_ids), width, columns)
        self.counts: np.ndarray | None = None  # (W,) how often each column's token was generated

    def apply(self, scores: np.ndarray, n_generated: int) -> np.ndarray:
        """(1, W) scores -> adjusted (1, W) scores (a new array when anything changes)."""
        penalize = self.counts is not None and (self.presence or self.frequency)
        hold = n_generated < self.min_tokens and len(self.stop_cols)
        if not (penalize or len(self.bias_cols) or hold):
            return scores
        out = scores.copy()
        if penalize:
            c = self.counts
            out[0] -= np.float32(self.frequency) * c + np.float32(self.presence) * (c > 0)
        if len(self.bias_cols):
            out[0, self.bias_cols] += self.bias
        if hold:
            out[0, self.stop_cols] = NEG_INF
        return out

    def push(self, token: int) -> None:
        if not (self.presence or self.frequency):
            return
        if self.counts is None:
            self.counts = np.zeros(self.width, dtype=np.float32)
        self.counts[token_columns([token], self.width, self.columns)] += 1
