"""SoloRows: SlotLM's join/step/free contract with every row computed alone (the server's --deterministic mode).

A batched step is not row-independent in ONNX Runtime on the CPU (benchmarks/determinism.py measures it):
  fp32   batch-size invariant, but the attention's reductions over the key axis (Softmax, attn x V) depend on
         where a row's keys start among the SIMD lanes, i.e. on the left pad SlotLM's shared length gives it;
  int8   DynamicQuantizeMatMul quantizes the activations with one scale for the whole batch (0.1 nats apart);
  int4   MatMulNBits (accuracy level 4) can compute one row (M = 1) differently from several (shape-dependent).
Where a load-time probe finds batched rows exact at aligned left pads (runtime/model/row_invariance.py) the
server batches them so (serve/scheduling/grouping.py); elsewhere a row that must not depend on the traffic runs
as it would alone: each row is an OrtLM of its own (one reserved cache row, no padding), prefilled alone and
stepped alone (B = 1) -- exactly what Generator.generate runs for that one prompt, at every precision and on
both graph kinds. The price is the batching: a step of k rows is k
runs (benchmarks/README.md, "Rows that do not depend on the traffic").

Same interface as gpt2edge.runtime.model.slots.SlotLM for the continuous scheduler: live rows are packed at the
front and freeing a row moves the last one into its place (here the OrtLM object moves: no copy).
"""

from __future__ import annotations

import time

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.decoding.generate import decode_one_token, prefill
from gpt2edge.runtime.model.contract import LM, Graph


class SoloRows:
    """`rows` one-row generation contexts on a Graph (its new_lm(): an OrtLM, a sparse head's LM); a Rows of
    runtime/model/contract.py."""

    def __init__(self, graph: Graph, rows: int) -> None:
        if rows < 1:
            raise GenerationError(f"SoloRows needs at least 1 row, got {rows}.")
        self.graph, self.rows = graph, rows
        self.n_positions = int(graph.n_positions)
        self.columns = graph.columns  # a vocabulary-trimmed head's columns (None: the full vocabulary)
        self._lms: list[LM] = []  # one OrtLM per cache row, made on first use and kept (its cache buffers reused)
        self.lengths = np.zeros(rows, dtype=np.int64)  # tokens each live row holds (its next position id)
        self.live = 0
        self.relayouts = 0  # never: rows do not share a length (kept for the scheduler's stats)
        self.slots_read = self.slots_used = 0
        self.seconds = {"prefill": 0.0, "join_copy": 0.0, "relayout": 0.0, "step": 0.0}

    @property
    def free_rows(self) -> int:
        return self.rows - self.live

    @property
    def past_len(self) -> int:
        """The longest live row's length (rows share no length: each is read at its own)."""
        return int(self.lengths[: self.live].max(initial=0))

    def row_kv(self, i: int) -> list[np.ndarray]:
        """Live row i's (nh, length, hs) keys and values per tensor: its own one-row cache (views)."""
        if not 0 <= i < self.live:
            raise ValueError(f"row {i} is not live (rows 0..{self.live - 1} are)")
        return self._lms[i].row_tensors()

    def reserve(self, positions: int) -> None:
        """Nothing to touch ahead: each row's cache is reserved for the whole context at its first join."""

    def _lm(self, i: int) -> LM:
        while len(self._lms) <= i:
            self._lms.append(self.graph.new_lm())
        return self._lms[i]

    def join(self, prompts: list[list[int]], pad_id: int, prefixes: list | None = None) -> np.ndarray:
        """Prefill each prompt alone into free rows live .. live+n-1; returns their (n, W) next-token log-probs.
        `prefixes` (SlotLM.join's cached prefixes) must be None: a row computed alone reuses no other's keys."""
        if prefixes is not None and any(prefixes):
            raise GenerationError("Rows computed alone (--deterministic) take no cached prefix.")
        n = len(prompts)
        if n > self.free_rows:
            raise GenerationError(f"{n} rows asked for, {self.free_rows} free.")
        out = None
        t0 = time.perf_counter()
        for j, p in enumerate(prompts):
            if len(p) >= self.n_positions:
                raise GenerationError(f"A row needs {len(p) + 1} positions; the model has {self.n_positions}.")
            lm = self._lm(self.live + j)
            lm.start(1, self.n_positions)  # reuses the row's buffers after its first request
            ids = np.asarray([p], dtype=np.int64)
            lp = prefill(lm, ids, np.ones_like(ids))
            if out is None:
                out = np.empty((n, lp.shape[-1]), dtype=np.float32)
            out[j] = lp[0]
            self.lengths[self.live + j] = len(p)
        self.seconds["prefill"] += time.perf_counter() - t0
        self.live += n
        return out

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token to each live row (in row order), each alone; returns (live, W) next-token log-probs."""
        k = self.live
        if len(tokens) != k or k == 0:
            raise ValueError(f"step needs one token per live row ({k}), got {len(tokens)}")
        if int(self.lengths[:k].max()) + 1 > self.n_positions:
            raise GenerationError(f"A row needs {int(self.lengths[:k].max()) + 1} positions; the model has "
                                  f"{self.n_positions}.")  # fmt: skip
        out = None
        t0 = time.perf_counter()
        for i in range(k):
            L = int(self.lengths[i])
            mask = np.ones((1, L + 1), dtype=np.int64)
            lp = decode_one_token(self._lms[i], np.array([tokens[i]], dtype=np.int64), mask, np.array([L]))
            if out is None:
                out = np.empty((k, lp.shape[-1]), dtype=np.float32)
            out[i] = lp[0]
        self.seconds["step"] += time.perf_counter() - t0
        used = int(self.lengths[:k].sum()) + k
        self.slots_read += used  # no masked slots: each row reads its own positions only
        self.slots_used += used
        self.lengths[:k] += 1
        return out

    def free(self, i: int) -> int | None:
        """Free row i; the last live row's context moves into it. Returns that row's old index (None when last)."""
        last = self.live - 1
        if not 0 <= i <= last:
            raise ValueError(f"row {i} is not live (rows 0..{last} are)")
        moved = None
        if i != last:
            self._lms[i], self._lms[last] = self._lms[last], self._lms[i]
            self.lengths[i] = self.lengths[last]
            moved = last
        self.lengths[last] = 0
        self.live = last
        return moved
