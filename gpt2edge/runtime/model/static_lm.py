"""Static-shape export folders (`gpt2edge export --static`) on ONNX Runtime: StaticGraph (the prefill and
decode sessions, loaded once, shared by threads) and StaticLM (one generation's cache, mask and IO binding on
them), with OrtLM's contract (start / forward / past_len / n_positions), so the ordinary generation loop,
LMPool, Conversation, score and bench run them unchanged.

A forward of S tokens is fed as ceil(S / C) calls of the prefill graph (chunk C; the last chunk padded at its
end, its pad slots left unmarked in the mask) or, for one token, one call of the decode graph. Rows past the
caller's batch are padding rows (mask all 0) whose outputs are dropped. The cache is a pair of fixed
(B, nh, N, hs) buffer sets: each call reads one set and writes the other (ping-pong), bound once by pointer,
so a step allocates nothing and binds nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.manifest import resolve_inside
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.ort_session import create_session, host_rows_refusal

_FIRST_PAST = 4  # input_ids, attention_mask, position_ids, cache_position, then the cache
FIXED = "a --static folder has fixed batch and cache shapes"
# what the row methods of runtime/model/contract.py's LM say here (request.py refuses such calls before any work)
FIXED_ROWS = f"{FIXED}: its cache rows cannot be expanded, reordered, rolled back or saved; use a dynamic export."


class StaticGraph:
    """The two sessions of a static folder and the shapes they fix; never changed after construction."""

    def __init__(
        self,
        prefill: Path,
        decode: Path | None = None,
        device: str = "cpu",
        threads: int | None = None,
        folder: ModelFolder | None = None,
        lean: bool = False,
    ) -> None:
        self.folder, self.device = folder, device
        lean_args = {"lean": lean, "precision": folder.precision if folder is not None else None}
        lean_args["kleidiai"] = folder is None or folder.kleidiai  # the recipe's kernels (ort_session.kleidiai_off)
        self.prefill = create_session(prefill, device=device, threads=threads, **lean_args)
        same = decode is None or Path(decode) == Path(prefill)
        self.decode = self.prefill if same else create_session(decode, device=device, threads=threads, **lean_args)
        where = folder.path if folder is not None else prefill
        shapes = {i.name: i.shape for i in self.prefill.get_inputs()}
        if any(not isinstance(d, int) for s in shapes.values() for d in s):
            raise ModelFolderError(f"{where}: the prefill graph has symbolic dimensions; export it with --static.")
        self.batch, self.chunk = shapes["input_ids"]  # (B, C)
        self.n_positions = shapes["attention_mask"][1]  # the cache capacity N bounds prompt + new tokens
        self.past_names = [i.name for i in self.prefill.get_inputs()][_FIRST_PAST:]
        self.present_names = [o.name for o in self.prefill.get_outputs()][1:]
        self.cache_shape = tuple(shapes[self.past_names[0]])  # (B, nh, N, hs)
        _, self.n_head, _, self.head_dim = self.cache_shape
        self.n_layer = len(self.past_names) // 2
        self.vocab_size = self.prefill.get_outputs()[0].shape[1]
        self.kv_dtype = np.float16 if "float16" in self.prefill.get_inputs()[_FIRST_PAST].type else np.float32
        self.kept_ids = None  # a static folder is never vocabulary-trimmed (trim-vocab refuses it)
        self.shared = False
        decode_ids = {i.name: i.shape for i in self.decode.get_inputs()}["input_ids"]
        if decode_ids != [self.batch, 1 if self.decode is not self.prefill else self.chunk]:
            raise ModelFolderError(f"{where}: the decode graph does not take ({self.batch}, 1) ids; re-export.")

    @classmethod
    def from_folder(
        cls, folder: ModelFolder, device: str = "cpu", threads: int | None = None, lean: bool = False
    ) -> StaticGraph:
        """Load a static folder's graphs (named by its manifest) and check them against the manifest."""
        s = folder.graph.static
        if s is None:
            raise ModelFolderError(f"{folder.path} is not a static-shape export (no graph.static in its manifest).")
        prefill = resolve_inside(folder.path, s.prefill_file)
        decode = resolve_inside(folder.path, s.decode_file)
        g = cls(prefill, decode, device=device, threads=threads, folder=folder, lean=lean)
        d = folder.dims
        got = (g.batch, g.chunk, g.n_positions, g.n_layer, g.vocab_size)
        if got != (s.batch, s.chunk, s.capacity, d.n_layer, d.vocab_size):
            raise ModelFolderError(f"{folder.path}: its graphs do not match the manifest's static shapes; re-export.")
        return g

    approximate = None  # the model's own log-probs
    columns = None  # never vocabulary-trimmed
    supports_prefix_cache = False  # its cache is the fixed (B, nh, N, hs) pair, not rows to keep
    probe_refusal = "not probed on this graph kind"

    @property
    def slot_refusal(self) -> str:
        """Why SlotLM cannot run this graph: its rows and positions are fixed (and on CPU memory only)."""
        return host_rows_refusal(self.device) or FIXED

    def slot_view(self):
        raise GenerationError(f"Cache rows that join and leave cannot run this folder: {self.slot_refusal}.")

    def new_lm(self, io_binding: bool = True) -> StaticLM:
        return StaticLM(self, io_binding=io_binding)


