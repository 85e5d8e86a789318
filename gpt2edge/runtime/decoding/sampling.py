"""Next-token selection as small pure NumPy functions that agree with transformers' logits processors.

`next_tokens` applies them in the order of transformers' `GenerationMixin._get_logits_processor`, one line each:
processors on the whole (B, V) batch (repetition penalty, no-repeat n-grams, bad words, min new tokens; in
processors.py), then, when sampling, warpers on each row (temperature, top-k, top-p, min-p, typical-p). Same
float32 arithmetic and boundary rules as transformers, so the kept token set is the one it keeps and
probabilities agree within 1e-6; only a token within transformers' own float32 rounding (a few 1e-6 of mass) of
a threshold may go either way.

A warper works on one row's surviving tokens as (ids, vals): every token not in `ids` has score -inf. Top-k,
top-p and typical-p sort only a candidate pool that provably holds their answer (on a peaked row, a few tokens).

A vocabulary-trimmed head's rows are its K columns (`columns`, runtime/columns.py), and the tokens come back as
full ids, the ones the (V,) row with -inf at the dropped ids gives, for the same seed: one uniform per row
either way, the same values in the same (increasing-id) order. A dropped id has probability 0, so it never
moves a cumulative sum or a draw; it does move NumPy's pairwise summation tree, so while a warper holds the
WHOLE row (no top-k pool yet, or one with -inf in it), the few row sums (softmax, top-p's total, typical-p's
entropy, the draw) are taken in the full row's layout (`layout`): bit-identical, at the cost of V-long sums
on that path only. Once a pool is cut, the full row's pool has no dropped id and the arrays are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.decoding.processors import (
    NEG_INF,
    apply_bad_words,
    apply_min_new_tokens,
    apply_no_repeat_ngram,
    apply_processors,
    apply_repetition_penalty,
    banned_bad_word_tokens,
    banned_ngram_tokens,
)
from gpt2edge.runtime.decoding.sampling_params import SamplingParams
from gpt2edge.runtime.decoding.top_k import apply_temperature, apply_top_k, scaled_top_k
from gpt2edge.runtime.decoding.top_k import take as _take
from gpt2edge.runtime.model.columns import Columns

__all__ = [
    "SamplingParams", "apply_bad_words", "apply_min_new_tokens", "apply_no_repeat_ngram", "apply_processors",
    "apply_repetition_penalty", "banned_bad_word_tokens", "banned_ngram_tokens", "next_tokens", "sample_index",
    "softmax", "warp_row",
]  # fmt: skip

_SMALL = 256  # rows this short are sorted whole
_BINS = 64  # half-nat bins of the top-p pool histogram: 32 nats below the best token, then one for the rest
_BLOCK = 1024  # sample_index's block length on long rows


# ---- warpers: one row's surviving tokens (ids, float32 vals) -> the tokens they keep ------------------------
# ids None means every token of the row (vals is then the whole row): the common top-k path never builds them.
# layout: the Columns of a trimmed row while vals is that whole row (see the module docstring), else None.


def _sum(x: np.ndarray, dtype, layout: Columns | None = None):
    """x.sum(dtype) as the full row gives it (a whole trimmed row's values among the dropped ids' zeros)."""
    return (x if layout is None else layout.scatter(x)).sum(dtype=dtype)


def softmax(vals: np.ndarray, layout: Columns | None = None) -> np.ndarray:
    """float32 softmax as torch computes it: shift by the max, exp, multiply by the reciprocal of the sum
    (the sum accumulated in float64: torch's float32 lane sums are close to exact, NumPy's float32 one less so)."""
    e = np.exp(vals - vals.max())
    return e * (np.float32(1.0) / np.float32(_sum(e, np.float64, layout)))


def _top_p_pool(
    vals: np.ndarray, probs: np.ndarray, threshold: np.float32, layout: Columns | None = None
) -> tuple[np.ndarray | None, float]:
    """(indices of the best tokens or None for all, float64 mass of the rest) with that rest all removed by top-p.

    transformers removes a token when the float32 cumulative mass of it and every token below it is <= 1 - top_p;
    the token just below the pool has exactly the rest's mass, so the pool holds the answer when that passes.
    A histogram of the mass by distance below the best score (half-nat bins) gives the pool in one pass.
    """
    if (vals.size if layout is None else layout.vocab_size) <= _SMALL:
        return None, 0.0
    total = _sum(probs, np.float64, layout)
    bins = np.minimum((vals.max() - vals) * np.float32(2), np.float32(_BINS)).astype(np.intp)  # -inf: last bin
    rest_after = total - np.cumsum(np.bincount(bins, weights=probs, minlength=_BINS + 1))
    for b in range(int(np.argmax(rest_after <= threshold)), _BINS):
        pool = np.flatnonzero(bins <= b)
        rest = total - probs[pool].sum(dtype=np.float64)
        if np.float32(rest) <= threshold:
            return pool, max(rest, 0.0)
    return None, 0.0  # the last bin: every token


def apply_top_p(ids: np.ndarray | None, vals: np.ndarray, top_p: float, layout: Columns | None = None):
    """TopPLogitsWarper: softmax in float32, sort ascending, cumulative sum accumulated in float64 (torch's CPU
    cumsum) rounded to float32, remove where <= float32(1 - top_p); the best token is always kept.
    Returns (ids, vals, layout): top-p always removes the probability-0 tokens, so never the whole row."""
    if top_p >= 1.0:
        return ids, vals, layout
    probs = softmax(vals, layout)
    threshold = np.float32(1.0 - top_p)
    pool, rest = _top_p_pool(vals, probs, threshold, layout)
    # ascending; among ties the lower id comes first (is removed first)
    order = np.argsort(vals, kind="stable") if pool is None else pool[np.argsort(vals[pool], kind="stable")]
    cum = (rest + np.cumsum(probs[order], dtype=np.float64)).astype(np.float32)  # non-decreasing
    n_removed = min(int(np.searchsorted(cum, threshold, side="right")), len(order) - 1)  # cum <= threshold
    return (*_take(ids, vals, order[n_removed:]), None)


def apply_min_p(ids: np.ndarray | None, vals: np.ndarray, min_p: float | None, layout: Columns | None = None):
    """MinPLogitsWarper: remove tokens whose float32 probability is < min_p x the best one's; None disables it.
    Returns (ids, vals, layout); probability-0 tokens survive only a threshold that underflows to 0."""
    if min_p is None:
        return ids, vals, layout
    probs = softmax(vals, layout)
    threshold = np.float32(min_p) * probs.max()
    keep = ~(probs < threshold)
    keep[probs.argmax()] = True
    return (*_take(ids, vals, keep), layout if threshold <= 0 else None)


def apply_typical_p(ids: np.ndarray | None, vals: np.ndarray, mass: float, layout: Columns | None = None):
    """TypicalLogitsWarper: rank tokens by |-log p - entropy|, keep the best ranks up to `mass` (ties with the last
    kept score stay); 1.0 disables it. Only a pool of the best-ranked tokens is sorted. Returns (ids, vals,
    layout): the probability-0 tokens rank last, kept only when every other token's mass falls short of `mass`."""
    if mass >= 1.0:
        return ids, vals, layout
    m = vals.max()
    normalized = (vals - m) - np.float32(np.log(_sum(np.exp(vals - m), np.float64, layout)))  # float32 log_softmax
    p = np.exp(normalized)
    with np.errstate(invalid="ignore"):  # -inf * 0 is nan: skipped below, like torch.nansum
        terms = normalized * p if layout is None else layout.scatter(normalized * p)  # (the full row's sum)
    ent = -np.nansum(terms, dtype=np.float32)
    shifted = np.abs(-normalized - ent)
    probs = softmax(vals, layout)
    limit = np.float32(mass)
    n = vals.size if layout is None else layout.vocab_size  # the pool sizes the full row tries, in turn
    k = min(_SMALL, n)
    while True:
        # the k best-ranked tokens and their ties; enough once their cumulative mass reaches `mass`
        kth = np.partition(shifted, min(k, vals.size) - 1)[min(k, vals.size) - 1]
        pool = np.flatnonzero(shifted <= kth)
        order = pool[np.argsort(shifted[pool], kind="stable")]
        cum = np.cumsum(probs[order], dtype=np.float64).astype(np.float32)
        if cum[-1] >= limit or k >= vals.size:
            break
        k = min(4 * k, n)
    last = min(int((cum < limit).sum()), len(order) - 1)  # transformers' last_ind (it clamps to the row)
    keep = shifted <= shifted[order[last]]  # holds the best-ranked token: min_tokens_to_keep=1
    return (*_take(ids, vals, keep), layout if cum[-1] < limit else None)


