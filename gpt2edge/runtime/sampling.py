"""Next-token selection as small pure NumPy functions that agree with transformers' logits processors.

`next_tokens` applies them in the order of transformers' `GenerationMixin._get_logits_processor`, one line each:
processors on the whole (B, V) batch (repetition penalty, no-repeat n-grams, bad words, min new tokens), then,
when sampling, warpers on each row (temperature, top-k, top-p, min-p, typical-p). Same float32 arithmetic and
boundary rules as transformers, so the kept token set is the one it keeps and probabilities agree within 1e-6;
only a token within transformers' own float32 rounding (a few 1e-6 of mass) of a threshold may go either way.

A warper works on one row's surviving tokens as (ids, vals): every token not in `ids` has score -inf. Top-k,
top-p and typical-p sort only a candidate pool that provably holds their answer (on a peaked row, a few tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.sampling_params import SamplingParams

__all__ = ["SamplingParams", "apply_processors", "next_tokens", "sample_index", "softmax", "warp_row"]

NEG_INF = np.float32(-np.inf)
_SMALL = 256  # rows this short are sorted whole
_BINS = 64  # half-nat bins of the top-p pool histogram: 32 nats below the best token, then one for the rest
_BLOCK = 1024  # sample_index's block length on long rows


# ---- processors: (B, V) scores and each row's history (prompt + generated ids) -> (B, V) scores -------------


def apply_repetition_penalty(scores: np.ndarray, seen: Sequence[np.ndarray], penalty: float) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor: a seen token's score is divided by the penalty if positive, else
    multiplied (the graph's log-probs are never positive, so they are multiplied), in float32."""
    if penalty == 1.0:
        return scores
    scores = scores.copy()
    p = np.float32(penalty)
    for b, ids in enumerate(seen):
        ids = np.unique(ids)
        ids = ids[ids < scores.shape[1]]  # ids past the output vocabulary cannot be generated: skipped
        s = scores[b, ids]
        scores[b, ids] = np.where(s < 0, s * p, s / p)
    return scores


def banned_ngram_tokens(history: np.ndarray, n: int) -> np.ndarray:
    """Tokens that would complete an n-gram already in `history` (NoRepeatNGramLogitsProcessor's rule)."""
    if n <= 0 or len(history) < n:
        return np.empty(0, np.int64)
    windows = sliding_window_view(np.asarray(history), n)  # (L - n + 1, n)
    prefix = history[len(history) - n + 1 :]  # the n - 1 last tokens
    return windows[(windows[:, :-1] == prefix).all(1), -1]


def apply_no_repeat_ngram(scores: np.ndarray, seen: Sequence[np.ndarray], n: int) -> np.ndarray:
    """NoRepeatNGramLogitsProcessor: no n-gram of the history (prompt included) occurs twice."""
    if n <= 0:
        return scores
    scores = scores.copy()
    for b, ids in enumerate(seen):
        banned = banned_ngram_tokens(np.asarray(ids), n)
        scores[b, banned[banned < scores.shape[1]]] = NEG_INF
    return scores


def banned_bad_word_tokens(history: np.ndarray, bad_words_ids: Sequence[Sequence[int]]) -> list[int]:
    """Last tokens of the bad sequences whose prefix ends the history (a one-token sequence is always banned)."""
    out = []
    for seq in bad_words_ids:
        k = len(seq) - 1
        if k == 0 or (k <= len(history) and tuple(history[len(history) - k :]) == tuple(seq[:-1])):
            out.append(seq[-1])
    return out


def apply_bad_words(
    scores: np.ndarray, seen: Sequence[np.ndarray], bad_words_ids: Sequence[Sequence[int]], eos: Sequence[int]
) -> np.ndarray:
    """NoBadWordsLogitsProcessor: no bad sequence is completed. Like transformers, a one-token bad word that is
    an EOS id is dropped (banning EOS is min_new_tokens' job)."""
    bad = [s for s in bad_words_ids if not (len(s) == 1 and s[0] in eos)]
    if not bad:
        return scores
    scores = scores.copy()
    for b, ids in enumerate(seen):
        scores[b, banned_bad_word_tokens(np.asarray(ids), bad)] = NEG_INF
    return scores


def apply_min_new_tokens(scores: np.ndarray, n_generated: int, min_new_tokens: int, eos: Sequence[int]) -> np.ndarray:
    """MinNewTokensLengthLogitsProcessor: EOS is impossible until min_new_tokens tokens were generated."""
    if n_generated >= min_new_tokens or not len(eos):
        return scores
    scores = scores.copy()
    scores[:, list(eos)] = NEG_INF
    return scores


# ---- warpers: one row's surviving tokens (ids, float32 vals) -> the tokens they keep ------------------------
# ids None means every token of the row (vals is then the whole row): the common top-k path never builds them.


