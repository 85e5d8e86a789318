"""What every sparse-head graph and LM shares: the body's facts and cache rows behind runtime/model/contract.py's
Graph and LM, the head left to the subclass."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpt2edge.runtime.model.lm import OrtGraph, OrtLM, SlotView
from gpt2edge.runtime.sparse_head.fused import FULL_OUTPUT, HEAD_SWITCH, STEP_INPUT


class BodyGraph:
    """A sparse-head folder's graph: the body OrtGraph (dims, names, kv cache kind) behind runtime/model/contract.py's
    Graph; a subclass calls _take_body(body) and supplies new_lm() and its head. Rows are the whole vocabulary."""

    kept_ids = None
    columns = None
    batch = None  # any batch
    approximate = None  # the model's own rows (ApproxGraph says otherwise)
    supports_prefix_cache = False  # a generation's rows come from the sparse LM, not a plain one-row cache
    probe_refusal = "not probed on this graph kind"
    own_slot_refusal: str | None = None  # why SlotLM does not run this kind, beyond the body's own reason

    def _take_body(self, body: OrtGraph) -> None:
        """The body's facts, read once: the graph kinds share them (the head only changes the last layer)."""
        self.body, self.folder, self.device = body, body.folder, body.device
        self.n_layer, self.n_head, self.head_dim = body.n_layer, body.n_head, body.head_dim
        self.n_positions, self.vocab_size, self.kv_dtype = body.n_positions, body.vocab_size, body.kv_dtype
        self.past_names, self.present_names, self.shared = body.past_names, body.present_names, body.shared

    @property
    def slot_refusal(self) -> str | None:
        return self.body.slot_refusal or self.own_slot_refusal

    def slot_view(self) -> SlotView:
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
        head = None if in_graph else self.full_head  # SparseGraph's: the parent's head graph
        return SlotView(self.body, FULL_OUTPUT if in_graph else "hidden", feed, head)


class BodyLM:
    """The body's LM (dims, cache and row management: use_rows, expand_rows, reorder_rows, rewind, compact ...)
    behind runtime/model/contract.py's LM; a subclass supplies start(), configure_head() and forward() with its
    head. Rows are the whole vocabulary (no trimmed columns). Not thread-safe (one per generation, like OrtLM)."""

    kept_ids = None
    columns = None
    batch = None
    supports_row_state = False  # refused like a static LM's: the sparse LM's rows are not saved (session_file)

    def __init__(self, graph: Any, io_binding: bool = True) -> None:
        self.graph = graph
        self.body: OrtLM = graph.body.new_lm(io_binding)
        b = self.body
        self.folder, self.device, self.shared, self.past_names = b.folder, b.device, b.shared, b.past_names
        self.n_layer, self.n_head, self.head_dim = b.n_layer, b.n_head, b.head_dim
        self.n_positions, self.vocab_size, self.kv_dtype = b.n_positions, b.vocab_size, b.kv_dtype

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

    # the cache's rows are the body's (the head keeps no state across steps)
    def use_rows(self, rows: int) -> None:
        self.body.use_rows(rows)

    def expand_rows(self, factor: int) -> None:
        self.body.expand_rows(factor)

    def reorder_rows(self, index: np.ndarray) -> None:
        self.body.reorder_rows(index)

    def rewind(self, past_len: int) -> None:
        self.body.rewind(past_len)

    def compact(self, slots: np.ndarray) -> None:
        self.body.compact(slots)

    def row_tensors(self) -> list[np.ndarray]:
        return self.body.row_tensors()

    def load_row(self, tensors: list[np.ndarray]) -> None:
        self.body.load_row(tensors)
