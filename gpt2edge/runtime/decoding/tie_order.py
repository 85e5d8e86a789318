"""torch.topk's order among tied scores on CPU, for beam search's small selections (transformers 5.x).

Beam search rules candidates out by adding -1e9 in float32, where -1e9 - 5 == -1e9: the empty hypothesis slots
and the candidates that did not finish tie, and torch.topk's choice among them decides which sequences come
back when no real hypothesis scores above -1e9 (an extreme negative length_penalty, e.g. -20). That choice is
not "lowest index first": ATen's CPU topk runs std::nth_element and then std::sort (libstdc++'s introselect
and introsort) over (score, index) pairs compared by score alone. This module replays those two algorithms,
step for step, so that the same scores give the same indices; rows without ties take a plain stable sort.
"""

from __future__ import annotations

import numpy as np

_THRESHOLD = 16  # libstdc++'s _S_threshold: introsort leaves runs this short to insertion sort


def _lg(n: int) -> int:
    return n.bit_length() - 1


class _Seq:
    """A list of (score, index) pairs with libstdc++'s comparator for a descending topk: a before b iff a > b."""

    def __init__(self, scores: np.ndarray) -> None:
        self.v = [(float(s), i) for i, s in enumerate(scores)]

    def comp(self, i: int, j: int) -> bool:
        return self.v[i][0] > self.v[j][0]

    def swap(self, i: int, j: int) -> None:
        self.v[i], self.v[j] = self.v[j], self.v[i]

    def median_to_first(self, result: int, a: int, b: int, c: int) -> None:
        if self.comp(a, b):
            if self.comp(b, c):
                self.swap(result, b)
            elif self.comp(a, c):
                self.swap(result, c)
            else:
                self.swap(result, a)
        elif self.comp(a, c):
            self.swap(result, a)
        elif self.comp(b, c):
            self.swap(result, c)
        else:
            self.swap(result, b)

    def unguarded_partition(self, first: int, last: int, pivot: int) -> int:
        while True:
            while self.comp(first, pivot):
                first += 1
            last -= 1
            while self.comp(pivot, last):
                last -= 1
            if not first < last:
                return first
            self.swap(first, last)
            first += 1

    def partition_pivot(self, first: int, last: int) -> int:
        mid = first + (last - first) // 2
        self.median_to_first(first, first + 1, mid, last - 1)
        return self.unguarded_partition(first + 1, last, first)

    def linear_insert(self, last: int) -> None:
        val = self.v[last]
        nxt = last - 1
        while val[0] > self.v[nxt][0]:
            self.v[last] = self.v[nxt]
            last, nxt = nxt, nxt - 1
        self.v[last] = val

    def insertion_sort(self, first: int, last: int) -> None:
        if first == last:
            return
        for i in range(first + 1, last):
            if self.comp(i, first):
                val = self.v[i]
                self.v[first + 1 : i + 1] = self.v[first:i]
                self.v[first] = val
            else:
                self.linear_insert(i)

    def fallback_sort(self, first: int, last: int) -> None:
        """libstdc++ switches to heap sort past its depth limit; ties that deep are not replayed (stable)."""
        self.v[first:last] = sorted(self.v[first:last], key=lambda p: -p[0])

    def nth_element(self, first: int, nth: int, last: int) -> None:
        if first == last or nth == last:
            return
        depth = 2 * _lg(last - first)
        while last - first > 3:
            if depth == 0:
                self.fallback_sort(first, last)
                return
            depth -= 1
            cut = self.partition_pivot(first, last)
            if cut <= nth:
                first = cut
            else:
                last = cut
        self.insertion_sort(first, last)

    def introsort_loop(self, first: int, last: int, depth: int) -> None:
        while last - first > _THRESHOLD:
            if depth == 0:
                self.fallback_sort(first, last)
                return
            depth -= 1
            cut = self.partition_pivot(first, last)
            self.introsort_loop(cut, last, depth)
            last = cut

    def sort(self, first: int, last: int) -> None:
        if first == last:
            return
        self.introsort_loop(first, last, 2 * _lg(last - first))
        if last - first > _THRESHOLD:
            self.insertion_sort(first, first + _THRESHOLD)
            for i in range(first + _THRESHOLD, last):
                self.linear_insert(i)
        else:
            self.insertion_sort(first, last)


def torch_topk_row(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of one row, in torch.topk's (CPU, sorted=True) order, ties included."""
    n = scores.size
    if np.unique(scores).size == n or k * 64 <= n:
        # no ties: the order is the scores' (k * 64 <= n is ATen's partial_sort path, not replayed: stable)
        return np.argsort(-scores, kind="stable")[:k]
    seq = _Seq(scores)
    seq.nth_element(0, k - 1, n)
    seq.sort(0, k - 1)
    return np.array([i for _, i in seq.v[:k]], dtype=np.int64)


def torch_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """(P, N) -> (P, k) indices, row by row as torch_topk_row."""
    return np.stack([torch_topk_row(row, k) for row in scores]) if len(scores) else np.empty((0, k), np.int64)
