"""What every sparse-head graph and LM shares: the OrtGraph surface and OrtLM's contract delegated to the body's,
the head left to the subclass."""

from __future__ import annotations

from typing import Any

import numpy as np


class BodyGraph:
    """A sparse-head folder's graph: the body OrtGraph (dims, names, kv cache kind) behind OrtGraph's surface; a
    subclass sets self.body and supplies new_lm() and its head. Rows are the whole vocabulary."""

    kept_ids = None
    columns = None

    def __getattr__(self, name: str):
        if name == "body":  # not set yet (during __init__ or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.body, name)


class BodyLM:
    """The body's LM (dims, cache and row management: use_rows, expand_rows, reorder_rows, rewind, compact ...)
    behind OrtLM's contract; a subclass supplies forward() with its head. Rows are the whole vocabulary (no
    trimmed columns). Not thread-safe (one per generation, like OrtLM)."""

    def __init__(self, graph: Any, io_binding: bool = True) -> None:
        self.graph = graph
        self.body = graph.body.new_lm(io_binding)
        self.kept_ids = None
        self.columns = None

    def __getattr__(self, name: str):
        if name == "body":  # not set yet (during __init__ or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.body, name)

    @property
    def past_len(self) -> int:
        return self.body.past_len

    @past_len.setter
    def past_len(self, value: int) -> None:
        self.body.past_len = value

    def forward(self, input_ids, attention_mask, position_ids, keep: int | None = None) -> np.ndarray:
        raise NotImplementedError

    def forward_kept(self, input_ids, attention_mask, position_ids) -> np.ndarray:
        return self.forward(input_ids, attention_mask, position_ids)

    def to_full_vocab(self, lp: np.ndarray) -> np.ndarray:
        return lp
