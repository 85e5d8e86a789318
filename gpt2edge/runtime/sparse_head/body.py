"""What every sparse-head graph and LM shares: the OrtGraph surface and OrtLM's contract delegated to the body's,
the head left to the subclass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gpt2edge.runtime.sparse_head.fused import FULL_OUTPUT, HEAD_SWITCH, STEP_INPUT


class BodyGraph:
    """A sparse-head folder's graph: the body OrtGraph (dims, names, kv cache kind) behind OrtGraph's surface; a
    subclass sets self.body and supplies new_lm() and its head. Rows are the whole vocabulary."""

    kept_ids = None
    columns = None

    def __getattr__(self, name: str):
        if name == "body":  # not set yet (during __init__ or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.body, name)

    def slot_head(self) -> tuple[str, dict[str, np.ndarray], Callable[[np.ndarray], np.ndarray] | None]:
        """How cache rows that join and leave (gpt2edge.runtime.model.slots) run this folder: the body output they
        read, the switches they feed, and the head applied to that output (None: it is the log-probs). The full
        head's log-probs, the parent's bit for bit: the certified step works on one row's candidates at a time, so
        a batch of rows at different positions takes the full head (the same greedy token, the same top-k)."""
        outputs = {o.name for o in self.body.session.get_outputs()}
        in_graph = HEAD_SWITCH in self.body.switches and FULL_OUTPUT in outputs  # the body's own copy of the head
        # the graph's certified step off (not read here); the in-graph head on where it has one
        feed = {n: np.array(True) for n in self.body.switches}
        if STEP_INPUT in feed:
            feed[STEP_INPUT] = np.array(False)
        if in_graph:
            feed[HEAD_SWITCH] = np.array(False)
        return (FULL_OUTPUT, feed, None) if in_graph else ("hidden", feed, self.full_head)


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