def _warp(row: np.ndarray, params: SamplingParams, columns: Columns | None) -> tuple:
    """warp_row's work: (row indices kept or None for all, float32 probabilities, layout)."""
    scaled = scaled_top_k(row, params.temperature, params.top_k)  # both warpers on a pool: no (V,) division
    if scaled is None:
        ids, vals = None, apply_temperature(row, params.temperature)  # TemperatureLogitsWarper
        ids, vals = apply_top_k(ids, vals, params.top_k)  # TopKLogitsWarper
    else:
        ids, vals = scaled
    if vals.max() == NEG_INF:  # (checked on top-k's few candidates) transformers' multinomial fails with a torch error
        raise GenerationError(
            "No token is left to sample: bad_words_ids, no_repeat_ngram_size and min_new_tokens ban every one; "
            "relax them."
        )
    k = params.top_k
    # the full row is still whole after top-k unless a finite k-th score cut its -inf ids (the dropped ones) off
    whole = columns is not None and (k <= 0 or k >= columns.vocab_size or np.count_nonzero(vals > NEG_INF) < k)
    layout = columns if whole else None
    ids, vals, layout = apply_top_p(ids, vals, params.top_p, layout)  # TopPLogitsWarper
    ids, vals, layout = apply_min_p(ids, vals, params.min_p, layout)  # MinPLogitsWarper
    ids, vals, layout = apply_typical_p(ids, vals, params.typical_p, layout)  # TypicalLogitsWarper
    return ids, softmax(vals, layout), layout


