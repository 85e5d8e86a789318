"""The KV cache: allocated once per generation for the whole length, handed to ONNX Runtime by pointer.

The graph reads past (B, nh, P, hs) and writes present (B, nh, P+S, hs). Each layer's key and value get two
flat buffers sized for the longest sequence; a step reads its past from one and writes its present into the
other, then they swap (ping-pong). A prefix of a flat buffer is a contiguous (B, nh, T, hs) tensor for every
T, so no step allocates or copies cache memory on our side, and on CUDA the cache never leaves the device.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, n_layer: int, n_head: int, head_dim: int, dtype: type = np.float32, device: str = "cpu"):
        self.n_tensors = 2 * n_layer  # key and value per layer
        self.n_head = n_head
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        self.device = device
        self.batch = 0
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
            shape = (2, self.n_tensors, elems)
            if self.device == "cpu":
                self._storage = np.empty(shape, dtype=self.dtype)
                self._base = self._storage.ctypes.data
            else:
                import onnxruntime as ort

                self._storage = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.dtype.type, "cuda", 0)
                self._base = self._storage.data_ptr()
            self._elems = elems
            self.batch, self.capacity = batch, length
            self.allocations += 1
        self.src = 0

    def pointer(self, slot: int, tensor: int) -> int:
        """Address of flat buffer `tensor` (2*layer + 0 for key, + 1 for value) in ping-pong `slot`."""
        return self._base + (slot * self.n_tensors + tensor) * self._elems * self.dtype.itemsize

    def shape(self, length: int) -> list[int]:
        return [self.batch, self.n_head, length, self.head_dim]

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

    def swap(self) -> None:
        """After a step the present slot becomes the next step's past."""
        self.src = 1 - self.src

    def pointers(self) -> set[int]:
        """Every address a binding may use: tests check that ORT wrote into these and nowhere else."""
        return {self.pointer(s, t) for s in (0, 1) for t in range(self.n_tensors)}
