"""The exported graph as a language model: OrtGraph (the loaded session, shared by threads) and OrtLM (one
generation's KV cache and IO binding on it); gpt2edge.runtime.model.pool.LMPool hands each call an OrtLM of its own.

Thread safety: ONNX Runtime's InferenceSession.run is thread-safe, an IOBinding and a KV cache are not. So
everything mutable lives in OrtLM, and concurrent generations each use their own OrtLM on one OrtGraph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnxruntime import IOBinding

from gpt2edge.errors import DeviceError, ModelFolderError
from gpt2edge.manifest import KEEP_INPUT
from gpt2edge.runtime.model.cache_rows import CacheRows
from gpt2edge.runtime.model.columns import Columns
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.head_check import check_cache_inputs, check_head, kept_ids
from gpt2edge.runtime.model.kv_cache import KVCache, SharedKVCache
from gpt2edge.runtime.model.ort_session import (
    ORT_DEVICE,
    create_session,
    host_rows_refusal,
    quiet_run_options,
    run_errors,
)

# shapes a tail head keeps bound at once: speculative verify steps take 2..17 positions (k <= 16), prefills any
MAX_SHAPE_BINDINGS = 32
TAIL_ROWS = 17  # positions a tail head's output buffer holds at least (k + 1 of speculative decoding's k <= 16)


class OrtGraph:
    """An export folder's graph loaded once: the InferenceSession, its dims and its input/output names.

    Never changed after construction, so any number of OrtLMs in any threads may share it.
    """

    def __init__(
        self, folder: ModelFolder, device: str = "cpu", threads: int | None = None, spin: bool = True,
        output: str = "logprobs", lean: bool = False,
    ) -> None:  # fmt: skip
        if folder.graph.static is not None:
            raise ModelFolderError(
                f"{folder.path} is a static-shape export (--static); load it with "
                "gpt2edge.runtime.open_model.load_graph (or Generator), which runs it with StaticLM."
            )
        if folder.info.raw.get("sparse_head") is not None and output == "logprobs":  # its graph returns `hidden`
            raise ModelFolderError(f"{folder.path} has a sparse head; load it with load_graph (or Generator).")
        self.output = output  # the first output: "logprobs", or "hidden" (a sparse-head body, runtime/sparse_head)
        self.folder, self.device = folder, device
        self.shared = folder.kv_cache == "shared"
        if self.shared and device != "cpu":
            raise DeviceError(
                f"{folder.path} uses the shared KV cache (the CPU fast path, tested on CPU only); for {device} "
                "export with --kv-cache concat."
            )
        self.session = create_session(
            folder.graph_path, device=device, threads=threads, model_format=folder.graph_format, spin=spin,
            lean=lean, precision=folder.precision, kleidiai=folder.kleidiai, cache=folder.graph_cache(),
        )  # fmt: skip
        d = folder.dims
        self.n_layer, self.n_head, self.head_dim = d["n_layer"], d["n_head"], d["head_dim"]
        self.vocab_size, self.n_positions = d["vocab_size"], d["n_positions"]
        self.run_options = quiet_run_options()
        names = [i.name for i in self.session.get_inputs()]
        self.past_names = [n for n in names if n.startswith("past_key_values.")]
        self.keeps = KEEP_INPUT in names  # --head tail: the graph returns the positions listed in that input
        check_cache_inputs(self.session, folder, self.past_names)  # before any cache is sized from the dims
        check_head(self.session, folder)  # the manifest's head decides how outputs are read (score, speculative)
        self.kept_ids = kept_ids(self.session, folder) if output == "logprobs" else None  # a trimmed head's K columns
        width = self.vocab_size if self.kept_ids is None else len(self.kept_ids)
        self.output_width = width if output == "logprobs" else folder.dims.n_embd  # "hidden": (B, n_embd)
        self.columns = None if self.kept_ids is None else Columns.of(self.kept_ids, self.vocab_size)
        self._full_vocab_steps = False  # private, parity tests: loops scatter to (B, V) first, as before K columns
        self.present_names = [o.name for o in self.session.get_outputs()[1:] if o.name.startswith("present")]
        self.kv_dtype = folder.kv_dtype
        # bool inputs: parts of the graph a caller may switch off (a sparse body's own certified step); fed True
        self.switches = [i.name for i in self.session.get_inputs() if i.type == "tensor(bool)"]

    batch = None  # any batch (a static graph fixes its own)
    approximate = None  # the model's own log-probs
    probe_refusal = None  # --deterministic probes its batched rows (row_invariance)

    @property
    def slot_refusal(self) -> str | None:
        """Why SlotLM cannot run this graph (None: it can)."""
        return host_rows_refusal(self.device)

    @property
    def supports_prefix_cache(self) -> bool:
        return self.device == "cpu"  # its rows' keys and values are host arrays

    def slot_view(self) -> SlotView:
        """SlotLM runs this graph as it is: its log-probs, no switches, no head after it."""
        return SlotView(self, "logprobs", {}, None)

    def new_lm(self, io_binding: bool = True) -> OrtLM:
        """A generation context of its own on this graph (LMPool's factory)."""
        return OrtLM(self, io_binding=io_binding)


@dataclass(frozen=True)
class SlotView:
    """What SlotLM (runtime/model/slots.py) runs for a graph: the OrtGraph of the blocks, the output it reads,
    the bool switches it feeds, and the head applied to that output (None: the output is the log-probs)."""

    graph: OrtGraph
    output: str
    switches: dict[str, np.ndarray]
    head: Callable[[np.ndarray], np.ndarray] | None


class OrtLM(CacheRows):
    """One generation at a time on a graph: forward(ids, mask, positions) -> next-token log-probs (B, V).

    The KV cache lives inside. The contract (generate loops, quality, beam search):
      start(batch, length)  reserve the cache for `batch` rows of at most `length` positions; past_len = 0.
      forward(ids (B, S), mask (B, past_len + S), positions (B, S)) -> (B, V) float32 log-probs of the token
                            after each row's last position; the S new positions join the cache (past_len += S).
                            Any B and S, with or without a past (see _forward_rows for the shared graph).
                            The result may be a buffer the next forward overwrites: copy it to keep it.
      past_len              positions held in the cache.
      forward(..., keep=n)  (B, n, V): the log-probs after each of the last n positions (a --head tail or all
                            graph; speculative decoding verifies n - 1 draft tokens in one step this way).
      rewind(past_len)      shared cache: forget the positions after past_len (rejected draft tokens).
      compact(slots)        concat cache: keep only those positions, moved to the front (one copy).
      forward_kept(...)     a vocabulary-trimmed head's own (B, K) columns (`columns` maps them to token ids).
    Not thread-safe: use one OrtLM per concurrent generation (LMPool), all on one OrtGraph.
    The cache's rows and positions (start, use_rows, expand_rows, reorder_rows, rewind, compact) are in
    gpt2edge.runtime.model.cache_rows.CacheRows; this class runs the graph.

    `graph` is a loaded OrtGraph to share, or a ModelFolder to load (with `device` and `threads`).
    """

    def __init__(
        self, graph: OrtGraph | ModelFolder, device: str = "cpu", threads: int | None = None, io_binding: bool = True
    ) -> None:
        g = OrtGraph(graph, device, threads) if isinstance(graph, ModelFolder) else graph
        self.graph, self.folder, self.device, self.session, self.shared = g, g.folder, g.device, g.session, g.shared
        self.n_layer, self.n_head, self.head_dim = g.n_layer, g.n_head, g.head_dim
        self.vocab_size, self.n_positions, self.kv_dtype = g.vocab_size, g.n_positions, g.kv_dtype
        self.past_names, self.present_names = g.past_names, g.present_names
        self.kept_ids, self.batch = g.kept_ids, None
        self.io_binding = io_binding
        self.switches = {n: np.array(True) for n in g.switches}  # bound by address: set in place to switch off
        cache_cls = SharedKVCache if self.shared else KVCache
        self.cache = cache_cls(self.n_layer, self.n_head, self.head_dim, self.kv_dtype, ORT_DEVICE[self.device])
        self.binding = self.session.io_binding() if io_binding else None
        self.past_len = 0
        self._presents: list[np.ndarray] = []  # only without IO binding
        self._logprobs = None  # pre-bound output buffer (head "last")
        self._inputs: dict[str, np.ndarray] = {}  # the int64 buffers bound as ids and positions
        self._mask = np.empty(0, dtype=np.int64)  # flat buffer the attention mask is bound from
        self._bound_seq = 0  # new positions per step of the current binding (shared-cache graphs reuse it)
        self._bound_keep = 0  # positions of log-probs the current binding returns (tail head)
        # a tail head on a shared cache keeps one binding per step shape (S, keep) while the cache buffers it
        # points at live (speculative verify steps change k nearly every step: re-binding cost ~0.1 ms a step)
        self._per_shape = self.shared and g.keeps and io_binding
        self._shape_bindings: dict[tuple[int, int], tuple[IOBinding, dict[str, np.ndarray], np.ndarray]] = {}
        self._shapes_cache: tuple[int, int] = (-1, 0)  # the cache (allocation, rows) they were bound to
        self._tail = np.empty(0, dtype=np.float32)  # flat buffer a tail head's (B, keep, V) output is bound to

    @property
    def columns(self) -> Columns | None:
        """How forward_kept's columns map to token ids; None when they are the full vocabulary (untrimmed)."""
        return None if self.graph._full_vocab_steps else self.graph.columns

    def configure_head(self, params, logprobs: bool = False) -> None:
        """Nothing to configure: every step runs the graph's own head (runtime/model/contract.py's LM)."""

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, keep: int | None = None
    ) -> np.ndarray:
        """(B, S) ids, (B, past+S) mask, (B, S) positions -> (B, V) float32 log-probs of the next token over the
        full vocabulary, or with `keep` = n, (B, n, V): the log-probs after each of the last n positions. A trimmed
        head's dropped ids get -inf (a new array), so callers index by full token id; the generate loops use
        forward_kept instead."""
        with run_errors(self.folder.graph_path):
            lp = self._forward_graph(input_ids, attention_mask, position_ids, keep)
        return lp if self.kept_ids is None else self.to_full_vocab(lp)

    def forward_kept(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """forward() without the scatter: (B, K) log-probs of a trimmed head's kept ids, column j scoring token
        columns.ids[j] (when `columns` is None, the (B, V) forward() gives)."""
        if self.columns is None:
            return self.forward(input_ids, attention_mask, position_ids)
        with run_errors(self.folder.graph_path):
            return self._forward_graph(input_ids, attention_mask, position_ids)

    def to_full_vocab(self, lp: np.ndarray) -> np.ndarray:
        """(..., K) log-probs of a trimmed head's kept ids -> a new (..., V) array, -inf elsewhere."""
        return self.graph.columns.full(lp)  # V floats per row: ~0.05 ms at V = 50,257, which forward_kept saves

    def _forward_graph(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, keep: int | None = None
    ) -> np.ndarray:
        """forward() before the trimmed head's mapping: (B, V) log-probs ((B, K) for a trimmed head)."""
        B, S = input_ids.shape
        n = self._check_keep(keep, S)
        if self.runs_by_row(B, S):
            if keep is not None:
                raise ValueError("keep= runs one row at a time on a shared-cache graph with a past")
            return self._forward_rows(input_ids, attention_mask, position_ids)
        if not self.io_binding:
            feed = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
            if self.graph.keeps:
                feed[KEEP_INPUT] = np.arange(S - n, S, dtype=np.int64)
            feed.update(zip(self.past_names, self.cache.tensors(self.past_len) if self.shared else self._presents))
            feed.update(self.switches)
            out = self.session.run([self.graph.output, *self.present_names], feed, self.graph.run_options)
            if self.shared:
                self.cache.write(out[1:], self.past_len)
            else:
                self._presents = out[1:]
            self.past_len += S
            return _rows(out[0], keep)

        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        if self.graph.keeps:
            inputs[KEEP_INPUT] = np.arange(S - n, S, dtype=np.int64)
        if self._per_shape and (S, n) != (self._bound_seq, self._bound_keep):
            self._switch_binding(S, n)
        if self.shared and S == self._bound_seq and n == self._bound_keep:
            # decode steps of a shared-cache graph bind the same buffers: refresh ids and positions in place
            # (ORT reads them at run time) instead of re-binding ~4 x n_layer tensors per step
            for name, arr in inputs.items():
                self._inputs[name][...] = arr
        else:
            self._bind_step(inputs, S, n)
            self._bound_seq = S if self.shared else 0
            self._bound_keep = n
            if self._per_shape:
                self._shape_bindings[S, n] = (self.binding, self._inputs, self._logprobs)
        b = self.binding
        self._bind_mask(attention_mask)  # the one input whose shape grows every step
        self.session.run_with_iobinding(b, self.graph.run_options)
        self.cache.after_step(self.past_len, S)
        self.past_len += S
        lp = self._logprobs
        if lp is None:
            return _rows(b.get_outputs()[0].numpy(), keep)
        # on CUDA only this (B, V) tensor crosses to the host each step; the cache stays on the device
        return _rows(lp if self.device == "cpu" else lp.numpy(), keep)

    def _switch_binding(self, S: int, n: int) -> None:
        """A tail head's step of another shape: the binding an earlier step of (S, n) left, when it still points
        at this cache's buffers, or a new binding for _bind_step to fill (the other shapes' stay as they are)."""
        owner = (self.cache.allocations, self.cache.rows)
        if owner != self._shapes_cache or len(self._shape_bindings) >= MAX_SHAPE_BINDINGS:
            self._shape_bindings.clear()  # new buffers or rows; or prefills of many lengths: start afresh
            self._shapes_cache = owner
        kept = self._shape_bindings.get((S, n))
        if kept is None:
            self.binding = self.session.io_binding()
            self._bound_seq = 0
        else:
            self.binding, self._inputs, self._logprobs = kept
            self._bound_seq, self._bound_keep = S, n

    def runs_by_row(self, B: int, S: int) -> bool:
        """Whether a step of B rows of S tokens runs row by row (_forward_rows), each on a binding of its own."""
        return self.shared and B > 1 and S > 1 and self.past_len > 0

    def _check_keep(self, keep: int | None, S: int) -> int:
        """How many positions' log-probs this step returns (1 without keep); a last-position head has one."""
        if keep is None:
            return 1
        if not 1 <= keep <= S:
            raise ValueError(f"keep must be 1..{S} for a step of {S} tokens, got {keep}")
        if keep > 1 and self.folder.head == "last":
            raise ModelFolderError(
                f"{self.folder.path} returns log-probs at the last position only; export it with --head tail "
                "(or --head all) for log-probs at several positions of a step."
            )
        return keep

    def _forward_rows(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """The shared graph's GroupQueryAttention refuses batch > 1 with seq > 1 on a past, so such a step runs
        row by row: row b's slice of each (B, nh, capacity, hs) cache buffer is itself a contiguous
        (1, nh, capacity, hs) tensor, which the graph reads and writes in place as a batch of one."""
        B, S = input_ids.shape
        width = self.graph.output_width  # the graph's log-prob columns
        out = np.empty((B, width), dtype=np.float32)
        for r in range(B):
            step = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
            feed = {name: np.ascontiguousarray(a[r : r + 1], dtype=np.int64) for name, a in step.items()}
            if self.graph.keeps:
                feed[KEEP_INPUT] = np.array([S - 1], dtype=np.int64)
            feed.update(self.switches)
            cache = self.cache.row(r)  # (1, nh, capacity, hs) views, one per past/present name
            if self.io_binding:
                b = self.session.io_binding()
                for name, arr in feed.items():
                    b.bind_input(name, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)
                b.bind_output(self.graph.output, "cpu")
                for past, present, view in zip(self.past_names, self.present_names, cache):
                    b.bind_input(past, "cpu", 0, view.dtype.type, list(view.shape), view.ctypes.data)
                    b.bind_output(present, "cpu", 0, view.dtype.type, list(view.shape), view.ctypes.data)
                self.session.run_with_iobinding(b, self.graph.run_options)
                lp = b.get_outputs()[0].numpy()
            else:
                past = dict(zip(self.past_names, cache))
                lp, *presents = self.session.run(None, {**feed, **past}, self.graph.run_options)  # zip: presents only
                for view, present in zip(cache, presents):
                    view[...] = present
            out[r] = lp[0] if lp.ndim == 2 else lp[0, -1]
        self.past_len += S
        return out

    def _bind_mask(self, mask: np.ndarray) -> None:
        """Copy the (B, T) mask into the front of the flat buffer and bind it there, by pointer."""
        view = self._mask[: mask.size].reshape(mask.shape)
        view[...] = mask
        self.binding.bind_input("attention_mask", "cpu", 0, np.int64, list(mask.shape), view.ctypes.data)

    def _bind_step(self, inputs: dict[str, np.ndarray], S: int, keep: int = 1) -> None:
        """Bind ids and positions (our own int64 buffers, by pointer), logprobs and the cache for a step of
        S tokens (`keep` positions of log-probs from a tail head)."""
        b = self.binding
        self._inputs = {name: np.array(arr, dtype=np.int64, order="C") for name, arr in inputs.items()}
        for name, arr in (*self._inputs.items(), *self.switches.items()):
            b.bind_input(name, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)
        # outputs come back in binding order: logprobs first, then the presents
        lp = self._logprobs
        B = len(self._inputs["input_ids"])
        if self.graph.keeps and self.device == "cpu":  # tail head: (B, keep, V) into our own flat buffer
            width = self.graph.output_width  # V, or a sparse-head body's hidden width
            size = B * keep * width
            if self._tail.size < size:  # room for TAIL_ROWS positions of a row at least: a changing k allocates once
                self._tail = np.empty(max(size, TAIL_ROWS * width), dtype=np.float32)
                self._shape_bindings.clear()  # they write into the buffer replaced here
            self._logprobs = lp = self._tail[:size].reshape(B, keep, width)
            b.bind_output(self.graph.output, "cpu", 0, np.float32, list(lp.shape), lp.ctypes.data)
        elif lp is None:  # head "all" (B, S, V), or a tail head on CUDA: the shape varies, ORT allocates it
            b.bind_output(self.graph.output, ORT_DEVICE[self.device])
        elif self.device == "cpu":
            b.bind_output(self.graph.output, "cpu", 0, np.float32, list(lp.shape), lp.ctypes.data)
        else:
            b.bind_ortvalue_output(self.graph.output, lp)
        self.cache.bind(b, self.past_names, self.present_names, self.past_len, S)


def _rows(lp: np.ndarray, keep: int | None) -> np.ndarray:
    """A step's (B, V), (B, S, V) or (B, keep, V) log-probs -> (B, V) of the last position, or (B, keep, V)."""
    if keep is None:
        return lp if lp.ndim == 2 else lp[:, -1]
    return lp[:, -keep:]
