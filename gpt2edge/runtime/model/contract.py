"""The model contract in code: what decoding, the pool and the server's scheduler rely on from a loaded graph
(Graph), from one generation's context on it (LM) and from the cache rows continuous batching runs (Rows).

The kinds: OrtGraph / OrtLM (runtime/model/lm.py), StaticGraph / StaticLM (static_lm.py), SparseGraph / SparseLM
and ApproxGraph / ApproxLM (runtime/sparse_head); SlotLM (slots.py) and SoloRows (solo_rows.py) are Rows. A kind
that lacks a capability says so with a member (slot_refusal, supports_prefix_cache, supports_row_state, batch),
so callers read that member instead of probing the kind (tests/house/test_layout.py refuses isinstance on the kinds and
getattr with a default outside the one factory that opens a folder, gpt2edge.runtime.open_model;
tests/runtime/test_contract.py checks each kind against its Protocol).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from gpt2edge.runtime.model.columns import Columns
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.model.lm import SlotView


@runtime_checkable
class Graph(Protocol):
    """A folder's graph loaded once, shared by threads; never changed after construction."""

    folder: ModelFolder | None
    device: str  # "cpu" or "cuda"
    n_layer: int
    n_head: int
    head_dim: int
    n_positions: int  # positions a generation may use (a static graph's cache capacity)
    vocab_size: int
    kv_dtype: Any  # the cache's numpy dtype (or its name)
    past_names: list[str]  # the graph's KV-cache inputs, 2 x n_layer

    @property
    def kept_ids(self) -> np.ndarray | None:
        """A vocabulary-trimmed head's kept token ids (None: the full vocabulary)."""

    @property
    def columns(self) -> Columns | None:
        """How a trimmed head's columns map to token ids (None: column j is token j)."""

    @property
    def batch(self) -> int | None:
        """A static graph's fixed rows (its cache is allocated for them); None: any batch."""

    @property
    def approximate(self) -> dict[str, Any] | None:
        """An approximate head's description (its rows are not the model's log-probs); None: the model's own."""

    @property
    def slot_refusal(self) -> str | None:
        """Why cache rows that join and leave (SlotLM) cannot run this graph; None: they can (slot_view)."""

    @property
    def probe_refusal(self) -> str | None:
        """Why --deterministic's row-alignment probe (row_invariance) is not run on this graph; None: it is."""

    @property
    def supports_prefix_cache(self) -> bool:
        """Whether Generator(prefix_cache_bytes=N) can keep this graph's KV rows (a dynamic graph on CPU)."""

    def new_lm(self, io_binding: bool = True) -> LM:
        """A generation context of its own on this graph (LMPool's factory)."""

    def slot_view(self) -> SlotView:
        """What SlotLM runs: the OrtGraph of the blocks, the output it reads, the switches it feeds and the head it
        applies (only when slot_refusal is None)."""


@runtime_checkable
class LM(Protocol):
    """One generation at a time on a Graph (not thread-safe): a KV cache and the graph's runs on it.

    start(batch, length) reserves the cache; forward(ids (B, S), mask (B, past_len + S), positions (B, S)) returns
    (B, V) log-probs of the next token (or, with keep=n, (B, n, V)) and the S positions join the cache;
    forward_kept is forward on a trimmed head's own (B, K) columns. The row methods serve beam search, several
    samples per prompt and speculative decoding; a static LM (batch not None) refuses them in one line.
    """

    graph: Graph
    folder: ModelFolder | None
    device: str
    n_layer: int
    n_head: int
    head_dim: int
    n_positions: int
    vocab_size: int
    kv_dtype: Any
    past_names: list[str]
    shared: bool  # the shared KV cache (rewind drops positions; else compact)

    @property
    def past_len(self) -> int:
        """Positions held in the cache."""

    @property
    def kept_ids(self) -> np.ndarray | None: ...

    @property
    def columns(self) -> Columns | None: ...

    @property
    def batch(self) -> int | None:
        """A static graph's fixed rows; None: any batch, and the row methods below work."""

    @property
    def supports_row_state(self) -> bool:
        """Whether row_tensors() / load_row() move a one-row cache out and in (a CPU OrtLM): what session files
        and the prefix cache need."""

    def start(self, batch: int, length: int) -> None: ...

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, keep: int | None = None
    ) -> np.ndarray: ...

    def forward_kept(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray
    ) -> np.ndarray: ...

    def configure_head(self, params: Any, logprobs: bool = False) -> dict[str, Any] | None:
        """A generate loop's call after start(), given its decoding SamplingParams (untyped here: model/ names
        nothing of decoding/, not even for a type): a sparse head serves the steps this call allows, an approximate one
        refuses recorded log-probs and returns its description for the result; the others return None."""

    def use_rows(self, rows: int) -> None: ...

    def expand_rows(self, factor: int) -> None: ...

    def reorder_rows(self, index: np.ndarray) -> None: ...

    def rewind(self, past_len: int) -> None: ...

    def compact(self, slots: np.ndarray) -> None: ...

    def row_tensors(self) -> list[np.ndarray]: ...

    def load_row(self, tensors: list[np.ndarray]) -> None: ...


@runtime_checkable
class Rows(Protocol):
    """Cache rows that sequences join and leave between decode steps (the continuous scheduler's): live rows are
    packed at the front, and freeing a row moves the last live one into its place."""

    rows: int
    live: int
    lengths: np.ndarray  # tokens each row holds (its next position id)
    n_positions: int
    relayouts: int
    slots_read: int
    slots_used: int
    seconds: dict[str, float]

    @property
    def columns(self) -> Columns | None: ...

    @property
    def free_rows(self) -> int: ...

    @property
    def past_len(self) -> int:
        """The length every live row's cache is read at (rows computed alone: the longest row's)."""

    @property
    def graph(self) -> Graph:
        """The graph whose KV tensors the rows hold (a PrefixCache is shaped by it)."""

    def reserve(self, positions: int) -> None: ...

    def join(self, prompts: list[list[int]], pad_id: int, prefixes: list | None = None) -> np.ndarray: ...

    def step(self, tokens: np.ndarray) -> np.ndarray: ...

    def free(self, i: int) -> int | None: ...

    def row_kv(self, i: int) -> list[np.ndarray]:
        """Live row i's (nh, length, hs) keys and values per tensor (views: copy to keep them)."""
