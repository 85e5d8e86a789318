"""One forward step of an exported graph, with the KV cache bound in place (or, for comparison, without)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from gpt2edge.errors import DeviceError
from gpt2edge.runtime.kv_cache import KVCache, SharedKVCache
from gpt2edge.runtime.model_folder import ModelFolder
from gpt2edge.runtime.session import ORT_DEVICE, create_session


class OrtLM:
    """forward(ids, mask, positions) -> next-token log-probs (B, V) as a host array; the cache lives inside."""

    def __init__(
        self, folder: ModelFolder, device: str = "cpu", threads: int | None = None, io_binding: bool = True
    ) -> None:
        self.folder = folder
        self.device = device
        self.io_binding = io_binding
        self.shared = folder.kv_cache == "shared"
        if self.shared and device != "cpu":
            raise DeviceError(
                f"{folder.path} uses the shared KV cache (the CPU fast path, tested on CPU only); for {device} "
                "export with --kv-cache concat."
            )
        self.session = create_session(folder.graph_path, device=device, threads=threads)
        d = folder.dims
        self.n_layer, self.n_head, self.head_dim = d["n_layer"], d["n_head"], d["head_dim"]
        self.vocab_size, self.n_positions = d["vocab_size"], d["n_positions"]
        names = [i.name for i in self.session.get_inputs()]
        self.past_names = names[3:]
        self.present_names = [o.name for o in self.session.get_outputs()][1:]
        self.kv_dtype = folder.kv_dtype
        cache_cls = SharedKVCache if self.shared else KVCache
        self.cache = cache_cls(self.n_layer, self.n_head, self.head_dim, self.kv_dtype, ORT_DEVICE[device])
        self.binding = self.session.io_binding() if io_binding else None
        self.past_len = 0
        self._presents: list[np.ndarray] = []  # only without IO binding
        self._logprobs = None  # pre-bound output buffer (head "last")
        self._inputs: dict[str, np.ndarray] = {}  # the int64 buffers bound as ids and positions
        self._mask = np.empty(0, dtype=np.int64)  # flat buffer the attention mask is bound from
        self._bound_seq = 0  # new positions per step of the current binding (shared-cache graphs reuse it)

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
                shape = (rows, self.vocab_size)
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

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """(B, S) ids, (B, past+S) mask, (B, S) positions -> (B, V) float32 log-probs of the next token."""
        S = input_ids.shape[1]
        if not self.io_binding:
            feed = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
            feed.update(zip(self.past_names, self.cache.tensors(self.past_len) if self.shared else self._presents))
            out = self.session.run(None, feed)
            if self.shared:
                self.cache.write(out[1:], self.past_len)
            else:
                self._presents = out[1:]
            self.past_len += S
            return out[0] if out[0].ndim == 2 else out[0][:, -1]

        b = self.binding
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        if self.shared and S == self._bound_seq:
            # decode steps of a shared-cache graph bind the same buffers: refresh ids and positions in place
            # (ORT reads them at run time) instead of re-binding ~4 x n_layer tensors per step
            for name, arr in inputs.items():
                self._inputs[name][...] = arr
        else:
            self._bind_step(inputs, S)
            self._bound_seq = S if self.shared else 0
        self._bind_mask(attention_mask)  # the one input whose shape grows every step
        self.session.run_with_iobinding(b)
        self.cache.after_step(self.past_len, S)
        self.past_len += S
        lp = self._logprobs
        if lp is None:
            return b.get_outputs()[0].numpy()[:, -1]
        # on CUDA only this (B, V) tensor crosses to the host each step; the cache stays on the device
        return lp if self.device == "cpu" else lp.numpy()

    def _bind_mask(self, mask: np.ndarray) -> None:
        """Copy the (B, T) mask into the front of the flat buffer and bind it there, by pointer."""
        view = self._mask[: mask.size].reshape(mask.shape)
        view[...] = mask
        self.binding.bind_input("attention_mask", "cpu", 0, np.int64, list(mask.shape), view.ctypes.data)

    def _bind_step(self, inputs: dict[str, np.ndarray], S: int) -> None:
        """Bind ids and positions (our own int64 buffers, by pointer), logprobs and the cache for a step of
        S tokens."""
        b = self.binding
        self._inputs = {name: np.array(arr, dtype=np.int64, order="C") for name, arr in inputs.items()}
        for name, arr in self._inputs.items():
            b.bind_input(name, "cpu", 0, np.int64, list(arr.shape), arr.ctypes.data)
        # outputs come back in binding order: logprobs first, then the presents
        lp = self._logprobs
        if lp is None:  # head "all": (B, S, V) varies with S, let ORT allocate it
            b.bind_output("logprobs", ORT_DEVICE[self.device])
        elif self.device == "cpu":
            b.bind_output("logprobs", "cpu", 0, np.float32, list(lp.shape), lp.ctypes.data)
        else:
            b.bind_ortvalue_output("logprobs", lp)
        self.cache.bind(b, self.past_names, self.present_names, self.past_len, S)

    def present_pointers(self) -> list[int]:
        """Where ORT actually wrote the last step's presents (IO binding only)."""
        return [o.data_ptr() for o in self.binding.get_outputs()[1:]]
