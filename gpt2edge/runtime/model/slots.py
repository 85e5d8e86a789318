"""SlotLM: KV-cache rows that sequences join and leave between decode steps (continuous batching).

The graphs take one attention-mask length for the whole batch, so every row shares one physical length P: row i
holds its `length` tokens right-aligned in slots P - length .. P - 1, the slots before them masked out (as left
padding is). Live rows are packed at the front (0 .. live-1), so a decode step binds exactly the live rows, and
freeing a row moves the last live row into its place (one copy of that row's own positions).

join(prompts): the newcomers are prefilled together with an empty past (left-padded: one batched run, on either
graph kind; the shared-cache graph's batched prefill *with* a past would run row by row), and their keys and
values are copied into free rows at slots P - L .. P - 1 (benchmarks/slot_join.py times this against the
shared graph's other correct way, each newcomer prefilled alone in place on its row: benchmarks/README.md). A
newcomer longer than P shifts the running rows right first.

Rows are allocated once (`rows` of them); positions grow on demand up to the graph's n_positions, and when the
shared length P runs ahead of the longest row (finished long rows leave short ones behind, every decode step
reading the masked slots for nothing) the rows are re-packed to the longest row's length.

Both cache layouts of gpt2edge.runtime.model.kv_cache: concat (ping-pong flat buffers, a (k, nh, P, hs) prefix is the
past) and shared (one (R, nh, capacity, hs) buffer per tensor, bound as past and present). CPU only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.manifest import KEEP_INPUT
from gpt2edge.runtime.model.lm import OrtGraph
from gpt2edge.runtime.model.ort_session import run_errors
from gpt2edge.runtime.model.positions import left_pad, position_ids_from_mask
from gpt2edge.runtime.model.slot_prefix import prefill_rows

if TYPE_CHECKING:  # annotations only
    from gpt2edge.runtime.model.contract import Graph

MIN_POSITIONS = 64  # the first allocation's positions per row; doubled as rows grow
# re-pack once P exceeds the longest row by this many slots and by an eighth of P: a re-pack copies every live row
# once, while the masked slots are read by every step until then (at 16 rows, GPT-2 small int8, letting P run up
# to a quarter past the longest row read 1.4x the slots and cost 4-20 % of the decode steps: benchmarks/README.md)
REPACK_WASTE = 8
REPACK_SHARE = 8


class SlotLM:
    """`rows` cache rows on a Graph whose slot_refusal is None: an OrtGraph as it is, or a sparse-head folder's body
    graph under its full head (its slot_view) (not thread-safe: one owner, e.g. the server's scheduler thread)."""

    def __init__(self, graph: Graph, rows: int) -> None:
        why = graph.slot_refusal
        if why is not None:
            raise GenerationError(f"Cache rows that join and leave cannot run this folder: {why}.")
        if rows < 1:
            raise GenerationError(f"SlotLM needs at least 1 row, got {rows}.")
        # the graph of the blocks, what it reads and feeds, and the head after it (a sparse head's full head)
        view = graph.slot_view()
        self.output, self.switches, self.head = view.output, view.switches, view.head
        self.graph: OrtGraph = view.graph
        graph = view.graph
        self.rows, self.shared = rows, graph.shared
        self.n_positions = int(graph.n_positions)
        self.n_tensors = len(graph.past_names)
        self.dtype = np.dtype(graph.kv_dtype)
        self.nh, self.hs = graph.n_head, graph.head_dim
        self.columns = graph.columns  # a vocabulary-trimmed head's columns (None: the full vocabulary)
        self.lengths = np.zeros(rows, dtype=np.int64)  # tokens each row holds (its next position id)
        self.live = 0  # rows 0 .. live-1 are in use
        self.past_len = 0  # P: the physical length every live row shares
        self.capacity = 0  # positions allocated per row
        self.allocations = 0
        self.relayouts = 0  # re-packs and shifts (a copy of the live rows each)
        self.slots_read = self.slots_used = 0  # cache slots decode steps read, and those of them holding a token
        self._storage: np.ndarray | None = None
        self._src = 0  # concat: the ping-pong slot holding the past
        # seconds spent so far: newcomers' prefill runs, copying their keys/values in, shifts and re-packs
        self.seconds = {"prefill": 0.0, "join_copy": 0.0, "relayout": 0.0, "step": 0.0}

    @property
    def free_rows(self) -> int:
        return self.rows - self.live

    def nbytes(self, positions: int) -> int:
        """Memory the cache takes at `positions` per row (concat: two ping-pong copies)."""
        per = self.rows * self.nh * positions * self.hs * self.dtype.itemsize * self.n_tensors
        return per if self.shared else 2 * per

    # ---- storage ----------------------------------------------------------------------------------------------

    def _alloc(self, positions: int) -> np.ndarray:
        # zeroed: a masked slot is read (weight 0), and uninitialised memory could hold NaN bits
        self.allocations += 1
        if self.shared:
            return np.zeros((self.n_tensors, self.rows, self.nh, positions, self.hs), self.dtype)
        return np.zeros((2, self.n_tensors, self.rows * self.nh * positions * self.hs), self.dtype)

    def _view(self, storage: np.ndarray, slot: int, t: int, rows: int, length: int, cap: int) -> np.ndarray:
        """(rows, nh, length, hs): the first `length` positions of the first rows of tensor t."""
        if self.shared:
            return storage[t, :rows, :, :length]
        return storage[slot, t, : rows * self.nh * length * self.hs].reshape(rows, self.nh, length, self.hs)

    def _relayout(self, new_len: int, capacity: int | None = None) -> None:
        """Move every live row to be right-aligned at new_len (a shift or a re-pack), into new storage of
        `capacity` positions when given (a growth)."""
        k, P, cap = self.live, self.past_len, self.capacity
        if capacity is None and (new_len == P or k == 0):
            self.past_len = new_len  # nothing to move
            return
        t0 = time.perf_counter()
        src_storage, src = self._storage, self._src
        if capacity is not None:
            dst_storage, dst, new_cap = self._alloc(capacity), 0, capacity
        else:  # concat: into the other ping-pong slot; shared: in place (numpy copies overlapping moves safely)
            dst_storage, dst, new_cap = src_storage, (src if self.shared else 1 - src), cap
        # every row is right-aligned, so every row moves by the same P - new_len: one copy of the last m slots of
        # all rows per tensor (shorter rows bring a few masked, finite slots along), not one copy per row
        m = int(self.lengths[:k].max(initial=0)) if src_storage is not None else 0  # the longest row (<= P, new_len)
        for t in range(self.n_tensors if m else 0):
            old = self._view(src_storage, src, t, k, P, cap)
            self._view(dst_storage, dst, t, k, new_len, new_cap)[:, :, new_len - m :] = old[:, :, P - m :]
        self._storage, self._src, self.capacity, self.past_len = dst_storage, dst, new_cap, new_len
        self.relayouts += 1
        self.seconds["relayout"] += time.perf_counter() - t0

    def _make_room(self, needed: int) -> None:
        """Make the shared length `needed` fit: re-pack, or grow the positions (up to n_positions)."""
        if needed <= self.capacity:
            return
        if needed > self.n_positions:
            raise GenerationError(f"A row needs {needed} positions; the model has {self.n_positions}.")
        grown = min(self.n_positions, max(needed, 2 * self.capacity, MIN_POSITIONS))
        self._relayout(self.past_len, capacity=grown)

    def reserve(self, positions: int) -> None:
        """Allocate every row's first `positions` (up to n_positions) and touch their pages now: a server's
        start-up pays the page faults, and the growth copy up to there, instead of its first requests."""
        if self._storage is None:
            self._make_room(min(positions, self.n_positions))
            self._storage.fill(0)  # np.zeros maps lazily-zeroed pages; writing faults them in

    # ---- rows joining and leaving ---------------------------------------------------------------------------

    def join(self, prompts: list[list[int]], pad_id: int, prefixes: list[list[np.ndarray]] | None = None) -> np.ndarray:
        """Prefill the prompts into free rows live .. live+n-1; returns their (n, W) next-token log-probs.
        prefixes[j]: cached KV blocks of prompt j's first tokens (PrefixCache.lookup): that row prefills the rest
        on them (gpt2edge.runtime.model.slot_prefix), the others together as before."""
        n = len(prompts)
        if n > self.free_rows:
            raise GenerationError(f"{n} rows asked for, {self.free_rows} free.")
        lens = [len(p) for p in prompts]
        L = max(lens)
        t0 = time.perf_counter()
        if prefixes is None or not any(prefixes):
            lp, presents = self._prefill(prompts, pad_id)
            rows = None
        else:
            lp, rows = prefill_rows(self, prompts, pad_id, prefixes)
        self.seconds["prefill"] += time.perf_counter() - t0
        # the running rows first shifted (or re-packed) so that P is at least the longest newcomer
        self._fit(L, max(L, int(self.lengths[: self.live].max(initial=0))))
        P, k = self.past_len, self.live
        t0 = time.perf_counter()
        same = rows is None and all(m == L for m in lens)
        for t in range(self.n_tensors):  # (n, nh, L, hs) each, left-padded; or one (nh, m, hs) per row
            view = self._view(self._storage, self._src, t, k + n, P, self.capacity)
            if same:  # one copy for all newcomers (equal lengths: no padding to skip)
                view[k : k + n, :, P - L :] = presents[t]
                continue
            for j, m in enumerate(lens):
                view[k + j, :, P - m :] = presents[t][j, :, L - m :] if rows is None else rows[j][t]
        self.seconds["join_copy"] += time.perf_counter() - t0
        self.lengths[k : k + n] = lens
        self.live = k + n
        return lp

    def row_kv(self, i: int) -> list[np.ndarray]:
        """Live row i's (nh, length, hs) keys and values per tensor: views of the cache (copy to keep them)."""
        n, P = int(self.lengths[i]), self.past_len
        return [self._view(self._storage, self._src, t, self.live, P, self.capacity)[i, :, P - n :]
                for t in range(self.n_tensors)]  # fmt: skip

    def free(self, i: int) -> int | None:
        """Free row i; the last live row moves into it. Returns that row's old index (None when i was last)."""
        last = self.live - 1
        if not 0 <= i <= last:
            raise ValueError(f"row {i} is not live (rows 0..{last} are)")
        moved = None
        if i != last:
            n, P = int(self.lengths[last]), self.past_len
            for t in range(self.n_tensors):
                view = self._view(self._storage, self._src, t, self.live, P, self.capacity)
                view[i, :, P - n :] = view[last, :, P - n :]
            self.lengths[i] = self.lengths[last]
            moved = last
        self.lengths[last] = 0
        self.live = last
        if self.live == 0:
            self.past_len = 0
        return moved

    def _fit(self, minimum: int, longest: int) -> None:
        """Before a join or a step: P at least `minimum` (the longest newcomer), P + 1 within the model's positions
        (the step writes slot P), the masked slots before the rows bounded; then room for slot P allocated."""
        P = self.past_len
        if P < minimum or P + 1 > self.n_positions or self._wasteful(longest):
            self._make_room(longest + 1)
            self._relayout(longest)
        self._make_room(self.past_len + 1)

    def _wasteful(self, longest: int) -> bool:
        waste = self.past_len - longest
        return waste > REPACK_WASTE and REPACK_SHARE * waste > self.past_len

    # ---- the graph ---------------------------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """One run with an empty past: (n, W) log-probs after each prompt, (n, nh, L, hs) keys/values each."""
        n, L = len(prompts), max(len(p) for p in prompts)
        ids, mask = left_pad(prompts, pad_id, L)
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask, L)}
        if self.graph.keeps:
            feed[KEEP_INPUT] = np.array([L - 1], dtype=np.int64)
        # the shared graph takes a buffer at least as long as the mask; the concat graph the (empty) past itself
        past = np.zeros((n, self.nh, L if self.shared else 0, self.hs), self.dtype)
        feed.update((name, past) for name in self.graph.past_names)
        feed.update(self.switches)
        with run_errors(self.graph.folder.graph_path):
            names = [self.output, *self.graph.present_names]
            lp, *presents = self.graph.session.run(names, feed, self.graph.run_options)
        return self._head(_last(lp)), [p[:, :, :L] for p in presents]

    def _head(self, out: np.ndarray) -> np.ndarray:
        """The body's (n, n_embd) hidden state -> (n, V) log-probs through the folder's head (else out as it is)."""
        return out if self.head is None else self.head(out)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token to each live row (in row order); returns (live, W) log-probs of the next token."""
        k = self.live
        if len(tokens) != k or k == 0:
            raise ValueError(f"step needs one token per live row ({k}), got {len(tokens)}")
        self._fit(0, int(self.lengths[:k].max()))
        P, cap = self.past_len, self.capacity
        mask = (np.arange(P + 1)[None, :] >= (P - self.lengths[:k])[:, None]).astype(np.int64)  # (k, P+1)
        inputs = {
            "input_ids": np.ascontiguousarray(tokens, dtype=np.int64).reshape(k, 1),
            "attention_mask": mask,
            "position_ids": self.lengths[:k].reshape(k, 1).copy(),
        }
        if self.graph.keeps:
            inputs[KEEP_INPUT] = np.zeros(1, dtype=np.int64)
        b = self.graph.session.io_binding()
        for name, arr in inputs.items():
            b.bind_input(name, "cpu", 0, np.int64, list(arr.shape), arr.ctypes.data)
        for name, arr in self.switches.items():
            b.bind_cpu_input(name, arr)
        b.bind_output(self.output, "cpu")
        t_type, dst = self.dtype.type, self._src if self.shared else 1 - self._src
        for t, (past, present) in enumerate(zip(self.graph.past_names, self.graph.present_names)):
            if self.shared:  # one (k, nh, capacity, hs) buffer: the graph writes slot P in place
                ptr, shape = self._storage[t].ctypes.data, [k, self.nh, cap, self.hs]
                b.bind_input(past, "cpu", 0, t_type, shape, ptr)
                b.bind_output(present, "cpu", 0, t_type, shape, ptr)
            else:  # read (k, nh, P, hs) from one ping-pong slot, write (k, nh, P+1, hs) to the other
                src_ptr, dst_ptr = self._storage[self._src, t].ctypes.data, self._storage[dst, t].ctypes.data
                b.bind_input(past, "cpu", 0, t_type, [k, self.nh, P, self.hs], src_ptr)
                b.bind_output(present, "cpu", 0, t_type, [k, self.nh, P + 1, self.hs], dst_ptr)
        t0 = time.perf_counter()
        with run_errors(self.graph.folder.graph_path):
            self.graph.session.run_with_iobinding(b, self.graph.run_options)
        self.seconds["step"] += time.perf_counter() - t0
        self.slots_read += k * (P + 1)  # every step reads P + 1 slots per row, masked or not
        self.slots_used += int(self.lengths[:k].sum()) + k
        self._src = dst
        self.past_len = P + 1
        self.lengths[:k] += 1
        return self._head(_last(b.get_outputs()[0].numpy()))


def _last(lp: np.ndarray) -> np.ndarray:
    """(n, W), (n, S, W) or (n, keep, W) -> (n, W) of the last position."""
    return lp if lp.ndim == 2 else lp[:, -1]