def warp_row(row: np.ndarray, params: SamplingParams, columns: Columns | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One row of processed scores -> (kept token ids, their float32 probabilities), warpers in transformers'
    order. columns: the row is a trimmed head's (K,) columns; the ids are full ids all the same."""
    ids, probs, _ = _warp(row, params, columns)
    ids = np.arange(row.size) if ids is None else ids
    return (ids if columns is None else columns.ids[ids]), probs


def sample_row(
    row: np.ndarray, params: SamplingParams, rng: np.random.Generator, columns: Columns | None = None
) -> int:
    """One processed row -> one drawn token id (a full id): the warpers, then one uniform by inverse CDF."""
    ids, probs, layout = _warp(row, params, columns)
    if layout is not None:  # the whole trimmed row: draw in the full row's layout, whose index is the token id
        return sample_index(layout.scatter(probs), rng)
    i = sample_index(probs, rng)
    i = i if ids is None else int(ids[i])
    return i if columns is None else int(columns.ids[i])


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


def greedy_tokens(scores: np.ndarray, columns: Columns | None = None) -> np.ndarray:
    """(B, W) processed scores -> (B,) argmax token ids (the first of tied best; full ids on a trimmed head)."""
    best = scores.argmax(-1)
    if columns is None:
        return best
    tokens = columns.ids[best]
    # a row whose every token is banned: the full row's argmax is its first id, 0, as on an untrimmed head
    tokens[scores[np.arange(len(scores)), best] == NEG_INF] = 0
    return tokens


def next_tokens(
    scores: np.ndarray,
    params: SamplingParams,
    seen: Sequence[np.ndarray],
    n_generated: int,
    rng: np.random.Generator,
    columns: Columns | None = None,
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """(B, W) log-probs -> (B,) next token ids: the processors, then argmax or the warpers and one draw per row.
    W is V, or a trimmed head's K columns given by `columns`; the ids are full ids either way. `allowed`: a
    constraint's (B, W) bool mask, applied after the processors and before the warpers (where transformers puts
    a user LogitsProcessor), so the warpers filter and renormalise among allowed tokens only."""
    scores = apply_processors(scores, params, seen, n_generated, columns)
    if allowed is not None:
        return _allowed_tokens(scores, params, rng, columns, allowed)
    if params.greedy:
        return greedy_tokens(scores, columns)
    out = np.empty(len(scores), dtype=np.int64)
    for b, row in enumerate(scores):
        out[b] = sample_row(row, params, rng, columns)  # the warpers run only when sampling, as in transformers
    return out


def _allowed_pool(row: np.ndarray, mask: np.ndarray, k: int) -> np.ndarray | None:
    """The allowed columns whose scores can reach top-k's pool: every allowed token at or above a threshold that at
    least k allowed tokens pass (top_k_pool's strided sample, taken among the allowed ones), in increasing order.
    None when the sample finds no such threshold, or when it sits too close to the k-th allowed score: scaled_top_k
    also keeps scores a few ulps below the k-th (their quotients can round onto its own), so all of those must be in."""
    stride = max(1, row.size // (16 * k))
    sample = row[::stride][mask[::stride]]  # the allowed tokens of the strided sample
    rank = 4 * -(-k // stride)
    if len(sample) <= rank:
        return None
    threshold = np.partition(sample, len(sample) - 1 - rank)[len(sample) - 1 - rank]
    pool = (row >= threshold).nonzero()[0]  # (~4k / the allowed share,) candidate columns, increasing
    pool = pool[mask[pool]]  # (~4k,) the allowed ones
    if len(pool) < k:
        return None
    kth = np.partition(row[pool], len(pool) - k)[len(pool) - k]  # the k-th allowed score
    return pool if float(threshold) <= below_nine_ulps(kth) else None  # in float64: a float16 row would round it


def below_nine_ulps(x: float) -> float:
    """A value at or below x stepped nine float32 ulps toward -inf (past scaled_top_k's eight steps down), in one
    expression instead of nine np.nextafter calls (~15 us): an ulp is at most 2**-22 of |x| (2**-149 near 0)."""
    x = float(x)
    return x - 4e-6 * abs(x) - 1e-37


def masked_row(row: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(W,) scores with -inf where the (W,) bool mask is False: np.where(mask, row, -inf)'s values (a -0.0 score
    comes back +0.0) at half its cost on a float32 row. The mask's bytes become 0 / -inf float32 bit patterns by
    integer arithmetic (1 - 1 = 0: +0.0; 0 - 1 = all ones, & -inf's bits: -inf), added to the row: x + 0.0 is x,
    x + -inf is -inf (a score is never +inf)."""
    if row.dtype != np.float32:
        return np.where(mask, row, NEG_INF)
    bits = mask.view(np.uint8).astype(np.uint32)
    bits -= np.uint32(1)
    bits &= np.uint32(0xFF800000)  # float32 -inf
    bias = bits.view(np.float32)
    bias += row
    return bias


def _allowed_tokens(
    scores: np.ndarray, params: SamplingParams, rng: np.random.Generator, columns: Columns | None, allowed: np.ndarray
) -> np.ndarray:
    """next_tokens' constrained rows: each row's allowed tokens only, as a short row of their scores.

    A disallowed token's score is -inf: it never survives a warper and has probability 0, so the allowed
    tokens' scores in increasing-id order are the masked row's distribution, and its draw walks them in the same
    order (a sequential cumulative sum skips the zeros exactly); only a row sum's pairwise rounding can differ,
    in its last bits. Sampling that short row costs what its length costs: a grammar that allows five tokens
    does not pay top-k's partition of the whole vocabulary (~1 ms a row at 50,257 columns). With top-k and more
    allowed tokens than k (a prose-like class allows most of the vocabulary), the short row is only the allowed
    tokens that can reach top-k's pool (_allowed_pool): top-k keeps the same ones from it, so the draw is the
    same, without gathering and sorting 40,000 scores; without top-k, such a row is sampled as the masked full
    row itself. A row that allows every token is the unmasked row, draw for draw."""
    out = np.empty(len(scores), dtype=np.int64)
    for b, (row, mask) in enumerate(zip(scores, allowed)):
        if params.greedy:
            best = int(row.argmax())
            if mask[best] and row[best] > NEG_INF:  # allowed: the first of the allowed tied best, without a gather
                out[b] = best if columns is None else int(columns.ids[best])
                continue
        n_allowed = np.count_nonzero(mask)
        if n_allowed == mask.size:
            out[b] = greedy_tokens(row[None], columns)[0] if params.greedy else sample_row(row, params, rng, columns)
            continue
        pool = None
        if not params.greedy and 0 < params.top_k < n_allowed:
            pool = _allowed_pool(row, mask, params.top_k)
        wide = pool is None and not params.greedy and 2 * n_allowed > mask.size
        # most tokens allowed and no pool: the masked row in one pass costs less than gathering its scores
        cols = None if wide else mask.nonzero()[0] if pool is None else pool  # (m,) allowed columns, increasing
        vals = masked_row(row, mask) if wide else row[cols]
        if not n_allowed or vals.max() == NEG_INF:
            raise GenerationError(
                "The constraint allows no token here that bad_words_ids / min_new_tokens leave; relax them."
            )
        if wide:
            out[b] = sample_row(vals, params, rng, columns)
            continue
        col = int(cols[vals.argmax() if params.greedy else sample_row(vals, params, rng)])  # first of tied best
        out[b] = col if columns is None else int(columns.ids[col])
    return out
