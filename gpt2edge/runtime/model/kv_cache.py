"""The KV cache: allocated once per generation for the whole length, handed to ONNX Runtime by pointer.

Two layouts, one per graph kind (the manifest's graph.kv_cache):

concat (Optimum's contract): the graph reads past (B, nh, P, hs) and writes present (B, nh, P+S, hs). Each
  layer's key and value get two flat buffers sized for the longest sequence; a step reads its past from one
  and writes its present into the other, then they swap (ping-pong). A prefix of a flat buffer is a
  contiguous (B, nh, T, hs) tensor for every T, so no step allocates cache memory, and on CUDA the cache
  never leaves the device. The graph itself still copies the cache once per step (its Concat).

shared (the CPU fast path): one buffer (B, nh, capacity, hs) per key and value, bound as both the past and
  the present of the graph; its fused attention writes the step's entries into their slots and reads the
  valid ones. Nothing copies the cache: a decode step reads it once, up to the current length.
"""

from __future__ import annotations

import numpy as np


def _alloc(shape: tuple[int, ...], dtype: np.dtype, device: str, zero: bool = False):
    """(storage, base address): a numpy array on CPU, an OrtValue on CUDA."""
    if device == "cpu":
        arr = np.zeros(shape, dtype=dtype) if zero else np.empty(shape, dtype=dtype)
        return arr, arr.ctypes.data
    import onnxruntime as ort

    val = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type, "cuda", 0)
    return val, val.data_ptr()


