"""The rows and positions of one generation's KV cache, OrtLM's half that never runs the graph: reserve them
(start), prefill on some rows and copy them to the rest (use_rows, expand_rows: several beams or samples from one
prefill), reorder them (beam search), and drop positions (rewind a shared cache, compact a concat one: rejected
draft tokens). With IO binding (or a shared cache) the rows live in the KVCache; without, in the `_presents`
arrays the last run returned. A mixin of gpt2edge.runtime.model.lm.OrtLM, which owns every attribute used here.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort


class CacheRows:
    """start / use_rows / expand_rows / reorder_rows / rewind / compact for OrtLM (see its contract)."""

    # every attribute used here (cache, io_binding, shared, past_len, _presents, _mask, ...) is OrtLM.__init__'s

    def start(self, batch: int, length: int) -> None:
        """Prepare for a generation of `batch` rows and at most `length` positions: one allocation."""
        self.past_len = 0
        self._bound_seq = 0  # new buffers below: bind afresh
        if self.io_binding or self.shared:
            self.cache.reserve(batch, length)
        if self.io_binding:
            if self._mask.size < batch * length:
                self._mask = np.empty(batch * length, dtype=np.int64)
        self._set_rows(batch)

    def _set_rows(self, rows: int) -> None:
        """Size the per-row buffers (the bound log-probs, or the unbound empty past) for steps of `rows` rows."""
        self._bound_seq = 0  # the batch changed: bind afresh
        if self.io_binding:
            if self.folder.head == "last":
                shape = (rows, self.graph.output_width)
                if self.device == "cpu":
                    self._logprobs = np.empty(shape, dtype=np.float32)
                else:
                    self._logprobs = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, "cuda", 0)
        elif not self.shared:
            empty = np.zeros((rows, self.n_head, 0, self.head_dim), dtype=self.kv_dtype)
            self._presents = [empty] * len(self.past_names)

    def use_rows(self, rows: int) -> None:
        """Before the prefill: run it on the first `rows` of the rows start() reserved; expand_rows then fills
        the rest from them (one prefill for several beams or samples, one cache allocation)."""
        if self.io_binding or self.shared:
            self.cache.set_rows(rows)
        self._set_rows(rows)

    def expand_rows(self, factor: int) -> None:
        """After the prefill: row r's cache is copied into rows r*factor .. r*factor+factor-1."""
        if self.io_binding or self.shared:
            self.cache.expand_rows(factor, self.past_len)
            rows = self.cache.rows
        else:
            self._presents = [np.repeat(p, factor, axis=0) for p in self._presents]
            rows = len(self._presents[0])
        if self.io_binding:
            self._set_rows(rows)

    def reorder_rows(self, index: np.ndarray) -> None:
        """Row r continues old row index[r] (beam search): the cache rows move in place."""
        if self.io_binding or self.shared:
            self.cache.reorder_rows(index, self.past_len)
        else:
            self._presents = [np.take(p, index, axis=0) for p in self._presents]

    def rewind(self, past_len: int) -> None:
        """Forget every cached position from past_len on (a shared cache: the graph reads only the first
        past_len slots and the next step overwrites the rest, so moving the length back is the whole rollback)."""
        if not self.shared:
            raise ValueError("rewind needs a shared cache; a concat cache keeps its positions (see compact)")
        if not 0 <= past_len <= self.past_len:
            raise ValueError(f"cannot rewind a cache of {self.past_len} positions to {past_len}")
        self.past_len = past_len

    def compact(self, slots: np.ndarray) -> None:
        """Keep only the cached positions `slots` (increasing), moved to the front: one copy of what is kept.

        A concat cache is (B, nh, T, hs) per tensor, and its first T' positions are not a (B, nh, T', hs)
        tensor when nh > 1, so dropping positions (rejected draft tokens, masked out until then) needs this copy."""
        slots = np.asarray(slots, dtype=np.int64)
        if self.shared:
            raise ValueError("compact is for concat caches; a shared cache rewinds")
        if self.io_binding:
            self.cache.compact(self.past_len, slots)
        else:
            self._presents = [np.ascontiguousarray(p[:, :, slots]) for p in self._presents]
        self.past_len = len(slots)

    @property
    def supports_row_state(self) -> bool:
        """row_tensors / load_row move host arrays: a CPU cache (session files, the prefix cache)."""
        return self.device == "cpu"

    def row_tensors(self) -> list[np.ndarray]:
        """A one-row generation's cache: (nh, past_len, hs) per past input, in past_names order (views: copy to
        keep them past the next forward). gpt2edge.runtime.session_file saves them."""
        if self.io_binding or self.shared:
            return self.cache.row_tensors(self.past_len)
        return [p[0] for p in self._presents]

    def load_row(self, tensors: list[np.ndarray]) -> None:
        """The reverse of row_tensors on a fresh one-row reservation: the cache then holds those P positions."""
        P = tensors[0].shape[1] if tensors else 0
        if self.io_binding or self.shared:
            self.cache.load_row(tensors)
        else:
            self._presents = [np.array(t[None], dtype=self.kv_dtype) for t in tensors]
        self.past_len = P