class StaticLM:
    """One generation at a time on a StaticGraph (OrtLM's contract; not thread-safe, one per generation).

    `graph` is a StaticGraph to share, or a prefill graph path (with `decode`: the decode graph's)."""

    def __init__(
        self,
        graph: StaticGraph | Path,
        decode: Path | None = None,
        threads: int | None = None,
        io_binding: bool = True,
    ) -> None:
        g = StaticGraph(Path(graph), decode, threads=threads) if isinstance(graph, (str, os.PathLike)) else graph
        self.graph, self.folder, self.device = g, g.folder, g.device
        self.batch, self.chunk, self.n_positions = g.batch, g.chunk, g.n_positions
        self.n_layer, self.n_head, self.head_dim = g.n_layer, g.n_head, g.head_dim
        self.vocab_size, self.kv_dtype, self.kept_ids, self.shared = g.vocab_size, g.kv_dtype, None, False
        self.columns = None
        self.past_names, self.present_names = g.past_names, g.present_names
        # IO binding by pointer on CPU; other devices run plainly (a static graph is for NPUs, CUDA only checks it)
        self.io_binding = io_binding and g.device == "cpu"
        self.past_len = 0
        self.rows = 0
        self.mask = np.zeros((self.batch, self.n_positions), np.int64)  # (B, N): slots holding real tokens
        self._cache: np.ndarray | None = None  # (2, 2L, B, nh, N, hs): the two buffer sets
        self._src = 0  # the set holding the current cache
        self._inputs = {}  # chunk -> (ids (B, c), positions (B, c), cache_position (c,)) buffers
        self._logprobs = np.empty((self.batch, self.vocab_size), np.float32)  # (B, V), bound as the output
        self._bindings = {}  # (chunk, src) -> IOBinding

    def start(self, batch: int, length: int) -> None:
        """A cleared cache and mask for a generation of `batch` rows and at most `length` positions."""
        if batch > self.batch:
            raise GenerationError(
                f"This static graph runs batches of at most {self.batch} rows, got {batch}; pass fewer prompts "
                "or export with a larger --static batch."
            )
        if length > self.n_positions:
            raise GenerationError(
                f"This static graph's cache holds {self.n_positions} positions, {length} needed; shorten the "
                "prompt or max_new_tokens, or export with a larger --static capacity."
            )
        self.rows, self.past_len = batch, 0
        self.mask[...] = 0
        if self._cache is None:
            self._cache = np.zeros((2, len(self.past_names), *self.graph.cache_shape), self.kv_dtype)
        else:
            # every slot is read (masked ones with weight 0): zeroed so nothing of an earlier run (a NaN) leaks
            self._cache[self._src] = 0

    supports_row_state = False  # the cache is a fixed ping-pong pair: no row to save or load

    def configure_head(self, params, logprobs: bool = False) -> None:
        """Nothing to configure: every step runs the graph's own head."""

    def _fixed_rows(self, *_: object) -> None:
        raise GenerationError(FIXED_ROWS)

    # beam rows, several samples per prompt, speculative rollback and session files: refused in one line
    use_rows = expand_rows = reorder_rows = rewind = compact = row_tensors = load_row = _fixed_rows

    def forward_kept(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """forward(): the columns are the full vocabulary."""
        return self.forward(input_ids, attention_mask, position_ids)

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, keep: int | None = None
    ) -> np.ndarray:
        """(b, S) ids, (b, past+S) mask, (b, S) positions -> (b, V) log-probs after the last token (a view of
        a buffer the next forward overwrites); keep=1 gives (b, 1, V) (the graph returns the last position only)."""
        if keep is not None and keep != 1:
            raise ModelFolderError(
                f"{self.folder.path if self.folder is not None else 'this static graph'} returns log-probs at the "
                "last position only; a static export takes keep=1 at most."
            )
        lp = self._forward(input_ids, attention_mask, position_ids)
        return lp if keep is None else lp[:, None]

    def _forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        b, S = input_ids.shape
        P = self.past_len
        if P + S > self.n_positions or b > self.rows:
            raise GenerationError(
                f"A step of {b} x {S} tokens after {P} does not fit the static graph started for {self.rows} rows "
                f"and {self.n_positions} positions."
            )
        self.mask[:b, : P + S] = attention_mask
        C = 1 if S == 1 else self.chunk  # one token: the decode graph
        for start in range(0, S, C):
            n = min(C, S - start)
            ids, pos, slots = self._chunk_inputs(C)
            ids[...] = 0  # pads: token 0 at position 0, in slots the mask leaves unmarked
            pos[...] = 0
            ids[:b, :n] = input_ids[:, start : start + n]
            pos[:b, :n] = position_ids[:, start : start + n]
            slots[...] = np.arange(P + start, P + start + C)
            self._run(C)
        self.past_len += S
        return self._logprobs[:b]

    def cache(self) -> list[np.ndarray]:
        """The current cache, one (B, nh, N, hs) array per past name (views; validation reads them)."""
        return list(self._cache[self._src])

    def _chunk_inputs(self, C: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if C not in self._inputs:
            z = np.zeros((self.batch, C), np.int64)
            self._inputs[C] = (z, z.copy(), np.zeros(C, np.int64))
        return self._inputs[C]

    def _run(self, C: int) -> None:
        """One call of the graph of chunk C: reads cache set src, writes the other, then swaps."""
        session = self.graph.decode if C == 1 and self.chunk > 1 else self.graph.prefill
        ids, pos, slots = self._inputs[C]
        src, dst = self._cache[self._src], self._cache[1 - self._src]
        if self.io_binding:
            session.run_with_iobinding(self._binding(session, C))
        else:
            feed = {"input_ids": ids, "attention_mask": self.mask, "position_ids": pos, "cache_position": slots}
            lp, *presents = session.run(None, {**feed, **dict(zip(self.past_names, src))})
            self._logprobs[...] = lp
            dst[...] = np.stack(presents)
        self._src = 1 - self._src

    def _binding(self, session, C: int):
        """The IOBinding of (chunk C, current src), made once: ORT reads the bound buffers at each run."""
        key = (C, self._src)
        if key not in self._bindings:
            b = session.io_binding()
            ids, pos, slots = self._inputs[C]
            for name, arr in (("input_ids", ids), ("attention_mask", self.mask), ("position_ids", pos)):
                b.bind_input(name, "cpu", 0, np.int64, list(arr.shape), arr.ctypes.data)
            b.bind_input("cache_position", "cpu", 0, np.int64, list(slots.shape), slots.ctypes.data)
            b.bind_output("logprobs", "cpu", 0, np.float32, list(self._logprobs.shape), self._logprobs.ctypes.data)
            t, shape = self._cache.dtype.type, list(self.graph.cache_shape)
            src, dst = self._cache[self._src], self._cache[1 - self._src]
            for past, present, s, d in zip(self.past_names, self.present_names, src, dst):
                b.bind_input(past, "cpu", 0, t, shape, s.ctypes.data)
                b.bind_output(present, "cpu", 0, t, shape, d.ctypes.data)
            self._bindings[key] = b
        return self._bindings[key]
