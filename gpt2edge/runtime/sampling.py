"""Next-token selection as small pure NumPy functions: scores -> filtered scores -> probabilities -> token.

Semantics follow transformers' logits processors (RepetitionPenalty, Temperature, TopK, TopP, MinNewTokens).
The graph returns log-probabilities; every filter here is shift-invariant per row except the repetition
penalty, which (like transformers' processor) divides positive scores and multiplies negative ones: on
log-probabilities, which are never positive, a penalised token's score is multiplied.

Top-k and top-p never sort the whole vocabulary: argpartition picks the candidates and only those are sorted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpt2edge.errors import GenerationError

NEG_INF = np.float32(-np.inf)
# score margins below the best token tried in turn when collecting candidates (then: the whole vocabulary)
_POOL_MARGINS = (12.0, 24.0, 48.0)


@dataclass(frozen=True)
class SamplingParams:
    """What transformers' GenerationConfig calls these, with its defaults. temperature 0 means greedy."""

    max_new_tokens: int = 32
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_id: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        # raised before any model work, each naming the bad value and the valid range
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}.")
        if self.min_new_tokens < 0:
            raise GenerationError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}.")
        if not self.temperature >= 0 or not np.isfinite(self.temperature):
            raise GenerationError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}.")
        if not self.repetition_penalty > 0 or not np.isfinite(self.repetition_penalty):
            raise GenerationError(f"repetition_penalty must be > 0 (1.0 disables it), got {self.repetition_penalty}.")
        if any(not s for s in self.stop):
            raise GenerationError("Stop strings must not be empty.")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0 or self.top_k == 1


def apply_repetition_penalty(scores: np.ndarray, seen: Sequence[np.ndarray], penalty: float) -> np.ndarray:
    """(B, V) scores; seen[b] holds the token ids of row b so far (prompt + generated)."""
    if penalty == 1.0:
        return scores
    scores = scores.copy()
    for b, ids in enumerate(seen):
        ids = np.unique(ids)
        s = scores[b, ids]
        scores[b, ids] = np.where(s < 0, s * penalty, s / penalty)
    return scores


def apply_temperature(scores: np.ndarray, temperature: float) -> np.ndarray:
    return scores if temperature == 1.0 else scores / np.float32(temperature)


def suppress_tokens(scores: np.ndarray, token_ids: Sequence[int]) -> np.ndarray:
    """Make tokens impossible (min_new_tokens suppresses EOS this way)."""
    if not len(token_ids):
        return scores
    scores = scores.copy()
    scores[:, list(token_ids)] = NEG_INF
    return scores


def softmax(scores: np.ndarray) -> np.ndarray:
    m = scores.max(-1, keepdims=True)
    e = np.exp(scores - m)
    return e / e.sum(-1, keepdims=True)


def logsumexp(scores: np.ndarray) -> float:
    m = scores.max()
    return float(m + np.log(np.exp(scores - m).sum()))


def _pool_above(row: np.ndarray, enough) -> np.ndarray:
    """Ids of the tokens within a margin of the best one, widening the margin until `enough(pool)` holds.

    Cheap (one compare over the vocabulary) and exact: the callers only need a superset of their answer.
    """
    best = row.max()
    for margin in _POOL_MARGINS:
        pool = np.flatnonzero(row >= best - margin)
        if enough(pool):
            return pool
    return np.arange(row.size)


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k best scores of one row; ties with the k-th are kept, like transformers' TopK.

    A strided sample of the row gives a threshold that about 4k tokens pass; if at least k do, the exact
    top-k is taken among those few (a flat distribution, where a score margin keeps everything, stays fast);
    otherwise the whole row is partitioned.
    """
    V = row.size
    if k <= 0 or k >= V:
        return np.arange(V)
    stride = max(1, V // max(4 * k, 1) // 4)  # ~16k samples per row would be wasteful: ~16 x k of them
    sample = row[::stride]
    rank = min(len(sample) - 1, 4 * -(-k // stride))
    threshold = np.partition(sample, len(sample) - 1 - rank)[len(sample) - 1 - rank]
    pool = np.flatnonzero(row >= threshold)
    if len(pool) < k:
        pool = np.arange(V)
    vals = row[pool]
    if len(pool) > k:
        kth = np.partition(vals, len(vals) - k)[len(vals) - k]
        pool = pool[vals >= kth]
    return pool


def top_p_keep(sorted_probs: np.ndarray, top_p: float) -> np.ndarray:
    """Given probabilities sorted descending, keep the smallest prefix whose mass reaches top_p.

    transformers removes a token when the mass of all tokens ranked above it is already >= top_p; the best
    token is always kept.
    """
    mass_above = np.cumsum(sorted_probs, dtype=np.float64) - sorted_probs
    keep = mass_above < top_p
    keep[0] = True
    return keep


def row_candidates(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Temperature, top-k, top-p on one row of scores -> (ids, renormalised probs) of the kept tokens.

    Temperature (> 0) is monotonic, so the top-k set is chosen on the raw scores and only the candidates are
    scaled. The full vocabulary is never sorted: only candidates are.
    """
    V = row.size
    if 0 < top_k < V:
        ids = top_k_ids(row, top_k)
        scaled = row[ids] / np.float32(temperature)
        log_z = logsumexp(scaled)  # top-p mass is measured over what top-k left, as transformers does
    else:
        full = row / np.float32(temperature)
        log_z = logsumexp(full)
        if top_p >= 1.0:
            return np.arange(V), np.exp(full - log_z)
        # a pool holding top_p of the mass contains the nucleus
        ids = _pool_above(full, lambda p: np.exp(full[p] - log_z).sum() >= top_p)
        scaled = full[ids]
    if top_p < 1.0:
        order = np.argsort(-scaled, kind="stable")
        ids, scaled = ids[order], scaled[order]
        keep = top_p_keep(np.exp(scaled.astype(np.float64) - log_z), top_p)
        ids, scaled = ids[keep], scaled[keep]
    probs = np.exp(scaled - scaled.max())
    return ids, probs / probs.sum()


def filter_candidates(scores: np.ndarray, top_k: int, top_p: float, temperature: float = 1.0):
    """row_candidates over a (B, V) batch, padded into (B, n) ids and probs (padding has probability 0)."""
    rows = [row_candidates(r, temperature, top_k, top_p) for r in scores]
    n = max(len(ids) for ids, _ in rows)
    ids = np.zeros((len(rows), n), dtype=np.int64)
    probs = np.zeros((len(rows), n), dtype=np.float32)
    for b, (i, p) in enumerate(rows):
        ids[b, : len(i)] = i
        probs[b, : len(p)] = p
    return ids, probs


def sample_index(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw by inverse CDF: the first index whose cumulative probability exceeds a uniform number."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(probs) - 1)


def next_tokens(
    scores: np.ndarray,
    params: SamplingParams,
    seen: Sequence[np.ndarray],
    n_generated: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """(B, V) log-probs -> (B,) next token ids, applying the processors in transformers' order."""
    scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    if n_generated < params.min_new_tokens:
        scores = suppress_tokens(scores, params.eos_token_id)
    if params.greedy:
        return scores.argmax(-1)
    out = np.empty(len(scores), dtype=np.int64)
    for b, row in enumerate(scores):
        ids, probs = row_candidates(row, params.temperature, params.top_k, params.top_p)
        out[b] = ids[sample_index(probs, rng)]
    return out