class KVCache:
    """Ping-pong buffers for concat graphs (see the module docstring)."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int, dtype: type = np.float32, device: str = "cpu"):
        self.n_tensors = 2 * n_layer  # key and value per layer
        self.n_head = n_head
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        self.device = device
        self.batch = 0  # rows reserved
        self.rows = 0  # rows the next step binds (fewer than reserved while a prefill runs before expand_rows)
        self.capacity = 0  # sequence slots per buffer
        self.allocations = 0  # how many times memory was reserved (tests check it stays 1 per generation)
        self.src = 0  # which of the two slots holds the current past
        self._storage = None  # numpy array (CPU) or OrtValue (CUDA), shape (2, n_tensors, elems)
        self._base = 0
        self._elems = 0

    def reserve(self, batch: int, length: int) -> None:
        """Make room for `batch` rows of `length` positions; reuses the buffers when they are big enough."""
        elems = batch * self.n_head * length * self.head_dim
        if self._storage is None or batch != self.batch or length > self.capacity:
            self._storage, self._base = _alloc((2, self.n_tensors, elems), self.dtype, self.device)
            self._elems = elems
            self.batch, self.capacity = batch, length
            self.allocations += 1
        self.src = 0
        self.rows = batch

    def pointer(self, slot: int, tensor: int) -> int:
        """Address of flat buffer `tensor` (2*layer + 0 for key, + 1 for value) in ping-pong `slot`."""
        return self._base + (slot * self.n_tensors + tensor) * self._elems * self.dtype.itemsize

    def shape(self, length: int) -> list[int]:
        return [self.rows, self.n_head, length, self.head_dim]

    def bind(self, binding, past_names: list[str], present_names: list[str], past_len: int, new_len: int) -> None:
        """Bind past (read from slot src) and present (written to the other slot) for one step."""
        if past_len + new_len > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, step needs {past_len + new_len}")
        dst = 1 - self.src
        for i, (past, present) in enumerate(zip(past_names, present_names)):
            binding.bind_input(past, self.device, 0, self.dtype.type, self.shape(past_len), self.pointer(self.src, i))
            binding.bind_output(
                present, self.device, 0, self.dtype.type, self.shape(past_len + new_len), self.pointer(dst, i)
            )

    def after_step(self, past_len: int, new_len: int) -> None:
        """After a step the present slot becomes the next step's past."""
        self.src = 1 - self.src

    def set_rows(self, rows: int) -> None:
        """Bind the first `rows` of the reserved rows from the next step on (a prefill before expand_rows)."""
        if not 0 < rows <= self.batch:
            raise ValueError(f"the KV cache has {self.batch} rows reserved, asked to use {rows}")
        self.rows = rows

    def expand_rows(self, factor: int, past_len: int) -> None:
        """Copy each current row into `factor` consecutive rows (row r -> rows r*factor .. r*factor+factor-1):
        one prefill serves several beams or samples."""
        self.gather_rows(np.repeat(np.arange(self.rows), factor), past_len)

    def reorder_rows(self, index: np.ndarray, past_len: int) -> None:
        """Row r becomes old row index[r] (beam search keeps the best continuations); nothing moves when every
        row keeps its own."""
        if len(index) != self.rows or not np.array_equal(index, np.arange(self.rows)):
            self.gather_rows(index, past_len)

    def gather_rows(self, index: np.ndarray, past_len: int) -> None:
        """New row r = old row index[r], for the first past_len positions: gathered from the past slot into the
        other ping-pong slot, which becomes the past (no allocation on CPU)."""
        new_rows = len(index)
        if new_rows > self.batch:
            raise ValueError(f"the KV cache has {self.batch} rows reserved, asked for {new_rows}")
        index = np.asarray(index, dtype=np.intp)
        row = self.n_head * past_len * self.head_dim  # a (nh, T, hs) row of the flat (B, nh, T, hs) prefix
        host = self._storage if self.device == "cpu" else self._storage.numpy()  # CUDA: a host round trip
        src, dst = host[self.src], host[1 - self.src]  # (n_tensors, elems) each
        for t in range(self.n_tensors):
            old = src[t, : self.rows * row].reshape(self.rows, row)
            # mode="clip" lets numpy write straight into `out` (mode="raise" buffers a copy first)
            np.take(old, index, axis=0, out=dst[t, : new_rows * row].reshape(new_rows, row), mode="clip")
        if self.device != "cpu":
            self._storage.update_inplace(host)
        self.src, self.rows = 1 - self.src, new_rows

    def compact(self, past_len: int, slots: np.ndarray) -> None:
        """Copy positions `slots` of the current past (B, nh, past_len, hs) to the front of the other ping-pong
        slot, which becomes the past: (B, nh, len(slots), hs). One copy of the kept entries per tensor."""
        storage = self._storage if self.device == "cpu" else self._storage.numpy()  # CUDA: via the host
        dst = 1 - self.src
        for i in range(self.n_tensors):
            past = storage[self.src, i, : self._elems_of(past_len)].reshape(self.shape(past_len))
            kept = storage[dst, i, : self._elems_of(len(slots))].reshape(self.shape(len(slots)))
            np.take(past, slots, axis=2, out=kept)
        if self.device != "cpu":
            self._storage.update_inplace(storage)
        self.src = dst

    def row_tensors(self, past_len: int) -> list[np.ndarray]:
        """Row 0's (nh, past_len, hs) key and value per tensor, views of the current past (a saved session)."""
        if self.device != "cpu" or self.rows != 1:
            raise ValueError("row_tensors reads a one-row CPU cache")
        n = self._elems_of(past_len)
        return [
            self._storage[self.src, t, :n].reshape(self.n_head, past_len, self.head_dim) for t in range(self.n_tensors)
        ]

    def load_row(self, tensors: list[np.ndarray]) -> None:
        """Write (nh, P, hs) per tensor as row 0's past (a restored session), after reserve(1, length)."""
        for t, arr in enumerate(tensors):
            self._storage[self.src, t, : arr.size] = arr.ravel()

    def _elems_of(self, length: int) -> int:
        return self.rows * self.n_head * length * self.head_dim


