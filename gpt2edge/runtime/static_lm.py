"""StaticLM: OrtLM's interface (start / forward / past_len / n_positions) over the static-shape graphs of
gpt2edge.export.static, so the ordinary generation loop runs them (a prototype: plain session.run, no IO
binding).

A forward of S tokens is fed as ceil(S / C) chunks of the prefill graph (the last one padded, its pad slots
left unmarked in the mask) or, for one token, one call of the decode graph; rows past the caller's batch are
padding rows (mask all 0) whose outputs are dropped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.session import create_session


class StaticLM:
    def __init__(self, prefill: Path, decode: Path | None = None, threads: int | None = None) -> None:
        self.prefill = create_session(prefill, threads=threads)
        self.decode = create_session(decode, threads=threads) if decode else self.prefill
        shapes = {i.name: i.shape for i in self.prefill.get_inputs()}
        self.batch, self.chunk = shapes["input_ids"]  # every dimension is a number in a static graph
        self.n_positions = shapes["attention_mask"][1]  # the cache capacity bounds prompt + new tokens
        self.past_names = [i.name for i in self.prefill.get_inputs()][4:]
        self.cache_shape = shapes[self.past_names[0]]
        self.cache_dtype = np.float16 if "float16" in self.prefill.get_inputs()[4].type else np.float32
        self.past_len = 0

    def start(self, batch: int, length: int) -> None:
        """A zeroed cache and mask for a generation of `batch` rows and at most `length` positions."""
        if batch > self.batch:
            raise GenerationError(f"This static graph runs batches of at most {self.batch} rows, got {batch}.")
        if length > self.n_positions:
            raise GenerationError(f"This static graph's cache holds {self.n_positions} positions, {length} needed.")
        self.rows = batch
        self.cache = [np.zeros(self.cache_shape, self.cache_dtype) for _ in self.past_names]
        self.mask = np.zeros((self.batch, self.n_positions), np.int64)  # (B, N): slots holding real tokens
        self.past_len = 0

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """(b, S) ids, (b, past+S) mask, (b, S) positions -> (b, V) log-probs after the last token."""
        b, S = input_ids.shape
        P = self.past_len
        self.mask[:b, : P + S] = attention_mask
        session, C = (self.decode, 1) if S == 1 else (self.prefill, self.chunk)
        for start in range(0, S, C):
            n = min(C, S - start)
            ids = np.zeros((self.batch, C), np.int64)  # (B, C); pads: token 0 at position 0, slots unmarked
            pos = np.zeros((self.batch, C), np.int64)
            ids[:b, :n] = input_ids[:, start : start + n]
            pos[:b, :n] = position_ids[:, start : start + n]
            feed = {
                "input_ids": ids,
                "attention_mask": self.mask,
                "position_ids": pos,
                "cache_position": np.arange(P + start, P + start + C, dtype=np.int64),
                **dict(zip(self.past_names, self.cache)),
            }
            logprobs, *self.cache = session.run(None, feed)
        self.past_len += S
        return logprobs[:b]
