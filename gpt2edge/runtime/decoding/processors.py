"""transformers' logits processors as NumPy functions: (B, W) scores and each row's history (prompt + generated
ids) -> (B, W) scores, applied by `apply_processors` in the order of `GenerationMixin._get_logits_processor`.

W is the vocabulary (column j scores token j), or a vocabulary-trimmed head's K columns, `columns` (runtime/
columns.py) saying which token each scores. The histories, bans and EOS ids are always full token ids: n-grams
and bad-word prefixes are matched on them, and only the ids a processor ends up touching are mapped to
columns. A dropped id has no column: it can never be generated, and on the full row its score is -inf, which a
penalty or a ban leaves -inf, so skipping it changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gpt2edge.runtime.decoding.sampling_params import SamplingParams
from gpt2edge.runtime.model.columns import Columns

NEG_INF = np.float32(-np.inf)


def token_columns(ids: Sequence[int] | np.ndarray, width: int, columns: Columns | None = None) -> np.ndarray:
    """Full token ids -> the score columns they touch: themselves on a full row (ids past its width cannot be
    generated: skipped), their columns on a trimmed one (dropped ids skipped)."""
    if columns is not None:
        return columns.cols(ids)
    ids = np.asarray(ids, dtype=np.int64)
    return ids[ids < width]


def apply_repetition_penalty(
    scores: np.ndarray, seen: Sequence[np.ndarray], penalty: float, columns: Columns | None = None
) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor: a seen token's score is divided by the penalty if positive, else
    multiplied (the graph's log-probs are never positive, so they are multiplied), in float32."""
    if penalty == 1.0:
        return scores
    scores = scores.copy()
    p = np.float32(penalty)
    for b, ids in enumerate(seen):
        cols = token_columns(np.unique(ids), scores.shape[1], columns)
        s = scores[b, cols]
        scores[b, cols] = np.where(s < 0, s * p, s / p)
    return scores


def banned_ngram_tokens(history: np.ndarray, n: int) -> np.ndarray:
    """Tokens that would complete an n-gram already in `history` (NoRepeatNGramLogitsProcessor's rule)."""
    if n <= 0 or len(history) < n:
        return np.empty(0, np.int64)
    windows = sliding_window_view(np.asarray(history), n)  # (L - n + 1, n)
    prefix = history[len(history) - n + 1 :]  # the n - 1 last tokens
    return windows[(windows[:, :-1] == prefix).all(1), -1]


def apply_no_repeat_ngram(
    scores: np.ndarray, seen: Sequence[np.ndarray], n: int, columns: Columns | None = None
) -> np.ndarray:
    """NoRepeatNGramLogitsProcessor: no n-gram of the history (prompt included) occurs twice."""
    if n <= 0:
        return scores
    scores = scores.copy()
    for b, ids in enumerate(seen):
        banned = banned_ngram_tokens(np.asarray(ids), n)  # matched on full ids, dropped ones included
        scores[b, token_columns(banned, scores.shape[1], columns)] = NEG_INF
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
    scores: np.ndarray,
    seen: Sequence[np.ndarray],
    bad_words_ids: Sequence[Sequence[int]],
    eos: Sequence[int],
    columns: Columns | None = None,
) -> np.ndarray:
    """NoBadWordsLogitsProcessor: no bad sequence is completed. Like transformers, a one-token bad word that is
    an EOS id is dropped (banning EOS is min_new_tokens' job)."""
    bad = [s for s in bad_words_ids if not (len(s) == 1 and s[0] in eos)]
    if not bad:
        return scores
    scores = scores.copy()
    for b, ids in enumerate(seen):
        banned = banned_bad_word_tokens(np.asarray(ids), bad)
        scores[b, token_columns(banned, scores.shape[1], columns)] = NEG_INF
    return scores


def apply_min_new_tokens(
    scores: np.ndarray, n_generated: int, min_new_tokens: int, eos: Sequence[int], columns: Columns | None = None
) -> np.ndarray:
    """MinNewTokensLengthLogitsProcessor: EOS is impossible until min_new_tokens tokens were generated."""
    if n_generated >= min_new_tokens or not len(eos):
        return scores
    scores = scores.copy()
    scores[:, token_columns(list(eos), scores.shape[1], columns)] = NEG_INF
    return scores


def apply_processors(
    scores: np.ndarray,
    params: SamplingParams,
    seen: Sequence[np.ndarray],
    n_generated: int,
    columns: Columns | None = None,
) -> np.ndarray:
    """(B, W) scores -> (B, W) scores; seen[b]: row b's ids so far (prompt + generated, no padding)."""
    params.check_vocab(scores.shape[-1] if columns is None else columns.vocab_size)
    eos, c = params.eos_token_id, columns
    scores = apply_repetition_penalty(scores, seen, params.repetition_penalty, c)  # RepetitionPenaltyLogitsProcessor
    scores = apply_no_repeat_ngram(scores, seen, params.no_repeat_ngram_size, c)  # NoRepeatNGramLogitsProcessor
    scores = apply_bad_words(scores, seen, params.bad_words_ids, eos, c)  # NoBadWordsLogitsProcessor
    scores = apply_min_new_tokens(scores, n_generated, params.min_new_tokens, eos, c)  # MinNewTokensLength...
    return scores