class SharedKVCache(KVCache):
    """One buffer per key/value tensor, bound as both past and present: the graph writes it in place."""

    _scratch: np.ndarray | None = None  # rows being moved by gather_rows

    def reserve(self, batch: int, length: int) -> None:
        if self._storage is None or batch != self.batch or length > self.capacity:
            if self.device != "cpu":
                raise ValueError("the shared KV cache is the CPU fast path")
            # zeroed once so that no slot ever holds NaN bits; the graph reads only the slots it has written
            self._storage = np.zeros((self.n_tensors, batch, self.n_head, length, self.head_dim), self.dtype)
            self._scratch = None  # sized for the old buffers
            self.batch, self.capacity = batch, length
            self.allocations += 1
        self.rows = batch

    def bind(self, binding, past_names: list[str], present_names: list[str], past_len: int, new_len: int) -> None:
        """Past and present = the same (B, nh, capacity, hs) buffer; the graph's attention writes slots
        past_len .. past_len+new_len-1 and reads up to there."""
        if past_len + new_len > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, step needs {past_len + new_len}")
        t, shape = self.dtype.type, self.shape(self.capacity)
        for i, (past, present) in enumerate(zip(past_names, present_names)):
            # the first `rows` rows of a (batch, nh, capacity, hs) buffer are contiguous at its start
            binding.bind_input(past, "cpu", 0, t, shape, self._storage[i].ctypes.data)
            binding.bind_output(present, "cpu", 0, t, shape, self._storage[i].ctypes.data)

    def after_step(self, past_len: int, new_len: int) -> None:
        """Nothing to do: the graph has already written the new entries into the cache."""

    def write(self, presents: list[np.ndarray], past_len: int) -> None:
        """Without IO binding the graph returns a copy of each buffer with the new slots written."""
        self._storage[:, : self.rows] = np.stack(presents)

    def tensors(self, past_len: int) -> list[np.ndarray]:
        """The cache as graph inputs, without IO binding."""
        return list(self._storage[:, : self.rows])

    def row(self, r: int) -> list[np.ndarray]:
        """Row r of every buffer as a (1, nh, capacity, hs) view: contiguous, so it can be bound as a batch of
        one (the graph then reads and writes that row in place)."""
        return [self._storage[i, r : r + 1] for i in range(self.n_tensors)]

    def row_tensors(self, past_len: int) -> list[np.ndarray]:
        """Row 0's (nh, past_len, hs) entries per tensor (strided views of the shared buffers)."""
        if self.rows != 1:
            raise ValueError("row_tensors reads a one-row cache")
        return [cache[0, :, :past_len] for cache in self._storage]

    def load_row(self, tensors: list[np.ndarray]) -> None:
        """Write (nh, P, hs) per tensor into row 0's first P slots; the graph never reads the slots after them."""
        for cache, arr in zip(self._storage, tensors):
            cache[0, :, : arr.shape[1]] = arr

    def gather_rows(self, index: np.ndarray, past_len: int) -> None:
        """New row r = old row index[r], in place, for the first past_len positions only. Rows that keep their
        own content are not touched. A source row that is itself overwritten is first saved to a scratch
        buffer (one tensor's size, allocated once); the others are copied from directly."""
        new_rows = len(index)
        if new_rows > self.batch:
            raise ValueError(f"the KV cache has {self.batch} rows reserved, asked for {new_rows}")
        moved = [(r, int(s)) for r, s in enumerate(index) if r >= self.rows or s != r]
        targets = {r for r, _ in moved}
        saved = {s: i for i, s in enumerate(sorted({s for _, s in moved if s in targets}))}  # row -> scratch slot
        if saved and self._scratch is None:
            self._scratch = np.empty(self._storage.shape[1:], self.dtype)  # (B, nh, capacity, hs)
        L = past_len
        for cache in self._storage:  # (B, nh, capacity, hs) per key / value tensor
            for s, i in saved.items():
                self._scratch[i, :, :L] = cache[s, :, :L]
            for r, s in moved:
                cache[r, :, :L] = self._scratch[saved[s], :, :L] if s in saved else cache[s, :, :L]
        self.rows = new_rows
