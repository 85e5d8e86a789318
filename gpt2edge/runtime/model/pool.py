"""LMPool: the generation contexts (OrtLM or StaticLM, each a KV cache and an IO binding) of one shared graph,
one per concurrent call, optionally capped so that a burst of calls cannot allocate a cache each without bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gpt2edge.errors import GenerationError


def check_max_contexts(max_contexts: int | None, wait_s: float | None) -> None:
    """None (uncapped) or an int >= 1; the wait None (as long as it takes) or a finite number >= 0."""
    if max_contexts is not None and (
        isinstance(max_contexts, bool) or not isinstance(max_contexts, int) or max_contexts < 1
    ):
        raise GenerationError(f"max_contexts must be an integer >= 1 (or None: no cap), got {max_contexts!r}.")
    if wait_s is not None and (
        isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s < float("inf")
    ):
        raise GenerationError(f"context_wait_s must be a finite number >= 0 (or None: wait), got {wait_s!r}.")


class LMPool:
    """Contexts on one shared graph, one per concurrent call: `with pool.lease() as lm:` takes the
    lowest-numbered idle one (a new one when all are busy) and gives it back at the end.

    Sequential calls therefore always get `primary`, and reuse its cache. After a burst of concurrent calls at
    most `keep_idle` contexts (each holding its last KV cache) stay for reuse; the others are dropped.

    max_contexts caps how many exist at once (each holds a KV cache of its call's batch x length): a call that
    finds all of them busy waits for one to be given back, at most wait_s seconds (None: as long as it takes),
    then raises GenerationError. Several streams interleaved in ONE thread beyond the cap can never be given
    back while that thread waits: give them a wait_s, or a cap above the streams they hold open.
    """

    def __init__(
        self,
        graph,
        io_binding: bool = True,
        keep_idle: int = 4,
        factory: Callable | None = None,
        max_contexts: int | None = None,
        wait_s: float | None = None,
    ) -> None:
        check_max_contexts(max_contexts, wait_s)
        self.graph = graph
        self.io_binding = io_binding
        self.max_contexts = max_contexts
        self.wait_s = wait_s
        self.keep_idle = max(1, keep_idle if max_contexts is None else min(keep_idle, max_contexts))
        # what makes one context: the graph's own kind (OrtLM, or StaticLM on a static graph) by default
        self._factory = factory or (lambda: self.graph.new_lm(self.io_binding))
        self._free = threading.Condition()  # guards the fields below; waited on when the cap is reached
        self._created = 0
        self._live = 0  # contexts that exist now: leased + idle
        self._idle: list[tuple[int, object]] = []  # (creation number, context), sorted
        self._idle.append(self._new())
        self.primary = self._idle[0][1]

    @property
    def live(self) -> int:
        """Contexts that exist now (leased or idle)."""
        return self._live

    def _new(self) -> tuple[int, object]:
        """(creation number, a fresh context); call with the lock held."""
        self._created += 1
        self._live += 1
        return self._created - 1, self._factory()

    def _take(self) -> tuple[int, object]:
        """An idle context, a new one under the cap, or (capped) the first one given back; lock held."""
        deadline = None if self.wait_s is None else time.monotonic() + self.wait_s
        while True:
            if self._idle:
                return self._idle.pop(0)
            if self.max_contexts is None or self._live < self.max_contexts:
                return self._new()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise GenerationError(
                    f"All {self.max_contexts} generation contexts (max_contexts) stayed busy for {self.wait_s:g} s; "
                    "finish or close running streams, or raise max_contexts."
                )
            self._free.wait(left)

    @contextmanager
    def lease(self) -> Iterator:
        with self._free:
            n, lm = self._take()
        try:
            yield lm
        finally:
            with self._free:
                self._idle.append((n, lm))
                self._idle.sort(key=lambda e: e[0])
                self._live -= len(self._idle[self.keep_idle :])
                del self._idle[self.keep_idle :]
                self._free.notify()
