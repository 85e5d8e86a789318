"""Balanced k-means over the head's rows: the clusters of the approximate (adaptive-softmax-style) sparse head.

Each of the K clusters holds at most S = ceil(V / K) rows, so every decode step reads the same number of rows
(M probed clusters x S) and the runtime graph has fixed shapes. Plain k-means on a trained table is lopsided
(rare tokens collapse together: on trained-gpt2-py one cluster in 512 holds 2.5x the mean), which would make a
padded graph read the largest cluster's size for every probe. Assignment is Lloyd's step with a capacity: each
row proposes to its nearest clusters in order and a cluster keeps the nearest proposers that fit.
A cluster's centroid is the mean of its rows, so h . centroid is the mean of its rows' logits: the best row of
a probed cluster scores at least that, and the runtime uses it as the estimated logit of every row it skips.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ITERATIONS = 8
CHOICES = 16  # nearest clusters a row proposes to before it takes any cluster with room
CHUNK = 4096  # rows per distance block: CHUNK x K float32 at a time


@dataclass(frozen=True)
class Clusters:
    """assign (V,) cluster of each row; centroids (K, C) float32 means of their rows (zeros when empty);
    size S, the capacity of every cluster."""

    assign: np.ndarray
    centroids: np.ndarray
    size: int

    def members(self) -> np.ndarray:
        """(K, S) int64 row ids per cluster, padded with V (a row that does not exist)."""
        V, K = len(self.assign), len(self.centroids)
        out = np.full((K, self.size), V, dtype=np.int64)
        order = np.argsort(self.assign, kind="stable")
        counts = np.bincount(self.assign, minlength=K)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        slot = np.arange(V) - np.repeat(starts, counts)  # each row's place inside its cluster
        out[self.assign[order], slot] = order
        return out


def _nearest(w: np.ndarray, c: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(V, n) ids and squared distances of each row's n nearest centroids, nearest first, block by block."""
    cc = (c.astype(np.float64) ** 2).sum(1)
    ids = np.empty((len(w), n), dtype=np.int64)
    dist = np.empty((len(w), n), dtype=np.float64)
    for lo in range(0, len(w), CHUNK):
        blk = w[lo : lo + CHUNK].astype(np.float64)
        d = (blk**2).sum(1)[:, None] - 2 * blk @ c.T.astype(np.float64) + cc[None]  # (b, K)
        part = np.argpartition(d, n - 1, axis=1)[:, :n] if n < d.shape[1] else np.tile(np.arange(n), (len(d), 1))
        pd = np.take_along_axis(d, part, 1)
        order = np.argsort(pd, axis=1)
        ids[lo : lo + len(d)] = np.take_along_axis(part, order, 1)
        dist[lo : lo + len(d)] = np.take_along_axis(pd, order, 1)
    return ids, dist


def _propose(assign: np.ndarray, room: np.ndarray, rows: np.ndarray, cand: np.ndarray, dist: np.ndarray) -> None:
    """One round: unassigned `rows` propose to `cand` (one each); each cluster keeps its nearest that fit."""
    order = np.lexsort((dist, cand))  # by cluster, nearest first
    c = cand[order]
    first = np.searchsorted(c, c, side="left")
    rank = np.arange(len(c)) - first  # place in its cluster's queue
    take = rank < room[c]
    assign[rows[order[take]]] = c[take]
    room -= np.bincount(c[take], minlength=len(room))


def balanced_assign(w: np.ndarray, c: np.ndarray, size: int) -> np.ndarray:
    """(V,) cluster of each row, at most `size` rows per cluster, rows placed near their centroids."""
    V, K = len(w), len(c)
    n = min(CHOICES, K)
    ids, dist = _nearest(w, c, n)
    assign = np.full(V, -1, dtype=np.int64)
    room = np.full(K, size, dtype=np.int64)
    for j in range(n):
        rows = np.flatnonzero(assign < 0)
        if not len(rows):
            break
        _propose(assign, room, rows, ids[rows, j], dist[rows, j])
    while (rows := np.flatnonzero(assign < 0)).size:  # the few left over: the nearest cluster with room
        open_ = np.flatnonzero(room > 0)
        sub_ids, sub_d = _nearest(w[rows], c[open_], 1)
        _propose(assign, room, rows, open_[sub_ids[:, 0]], sub_d[:, 0])
    return assign


def centroids_of(w: np.ndarray, assign: np.ndarray, k: int) -> np.ndarray:
    """(K, C) float32 mean row of each cluster (float64 sums; an empty cluster's is zero)."""
    sums = np.zeros((k, w.shape[1]), dtype=np.float64)
    counts = np.bincount(assign, minlength=k)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    full = counts > 0
    sums[full] = np.add.reduceat(w[np.argsort(assign, kind="stable")].astype(np.float64), starts[full], axis=0)
    return (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)


def cluster_rows(w: np.ndarray, k: int, seed: int = 0, iterations: int = ITERATIONS) -> Clusters:
    """Balanced k-means of the (V, C) rows into k clusters (seeded: the same table gives the same clusters)."""
    V = len(w)
    size = -(-V // k)
    rng = np.random.default_rng(seed)
    c = w[rng.choice(V, k, replace=False)].astype(np.float32)
    assign = np.zeros(V, dtype=np.int64)
    for _ in range(iterations):
        assign = balanced_assign(w, c, size)
        c = centroids_of(w, assign, k)
    return Clusters(assign, centroids_of(w, assign, k), size)
