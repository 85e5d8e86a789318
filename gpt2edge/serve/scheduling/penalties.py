"""Per-row score adjustments the runtime's SamplingParams does not have: OpenAI's presence and frequency
penalties and logit_bias, and min_tokens holding back stop_token_ids (as it holds back end-of-text).

OpenAI's rule, on the row's generated tokens only (not the prompt, as OpenAI and vLLM count them):
  score[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0);  score[j] += logit_bias[j]
applied to the graph's log-probs (a softmax is shift-invariant: adding to log-probs or logits samples alike),
before transformers' processors and warpers.
"""

from __future__ import annotations

import numpy as np

from gpt2edge.runtime.decoding.processors import NEG_INF, token_columns
from gpt2edge.runtime.model.columns import Columns
from gpt2edge.serve.scheduling.jobs import Sampling


class RowPenalties:
    def __init__(self, sampling: Sampling, width: int, columns: Columns | None) -> None:
        self.s, self.width, self.columns = sampling, width, columns
        ids = np.array([t for t, _ in sampling.logit_bias], dtype=np.int64)
        bias = np.array([b for _, b in sampling.logit_bias], dtype=np.float32)
        if columns is not None:  # a trimmed head: only the kept ids have a column (the others cannot be drawn)
            kept = columns.col[ids] >= 0
            ids, bias = ids[kept], bias[kept]
        self.bias_cols, self.bias = token_columns(ids, width, columns), bias
        self.stop_cols = token_columns(list(sampling.stop_token_ids), width, columns)
        self.counts: np.ndarray | None = None  # (W,) how often each column's token was generated

    def apply(self, scores: np.ndarray, n_generated: int) -> np.ndarray:
        """(1, W) scores -> adjusted (1, W) scores (a new array when anything changes)."""
        s = self.s
        penalize = self.counts is not None and (s.presence_penalty or s.frequency_penalty)
        hold = n_generated < s.min_tokens and len(self.stop_cols)
        if not (penalize or len(self.bias_cols) or hold):
            return scores
        out = scores.copy()
        if penalize:
            c = self.counts
            out[0] -= np.float32(s.frequency_penalty) * c + np.float32(s.presence_penalty) * (c > 0)
        if len(self.bias_cols):
            out[0, self.bias_cols] += self.bias
        if hold:
            out[0, self.stop_cols] = NEG_INF
        return out

    def push(self, token: int) -> None:
        if not (self.s.presence_penalty or self.s.frequency_penalty):
            return
        if self.counts is None:
            self.counts = np.zeros(self.width, dtype=np.float32)
        self.counts[token_columns([token], self.width, self.columns)] += 1
