"""The server's slots (llama-server's /slots): one record per slot id 0 .. max_rows - 1, holding the tokens of
the last row that ran in it, for GET /slots and the slot files (slot_files.py).

A row takes the lowest free slot id when it joins the batch and gives it back, with the tokens its cache row
held (its prompt and every generated token it fed: what the prefix cache keeps), when it leaves. Slot ids are
not cache rows: those are re-packed as rows leave, while a row keeps its slot id from join to leave. At most
max_rows rows run, so a joining row always finds a free id. Thread-safe (one lock): the scheduler thread
takes and gives back, HTTP handlers read, restore and erase.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class SlotBusy(Exception):
    """The slot holds a running row: its tokens are not final yet."""


class SlotRecords:
    """Per slot id: the tokens of the last row that ran in it, and whether a row runs in it now."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        self._busy = [False] * n
        self._lock = threading.Lock()

    def take(self, k: int) -> list[int]:
        """k free slot ids, lowest first, now busy (-1 for any past the free ones: never while rows <= n)."""
        with self._lock:
            free = [s for s in range(self.n) if not self._busy[s]][:k]
            for s in free:
                self._busy[s] = True
            return free + [-1] * (k - len(free))

    def give_back(self, slot: int, tokens: Sequence[int]) -> None:
        """The row in `slot` left; its cache row held `tokens`."""
        if slot < 0:
            return
        with self._lock:
            self._busy[slot], self._tokens[slot] = False, list(tokens)

    def tokens(self, slot: int) -> list[int]:
        """The slot's tokens; SlotBusy while a row runs in it."""
        with self._lock:
            if self._busy[slot]:
                raise SlotBusy
            return list(self._tokens[slot])

    def replace(self, slot: int, tokens: Sequence[int]) -> int:
        """Set an idle slot's tokens (restore, erase); returns how many it held. SlotBusy while a row runs."""
        with self._lock:
            if self._busy[slot]:
                raise SlotBusy
            held, self._tokens[slot] = len(self._tokens[slot]), list(tokens)
            return held

    def snapshot(self) -> list[tuple[bool, list[int]]]:
        """(busy, tokens) per slot id, read together."""
        with self._lock:
            return [(b, list(t)) for b, t in zip(self._busy, self._tokens)]
