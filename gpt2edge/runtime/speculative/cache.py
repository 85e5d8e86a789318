"""One token sequence (batch 1) on an OrtLM's KV cache, with rollback: what speculative decoding needs from both
the target and a draft model.

Rollback of rejected draft tokens moves no cache memory in the common case:
  shared cache  the graph reads only the first past_len slots and writes a step's entries at past_len, so
                rolling back is moving past_len back (OrtLM.rewind); the next step overwrites the stale slots.
  concat cache  each (1, nh, T, hs) tensor keeps every slot it has; a rejected slot stays and the attention
                mask zeroes it (position ids are explicit inputs, so the live tokens keep their positions).
                Such dead slots cost capacity and a little attention and Concat traffic per step, so the cache
                reserves room for them, and when that room runs out one copy moves the live slots to the front
                (OrtLM.compact). See docs/speculative.md for the measured cost of both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpt2edge.runtime.model.contract import LM


class CachedSequence:
    """The tokens an OrtLM's cache holds for one sequence: feed(), truncate(), sync() to a token history."""

    def __init__(self, lm: LM, length: int, dead_room: int = 0) -> None:
        """Reserve the cache for `length` live positions plus `dead_room` slots for rejected tokens (concat)."""
        self.lm = lm
        self.capacity = length + (0 if lm.shared else dead_room)
        lm.start(1, self.capacity)
        self.mask = np.zeros((1, self.capacity), dtype=np.int64)  # 1 = a live slot
        self.tokens: list[int] = []  # the live tokens, in order
        self.slot_of: list[int] = []  # cache slot of each live token (a concat cache may have dead slots between)
        self.compactions = 0

    @property
    def slots(self) -> int:
        """Cache slots in use, dead ones included (the graph's past length)."""
        return self.lm.past_len

    def feed(self, tokens: Sequence[int], keep: int | None = None) -> np.ndarray:
        """Append tokens; returns (V,) log-probs after the last one, or with keep=n, (n, V) after each of the
        last n (a view the next feed may overwrite)."""
        S = len(tokens)
        if self.slots + S > self.capacity:
            self._compact()
        if self.slots + S > self.capacity:
            raise ValueError(f"the sequence cache holds {self.capacity} positions, {self.slots + S} needed")
        start, live = self.slots, len(self.tokens)
        self.mask[0, start : start + S] = 1
        ids = np.asarray([tokens], dtype=np.int64)  # (1, S)
        positions = np.arange(live, live + S, dtype=np.int64)[None]  # (1, S): dead slots take no position
        out = self.lm.forward(ids, self.mask[:, : start + S], positions, keep=keep)
        self.tokens += [int(t) for t in tokens]
        self.slot_of += range(start, start + S)
        return out[0]

    def truncate(self, n: int) -> None:
        """Keep the first n live tokens: rewind a shared cache, mask the dropped slots of a concat cache."""
        drop = len(self.tokens) - n
        if drop <= 0:
            return
        if self.lm.shared:
            self.lm.rewind(self.slots - drop)  # no dead slots: the live tokens are the first slots
        else:
            self.mask[0, self.slot_of[n:]] = 0
        del self.tokens[n:], self.slot_of[n:]

    def sync(self, history: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly `history` (keeping the longest common prefix, feeding the rest); returns
        the (V,) log-probs after it. At least the last token is fed, so its log-probs are fresh."""
        n = min(_common_prefix(self.tokens, history), len(history) - 1)
        self.truncate(n)
        return self.feed(history[n:])

    def _compact(self) -> None:
        """Move the live slots of a concat cache to the front: one copy, then no dead slots."""
        live = len(self.tokens)
        if self.lm.shared or live == self.slots:
            return
        self.lm.compact(np.asarray(self.slot_of, dtype=np.int64))
        self.slot_of = list(range(live))
        self.mask[0, :live] = 1
        self.mask[0, live:] = 0
        self.compactions += 1


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])
