"""Beam search bookkeeping in NumPy, step for step transformers' `_beam_search` (5.x), so that the same
log-probs give the same sequences and scores.

Per prompt p there are num_beams running beams (rows p*num_beams .. of the model's batch) and num_beams
finished hypotheses. Each step:
  1. every running beam's score plus each token's log-prob gives num_beams * V candidates; keep the best
     K = max(2, 1 + n_eos) * num_beams (K > num_beams so that num_beams can go on even when the best ones end);
  2. the best num_beams candidates that did not stop (EOS, stop string, max length) become the running beams;
  3. candidates among the best num_beams that stopped are scored sum(log-probs) / generated_len ** length_penalty
     and replace worse hypotheses;
  4. the early-stop heuristic decides whether a prompt can still improve (early_stopping True / False / "never").
transformers adds -1e9 to rule candidates out instead of masking; so does this, in float32, so that ties and
order come out the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gpt2edge.runtime.decoding.tie_order import torch_topk
from gpt2edge.runtime.decoding.top_k import top_k_pool
from gpt2edge.runtime.model.columns import Columns

BIG = np.float32(1e9)  # transformers' "very large" score offset


def length_divisor(n: int, length_penalty: float) -> np.float32:
    """n ** length_penalty as the float32 that torch divides by: inf past float32's range and 0 below it, never
    Python's OverflowError (length_penalty 1e308) nor numpy's overflow warning."""
    try:
        x = float(n) ** length_penalty
    except OverflowError:
        x = math.inf
    with np.errstate(over="ignore"):
        return np.float32(x)


def _divide(scores: np.ndarray, divisor: np.float32) -> np.ndarray:
    """scores / divisor as torch computes it: -x / 0 = -inf and -x / inf = -0, without RuntimeWarnings."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        return scores / divisor


def top_k_sorted(scores: np.ndarray, k: int) -> np.ndarray:
    """(P, N) -> (P, k) column indices of the k best scores per row, best first (torch.topk's order); ties go
    to the lower index. A threshold pass finds the few candidates (top_k.top_k_pool, which keeps every tie
    with the k-th); only those are sorted, never the whole num_beams * vocab row."""
    out = np.empty((len(scores), k), dtype=np.int64)
    for p, row in enumerate(scores):
        ids = top_k_pool(row, k) if k < row.size else np.arange(row.size)
        out[p] = ids[np.lexsort((ids, -row[ids]))[:k]]  # by score descending, then index ascending
    return out


