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
_TOP_P_CANDIDATES = 256  # first guess at how many tokens hold top_p of the mass; doubled until they do


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


def top_k_candidates(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of each row, ties with the k-th kept like transformers: returns (ids, scores), unsorted.

    Rows are padded with -inf scores where ties make one row longer than another.
    """
    V = scores.shape[-1]
    if k <= 0 or k >= V:
        ids = np.broadcast_to(np.arange(V), scores.shape)
        return ids, scores
    part = np.argpartition(scores, V - k, axis=-1)[:, V - k :]  # (B, k) best, unordered
    kth = np.take_along_axis(scores, part, -1).min(-1, keepdims=True)  # (B, 1)
    n_keep = (scores >= kth).sum(-1)  # ties can add a few
    if (n_keep == k).all():
        return part, np.take_along_axis(scores, part, -1)
    width = int(n_keep.max())
    ids = np.zeros((scores.shape[0], width), dtype=np.int64)
    out = np.full((scores.shape[0], width), NEG_INF, dtype=scores.dtype)
    for b in range(scores.shape[0]):
        keep = np.flatnonzero(scores[b] >= kth[b])
        ids[b, : len(keep)] = keep
        out[b, : len(keep)] = scores[b, keep]
    return ids, out


def softmax(scores: np.ndarray) -> np.ndarray:
    m = scores.max(-1, keepdims=True)
    e = np.exp(scores - m)
    return e / e.sum(-1, keepdims=True)


def top_p_keep(sorted_probs: np.ndarray, top_p: float) -> np.ndarray:
    """Given probabilities sorted descending, keep the smallest prefix whose mass reaches top_p.

    transformers removes a token when the mass of all tokens ranked above it is already >= top_p; the best
    token is always kept.
    """
    mass_above = np.cumsum(sorted_probs, -1) - sorted_probs
    keep = mass_above < np.float32(top_p)
    keep[..., 0] = True
    return keep


def logsumexp(scores: np.ndarray) -> np.ndarray:
    m = scores.max(-1, keepdims=True)
    return m + np.log(np.exp(scores - m).sum(-1, keepdims=True))


def filter_candidates(scores: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-k then top-p over (B, V) scores; returns (ids, probs) of the kept tokens, probs renormalised.

    The full vocabulary is never sorted: top-k partitions first; top-p alone partitions a few hundred
    candidates and widens only if they hold less than top_p of the mass.
    """
    V = scores.shape[-1]
    ids, cand = top_k_candidates(scores, top_k)
    if top_p >= 1.0:
        return ids, softmax(cand)
    if 0 < top_k < V:
        # top-p measures mass over the distribution top-k left (transformers applies them in this order)
        pool_ids, pool_scores, total = ids, cand, logsumexp(cand)
    else:
        total = logsumexp(scores)  # (B, 1)
        n = min(_TOP_P_CANDIDATES, V)
        while True:
            pool_ids, pool_scores = top_k_candidates(scores, n)
            if n >= V or (np.exp(pool_scores - total).sum(-1) >= top_p).all():
                break
            n = min(4 * n, V)
    pool_probs = np.exp(pool_scores - total)
    order = np.argsort(-pool_probs, axis=-1, kind="stable")  # (B, n) with n << V
    keep = top_p_keep(np.take_along_axis(pool_probs, order, -1), top_p)
    ids = np.take_along_axis(pool_ids, order, -1)
    cand = np.where(keep, np.take_along_axis(pool_scores, order, -1), NEG_INF)
    return ids, softmax(cand)


def sample_from(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row by inverse CDF over the candidate set: (B, n) ids/probs -> (B,) token ids."""
    cdf = np.cumsum(probs, -1)
    u = rng.random(probs.shape[0]) * cdf[:, -1]
    pick = (cdf <= u[:, None]).sum(-1).clip(max=probs.shape[-1] - 1)
    return ids[np.arange(len(ids)), pick]


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
    scores = apply_temperature(scores, params.temperature)
    ids, probs = filter_candidates(scores, params.top_k, params.top_p)
    return sample_from(ids, probs, rng)
