"""Which calls the sparse head may serve: those whose choice depends only on the best k tokens' logits."""

from __future__ import annotations

from gpt2edge.runtime.decoding.sampling_params import SamplingParams

MAX_TOP_K = 100  # top-k sampling is certified up to this k (the bound; larger k reads most rows anyway)


def sparse_k(params: SamplingParams, logprobs: bool = False) -> int | None:
    """k when the next token depends only on the k best logits up to a common shift (greedy: 1, top-k
    sampling with or without temperature: k); None when the step needs the full head: log-probs recorded,
    a processor that moves or bans tokens (repetition penalty, n-gram and word bans, min_new_tokens: a banned
    best token would leave an uncertified runner-up), or a warper that needs the normaliser (top-p, min-p,
    typical-p, or sampling without top-k)."""
    if logprobs or params.repetition_penalty != 1.0 or params.no_repeat_ngram_size or params.bad_words_ids:
        return None
    if params.min_new_tokens and params.eos_token_id:
        return None
    if params.greedy:
        return 1
    if params.top_p < 1.0 or params.min_p is not None or params.typical_p < 1.0:
        return None
    return params.top_k if 1 <= params.top_k <= MAX_TOP_K else None
