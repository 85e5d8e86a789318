"""The decode loops' side of a constraint: one matcher per generated row, the (B, W) allowed mask of a step, and
the rule that ends a row whose grammar is complete.

Where the mask sits: after the processors (repetition penalty, n-gram and word bans, min_new_tokens) and before
the warpers (temperature, top-k, top-p, min-p, typical-p), where transformers' generate() places a user
LogitsProcessor: disallowed tokens get score -inf, so the warpers filter and renormalise among allowed tokens
only, and greedy takes the best allowed token. End tokens are allowed only where the grammar accepts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from gpt2edge.runtime.constraints.engine import (
    CompiledConstraint,
    RowMatcher,
    allowed_masks,
    fill_words,
    masks_from_words,
)
from gpt2edge.runtime.constraints.spec import ConstraintError
from gpt2edge.runtime.model.columns import Columns

# the next step's masks are computed here while ONNX Runtime runs the step's forward (both release the GIL)
_prefetcher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpt2edge-mask")
# what handing one mask to the worker and back costs (submit, wake-up, result: ~0.05 ms on 2 cores): a single
# row's mask cheaper than this is computed in line. A dearer one goes to the worker only when it costs more than
# the forward it would overlap: ONNX Runtime's threads hold every core, and a worker that takes one stalls the
# forward's parallel loops by more than the mask it hides (trained-gpt2-py int8 on a Zen 3, a 0.13 ms mask beside
# a 1.2 ms forward: 5-9 % slower a token handed off than in line; benchmarks/README.md, **Structured output**)
HANDOFF_MS = 0.1


class ConstrainedRows:
    """Matchers of a batch's B rows (several sequences per prompt: one each), fresh at the start of a call."""

    def __init__(self, compiled: CompiledConstraint, rows: int, eos_ids: Sequence[int], columns: Columns | None):
        self.matchers = [compiled.matcher() for _ in range(rows)]
        self.eos_ids, self.columns = tuple(int(t) for t in eos_ids), columns
        # (active rows, the masks' future, the group's index in a prefetch_batch result or None)
        self._pending: tuple[np.ndarray, Future, int | None] | None = None
        # the CPU time the last masks took (the computing thread's own: a worker's wall time would count the
        # forward's threads and the GIL it waited for, and keep a cheap mask in the worker for good)
        self._mask_ms = 0.0
        # the wall time from the last prefetch() to its masks(): the forward (and the loop's work around it)
        self._prefetched_at: float | None = None
        self._forward_ms = 0.0

    def prefetch(self, active: np.ndarray, rows_in_step: int) -> None:
        """Start the masks of the rows' current states in the background (the loop calls this right before the
        forward that the masks do not depend on); masks() with the same rows collects them. A forward of one row
        whose last mask took less than the handoff (HANDOFF_MS: a JSON Schema's or a sliced class's ~0.05 ms)
        or less than the last forward leaves it for masks() to compute in line: the same mask, without the
        thread's cost. rows_in_step: the rows that forward runs (a server's batch holds other requests' rows:
        prefetch_batch)."""
        self._prefetched_at = time.perf_counter()
        if rows_in_step <= 1 and self._mask_ms < max(HANDOFF_MS, self._forward_ms):
            return
        self._pending = (active.copy(), _prefetcher.submit(self._masks, active.copy()), None)

    def masks(self, active: np.ndarray) -> np.ndarray:
        """(B, W) bool: each active row's allowed tokens in the head's columns (W = V, or a trimmed head's K);
        finished rows allow everything (their token is ignored)."""
        if self._prefetched_at is not None:  # the forward since prefetch(): what a handed-off mask would overlap
            self._forward_ms, self._prefetched_at = (time.perf_counter() - self._prefetched_at) * 1e3, None
        pending, self._pending = self._pending, None
        if pending is not None:
            done = pending[1].result()  # waited for even when unused: no matcher is touched by two threads
            if pending[2] is not None:  # one of prefetch_batch's groups: its mask, or the error computing it
                done = done[pending[2]]
                if isinstance(done, Exception):
                    raise done
            if np.array_equal(pending[0], active):
                return done
        return self._masks(active)

    def _masks(self, active: np.ndarray) -> np.ndarray:
        start = time.thread_time()
        try:
            live = self._live(active)
            if not live:  # every active row finished or dead (a beam search's refused beams): no engine call
                return self._assemble(active, live, np.zeros((0, self.matchers[0].compiled.vocab_size), bool))
            return self._assemble(active, live, allowed_masks([self.matchers[b] for b in live], self.eos_ids))
        finally:
            self._mask_ms = (time.thread_time() - start) * 1e3

    def _live(self, active: np.ndarray) -> list[int]:
        """The active rows whose grammar still goes on (a beam its grammar refused is dead)."""
        if len(self.matchers) == 1:  # one row (a server request's, a batch-1 call): no index arrays
            return [0] if active[0] and not self.matchers[0].dead else []
        return [b for b in np.flatnonzero(active).tolist() if not self.matchers[b].dead]

    def _assemble(self, active: np.ndarray, live: list[int], allowed: np.ndarray) -> np.ndarray:
        """The (B, W) mask from the live rows' (len(live), V) allowed tokens (the rest: inactive rows allow every
        token, dead ones none), in the head's columns; a row the trimmed head leaves without a token is refused."""
        B = len(self.matchers)
        if len(live) == B:  # every row live (a server request's one row): the engine's rows as they are
            full = allowed
        else:
            full = np.ones((B, self.matchers[0].compiled.vocab_size), dtype=bool)
            full[[b for b in np.flatnonzero(active).tolist() if self.matchers[b].dead]] = False
            if live:
                full[live] = allowed
        if self.columns is None:
            return full
        kept = full[:, self.columns.ids]
        stuck = [b for b in live if full[b].any() and not kept[b].any()]
        if stuck:  # the grammar's next token is one the trimmed head dropped
            needed = np.flatnonzero(full[stuck[0]])[:5].tolist()
            raise ConstraintError(
                f"The constraint needs token(s) {needed} here, which this vocabulary-trimmed head dropped; use the "
                "untrimmed export, or trim with these tokens kept."
            )
        return kept

    def follow(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Beam search: new row i continues old row rows[i] with tokens[i]. A beam whose token its grammar cannot
        take (an end token, or one the beam search kept at score -inf) gets no allowed token: it ends there."""
        new = []
        for r, t in zip(rows.tolist(), tokens.tolist()):
            m = self.matchers[r].copy()
            if t in self.eos_ids or not m.try_advance(t):
                m.dead = True
            new.append(m)
        self.matchers = new

    def advance(self, row: int, token: int) -> bool:
        """Feed the row's sampled token; True when the grammar is now complete (nothing may follow)."""
        m = self.matchers[row]
        m.advance(token)
        return m.done


def prefetch_batch(groups: Sequence[tuple[ConstrainedRows, np.ndarray]], rows_in_step: int) -> None:
    """prefetch() for several groups (a server step's requests, each with its active rows): their masks in ONE
    background task, one engine call for all their rows (its thread pool, the GIL released) and one unpacking per
    constraint (requests with the same schema share one), instead of a task each: per-request tasks held the GIL
    for their NumPy work sixteen times a step and each paid a thread's handoff, on the cores ONNX Runtime's step
    runs on. Each group's masks() collects its own masks (or the error its rows hit: it alone fails)."""
    if len(groups) == 1:
        groups[0][0].prefetch(groups[0][1], rows_in_step)
        return
    if not groups:
        return
    jobs = [(rows, active.copy()) for rows, active in groups]
    future = _prefetcher.submit(_batch_masks, jobs)
    for i, (rows, active) in enumerate(jobs):
        rows._pending = (active, future, i)


def _batch_masks(jobs: list[tuple[ConstrainedRows, np.ndarray]]) -> list[np.ndarray | Exception]:
    """prefetch_batch's task: per group, its (B, W) masks or the exception computing them raised."""
    start = time.thread_time()
    live = [rows._live(active) for rows, active in jobs]
    matchers = [[rows.matchers[b] for b in ids] for (rows, _), ids in zip(jobs, live)]
    words = _engine_words([m for ms in matchers for m in ms])  # per live row: its packed mask (None: failed)
    first = np.cumsum([0] + [len(ms) for ms in matchers])  # group g's rows: words[first[g]:first[g + 1]]
    # groups of one constraint and end tokens (a server's requests with the same schema) unpacked together
    same: dict[tuple, list[int]] = {}
    for g, ((rows, _), ms) in enumerate(zip(jobs, matchers)):
        if ms:
            same.setdefault((id(ms[0].compiled), rows.eos_ids), []).append(g)
    allowed: dict[int, np.ndarray | Exception] = {}
    for (_, eos_ids), groups in same.items():
        rows_of = [words[r] for g in groups for r in range(first[g], first[g + 1])]
        try:
            if any(w is None for w in rows_of):
                raise ValueError("the engine call failed")
            bits = masks_from_words([m for g in groups for m in matchers[g]], np.stack(rows_of), eos_ids)
            at = np.cumsum([0] + [len(matchers[g]) for g in groups])
            allowed.update((g, bits[at[k] : at[k + 1]]) for k, g in enumerate(groups))
        except Exception:  # one group's row failed (or the engine call): each group alone says whose
            for g in groups:
                try:
                    allowed[g] = allowed_masks(matchers[g], eos_ids)
                except Exception as e:
                    allowed[g] = e
    out: list[np.ndarray | Exception] = []
    for g, (rows, active) in enumerate(jobs):
        got = allowed.get(g, np.zeros((0, rows.matchers[0].compiled.vocab_size), dtype=bool))
        try:
            out.append(got if isinstance(got, Exception) else rows._assemble(active, live[g], got))
        except Exception as e:
            out.append(e)
    share_ms = (time.thread_time() - start) * 1e3 / max(1, int(first[-1]))
    for g, (rows, _) in enumerate(jobs):
        rows._mask_ms = share_ms * len(live[g])  # each group's share of the task (the handoff rule)
    return out


def _engine_words(matchers: list[RowMatcher]) -> list[np.ndarray | None]:
    """Each matcher's packed mask row (fill_words), one engine call per executor and engine vocabulary (one,
    unless tokenizers differ); None for the rows of a call that raised."""
    by_engine: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(matchers):
        by_engine.setdefault((id(m.compiled.executor), m.compiled.engine_vocab), []).append(i)
    words: list[np.ndarray | None] = [None] * len(matchers)
    for ids in by_engine.values():
        try:
            filled = fill_words([matchers[i] for i in ids])
        except Exception:
            continue
        for i, w in zip(ids, filled):
            words[i] = w
    return words