def _take(ids: np.ndarray | None, vals: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep positions `keep` (indices or a mask into vals) of the surviving tokens."""
    keep = np.flatnonzero(keep) if keep.dtype == bool else keep
    return (keep if ids is None else ids[keep]), vals[keep]


def softmax(vals: np.ndarray) -> np.ndarray:
    """float32 softmax as torch computes it: shift by the max, exp, multiply by the reciprocal of the sum
    (the sum accumulated in float64: torch's float32 lane sums are close to exact, NumPy's float32 one less so)."""
    e = np.exp(vals - vals.max())
    return e * (np.float32(1.0) / np.float32(e.sum(dtype=np.float64)))


def apply_temperature(row: np.ndarray, temperature: float) -> np.ndarray:
    """TemperatureLogitsWarper: float32 division, as torch divides a float32 tensor by a Python float. A
    temperature so small (1e-45) that every score overflows to -inf gives its T -> 0 limit, the best token(s),
    where torch would have nothing left to sample."""
    if temperature == 1.0:
        return row
    with np.errstate(over="ignore"):  # overflow to -inf is the division's honest float32 result
        out = row / np.float32(temperature)
    if out.max() == NEG_INF and row.max() > NEG_INF:
        out = np.where(row == row.max(), np.float32(0.0), NEG_INF).astype(np.float32)
    return out


def top_k_pool(vals: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest vals plus every tie with the k-th (TopKLogitsWarper removes only vals < k-th).

    A strided sample gives a threshold that about 4k values pass; if at least k do, the k-th value is among
    them (exact); otherwise the whole row is partitioned.
    """
    n = vals.size
    stride = max(1, n // (16 * k))
    sample = vals[::stride]
    rank = min(len(sample) - 1, 4 * -(-k // stride))
    pool = np.flatnonzero(vals >= np.partition(sample, len(sample) - 1 - rank)[len(sample) - 1 - rank])
    if len(pool) < k:
        pool = np.arange(n)
    kth = np.partition(vals[pool], len(pool) - k)[len(pool) - k]
    return pool[vals[pool] >= kth]


def apply_top_k(ids: np.ndarray | None, vals: np.ndarray, k: int) -> tuple[np.ndarray | None, np.ndarray]:
    """TopKLogitsWarper: keep the k best (and ties with the k-th); 0 disables it."""
    if k <= 0 or k >= vals.size:
        return ids, vals
    return _take(ids, vals, top_k_pool(vals, k))


def _top_p_pool(vals: np.ndarray, probs: np.ndarray, threshold: np.float32) -> tuple[np.ndarray | None, float]:
    """(indices of the best tokens or None for all, float64 mass of the rest) with that rest all removed by top-p.

    transformers removes a token when the float32 cumulative mass of it and every token below it is <= 1 - top_p;
    the token just below the pool has exactly the rest's mass, so the pool holds the answer when that passes.
    A histogram of the mass by distance below the best score (half-nat bins) gives the pool in one pass.
    """
    if vals.size <= _SMALL:
        return None, 0.0
    total = probs.sum(dtype=np.float64)
    bins = np.minimum((vals.max() - vals) * np.float32(2), np.float32(_BINS)).astype(np.intp)  # -inf: last bin
    rest_after = total - np.cumsum(np.bincount(bins, weights=probs, minlength=_BINS + 1))
    for b in range(int(np.argmax(rest_after <= threshold)), _BINS):
        pool = np.flatnonzero(bins <= b)
        rest = total - probs[pool].sum(dtype=np.float64)
        if np.float32(rest) <= threshold:
            return pool, max(rest, 0.0)
    return None, 0.0  # the last bin: every token


def apply_top_p(ids: np.ndarray | None, vals: np.ndarray, top_p: float) -> tuple[np.ndarray | None, np.ndarray]:
    """TopPLogitsWarper: softmax in float32, sort ascending, cumulative sum accumulated in float64 (torch's CPU
    cumsum) rounded to float32, remove where <= float32(1 - top_p); the best token is always kept."""
    if top_p >= 1.0:
        return ids, vals
    probs = softmax(vals)
    threshold = np.float32(1.0 - top_p)
    pool, rest = _top_p_pool(vals, probs, threshold)
    # ascending; among ties the lower id comes first (is removed first)
    order = np.argsort(vals, kind="stable") if pool is None else pool[np.argsort(vals[pool], kind="stable")]
    cum = (rest + np.cumsum(probs[order], dtype=np.float64)).astype(np.float32)  # non-decreasing
    n_removed = min(int(np.searchsorted(cum, threshold, side="right")), len(order) - 1)  # cum <= threshold
    return _take(ids, vals, order[n_removed:])


def apply_min_p(ids: np.ndarray | None, vals: np.ndarray, min_p: float | None) -> tuple[np.ndarray | None, np.ndarray]:
    """MinPLogitsWarper: remove tokens whose float32 probability is < min_p x the best one's; None disables it."""
    if min_p is None:
        return ids, vals
    probs = softmax(vals)
    keep = ~(probs < np.float32(min_p) * probs.max())
    keep[probs.argmax()] = True
    return _take(ids, vals, keep)


def apply_typical_p(ids: np.ndarray | None, vals: np.ndarray, mass: float) -> tuple[np.ndarray | None, np.ndarray]:
    """TypicalLogitsWarper: rank tokens by |-log p - entropy|, keep the best ranks up to `mass` (ties with the last
    kept score stay); 1.0 disables it. Only a pool of the best-ranked tokens is sorted."""
    if mass >= 1.0:
        return ids, vals
    m = vals.max()
    normalized = (vals - m) - np.float32(np.log(np.exp(vals - m).sum(dtype=np.float64)))  # float32 log_softmax
    p = np.exp(normalized)
    ent = -np.nansum(normalized * p, dtype=np.float32)  # -inf * 0 is nan: skipped, like torch.nansum
    shifted = np.abs(-normalized - ent)
    probs = softmax(vals)
    limit = np.float32(mass)
    k = min(_SMALL, vals.size)
    while True:
        # the k best-ranked tokens and their ties; enough once their cumulative mass reaches `mass`
        kth = np.partition(shifted, k - 1)[k - 1]
        pool = np.flatnonzero(shifted <= kth)
        order = pool[np.argsort(shifted[pool], kind="stable")]
        cum = np.cumsum(probs[order], dtype=np.float64).astype(np.float32)
        if cum[-1] >= limit or k == vals.size:
            break
        k = min(4 * k, vals.size)
    last = min(int((cum < limit).sum()), len(order) - 1)  # transformers' last_ind (it clamps to the row)
    return _take(ids, vals, shifted <= shifted[order[last]])  # holds the best-ranked token: min_tokens_to_keep=1


def warp_row(row: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """One row of processed scores -> (kept ids, their float32 probabilities), warpers in transformers' order."""
    ids, vals = None, apply_temperature(row, params.temperature)  # TemperatureLogitsWarper
    ids, vals = apply_top_k(ids, vals, params.top_k)  # TopKLogitsWarper
    if vals.max() == NEG_INF:  # (checked on top-k's few candidates) transformers' multinomial fails with a torch error
        raise GenerationError(
            "No token is left to sample: bad_words_ids, no_repeat_ngram_size and min_new_tokens ban every one; "
            "relax them."
        )
    ids, vals = apply_top_p(ids, vals, params.top_p)  # TopPLogitsWarper
    ids, vals = apply_min_p(ids, vals, params.min_p)  # MinPLogitsWarper
    ids, vals = apply_typical_p(ids, vals, params.typical_p)  # TypicalLogitsWarper
    return (np.arange(row.size) if ids is None else ids), softmax(vals)


def _first_above(cdf: np.ndarray, target: float) -> int:
    """The first index whose cumulative value exceeds target; past the end (rounding), the last positive one."""
    i = int(np.searchsorted(cdf, target, side="right"))
    return i if i < len(cdf) else int(np.searchsorted(cdf, cdf[-1], side="left"))


def sample_index(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw by inverse CDF. A long row goes block by block: its whole cumulative sum would cost more than
    the rest of sampling."""
    u = rng.random()
    if probs.size <= 4 * _BLOCK:
        cdf = np.cumsum(probs, dtype=np.float64)
        return _first_above(cdf, u * cdf[-1])
    padded = np.zeros(-(-probs.size // _BLOCK) * _BLOCK)  # float64, zero-padded to whole blocks
    padded[: probs.size] = probs
    blocks = padded.reshape(-1, _BLOCK)  # (n_blocks, _BLOCK)
    block_cdf = np.cumsum(blocks.sum(1))
    b = _first_above(block_cdf, u * block_cdf[-1])
    target = u * block_cdf[-1] - (block_cdf[b - 1] if b else 0.0)
    return b * _BLOCK + _first_above(np.cumsum(blocks[b]), target)


def apply_processors(
    scores: np.ndarray, params: SamplingParams, seen: Sequence[np.ndarray], n_generated: int
) -> np.ndarray:
    """(B, V) scores -> (B, V) scores; seen[b]: row b's ids so far (prompt + generated, no padding)."""
    params.check_vocab(scores.shape[-1])
    eos = params.eos_token_id
    scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)  # RepetitionPenaltyLogitsProcessor
    scores = apply_no_repeat_ngram(scores, seen, params.no_repeat_ngram_size)  # NoRepeatNGramLogitsProcessor
    scores = apply_bad_words(scores, seen, params.bad_words_ids, eos)  # NoBadWordsLogitsProcessor
    scores = apply_min_new_tokens(scores, n_generated, params.min_new_tokens, eos)  # MinNewTokensLength...
    return scores


def next_tokens(
    scores: np.ndarray,
    params: SamplingParams,
    seen: Sequence[np.ndarray],
    n_generated: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """(B, V) log-probs -> (B,) next token ids: the processors, then argmax or the warpers and one draw per row."""
    scores = apply_processors(scores, params, seen, n_generated)
    if params.greedy:
        return scores.argmax(-1)
    out = np.empty(len(scores), dtype=np.int64)
    for b, row in enumerate(scores):
        ids, probs = warp_row(row, params)  # the warpers run only when sampling, as in transformers
        out[b] = ids[sample_index(probs, rng)]
    return out