def gather(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """transformers' _gather_beams: out[p, j, ...] = a[p, idx[p, j], ...] for (P, N, ...) arrays, (P, M) indices."""
    return a[np.arange(len(idx))[:, None], idx]


class BeamSearch:
    """The state of a beam search over P prompts. `step` takes the running beams' processed log-probs and
    returns which rows the new beams continue and their new tokens; `best` gives the final hypotheses."""

    def __init__(
        self,
        n_prompts: int,
        num_beams: int,
        max_new_tokens: int,
        n_eos: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        fill: int = 0,
    ) -> None:
        P, nb = n_prompts, num_beams
        self.num_beams, self.max_new_tokens = nb, max_new_tokens
        self.length_penalty, self.early_stopping = float(length_penalty), early_stopping
        self.k = max(2, 1 + n_eos) * nb
        self.t = 0  # tokens generated so far (transformers' cur_len - decoder_prompt_len)
        self.running = np.full((P, nb, max_new_tokens), fill, dtype=np.int64)  # generated tokens of each beam
        # only beam 0 starts alive: the beams are copies of one prompt, so they must not pick the same tokens
        self.running_scores = np.zeros((P, nb), dtype=np.float32)
        self.running_scores[:, 1:] = -BIG
        self.sequences = self.running.copy()  # finished hypotheses
        self.scores = np.full((P, nb), -BIG, dtype=np.float32)
        self.lengths = np.zeros((P, nb), dtype=np.int64)
        self.finished = np.zeros((P, nb), dtype=bool)
        self.improvable = np.ones((P, 1), dtype=bool)  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def step(
        self, logprobs: np.ndarray, stopped: Callable[[np.ndarray], np.ndarray], columns: Columns | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(P*nb, V) log-probs of the running beams ((P*nb, K) columns of a trimmed head, with `columns`);
        stopped((P, K, t+1) generated tokens) -> (P, K) bool says which candidates end here. Returns (P*nb,)
        rows the new beams continue and (P*nb,) their new tokens (full ids)."""
        P, nb = self.running_scores.shape
        V, t, k = logprobs.shape[1], self.t, self.k
        # 1. the best K continuations over all beams of each prompt
        total = (logprobs.reshape(P, nb, V) + self.running_scores[:, :, None]).reshape(P, nb * V)
        if columns is not None and np.count_nonzero(total > -np.inf, axis=1).min() < k:
            # fewer possible candidates than K: the full row fills up with -inf ones by (beam, id), dropped ids too
            return self.step(columns.full(logprobs), stopped)
        top = top_k_sorted(total, k)  # (P, K); (beam, column) orders as (beam, id): the map is increasing
        top_scores = gather(total, top)
        src_beam, tokens = top // V, top % V
        tokens = tokens if columns is None else columns.ids[tokens]
        top_seqs = gather(self.running, src_beam)  # (P, K, max_new)
        top_seqs[:, :, t] = tokens
        src_rows = src_beam + np.arange(P)[:, None] * nb  # rows of the model's batch
        hits = np.asarray(stopped(top_seqs[:, :, : t + 1]), dtype=bool)  # (P, K)
        # 2. the best num_beams that go on
        alive = top_scores - hits.astype(np.float32) * BIG
        keep = torch_topk(alive, nb)  # ties (many -1e9) in torch.topk's order, as transformers picks
        self.running = gather(top_seqs, keep)
        self.running_scores = gather(alive, keep)
        rows = gather(src_rows, keep)
        # 3. the best num_beams that stopped become hypotheses, if better than the worst kept
        self._finish(top_seqs, top_scores, hits)
        # 4. can any prompt still improve?
        self.t = t + 1
        self._check_early_stop()
        all_full = bool(self.finished.all()) and self.early_stopping is True
        self.done = not (self.improvable.any() and not all_full and not hits.all())
        return rows.ravel(), self.running[:, :, t].ravel()

    def _finish(self, top_seqs: np.ndarray, top_scores: np.ndarray, hits: np.ndarray) -> None:
        nb, k = self.num_beams, self.k
        just_finished = hits & (np.arange(k) < nb)[None, :]
        scores = _divide(top_scores, length_divisor(self.t + 1, self.length_penalty))
        full = self.finished.all(axis=1, keepdims=True) & (self.early_stopping is True)
        scores = scores - full.astype(np.float32) * BIG  # early_stopping=True: a full prompt takes no more
        scores = scores - (~self.improvable).astype(np.float32) * BIG
        scores = scores - (~just_finished).astype(np.float32) * BIG  # running candidates are not hypotheses
        merged_scores = np.concatenate([self.scores, scores], axis=1)
        best = torch_topk(merged_scores, nb)  # empty slots and running candidates tie at -1e9
        self.scores = gather(merged_scores, best)
        self.sequences = gather(np.concatenate([self.sequences, top_seqs], axis=1), best)
        lengths = np.full(hits.shape, self.t + 1, dtype=np.int64)
        self.lengths = gather(np.concatenate([self.lengths, lengths], axis=1), best)
        self.finished = gather(np.concatenate([self.finished, just_finished], axis=1), best)

    def _check_early_stop(self) -> None:
        """transformers' _check_early_stop_heuristic: the best running beam, scored at its best possible
        length, against the worst hypothesis kept (any empty slot keeps the prompt open)."""
        lp = self.length_penalty
        best_len = self.max_new_tokens if self.early_stopping == "never" and lp > 0 else self.t
        best_possible = _divide(self.running_scores[:, :1], length_divisor(best_len, lp))
        worst = np.where(self.finished, self.scores.min(axis=1, keepdims=True), -BIG)
        self.improvable &= (best_possible > worst).any(axis=1, keepdims=True)

    def best(self, n: int) -> list[list[tuple[list[int], float]]]:
        """Per prompt, the n best hypotheses (tokens, score), best first."""
        return [
            [(self.sequences[p, j, : self.lengths[p, j]].tolist(), float(self.scores[p, j])) for j in range(n)]
            for p in range(len(self.scores))
        ]

    def interrupted(self, n: int) -> list[list[tuple[list[int], float, bool]]]:
        """After Ctrl-C: per prompt the n best of the hypotheses and the running beams (scored as if they ended
        now), each with a flag that says whether it had finished."""
        out = []
        lp_div = length_divisor(max(self.t, 1), self.length_penalty)
        for p in range(len(self.scores)):
            run = _divide(self.running_scores[p], lp_div)
            pool = [
                (self.scores[p, j], self.sequences[p, j, : self.lengths[p, j]], True) for j in range(self.num_beams)
            ]
            pool += [(run[j], self.running[p, j, : self.t], False) for j in range(self.num_beams)]
            pool = [c for c in pool if c[0] > -BIG / 2]  # empty slots and never-started beams
            pool.sort(key=lambda c: -c[0])
            out.append([(seq.tolist(), float(s), fin) for s, seq, fin in pool[:n]])
        return out
