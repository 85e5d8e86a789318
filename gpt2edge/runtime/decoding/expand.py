"""Several sequences per prompt from one prefill: the prompts run once (P rows), then each row's KV cache is
copied into n rows (beams or samples of that prompt: rows p*n .. p*n+n-1), as transformers'
_expand_inputs_for_generation orders them. The cache is reserved once for all P*n rows."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.decoding.generate import GenerationState, Step, decode_n_tokens, length_error, prefill
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.positions import left_pad
from gpt2edge.runtime.model.tokenizer import TextStream, TextTokenizer


def check_fits(prompts: Sequence[Sequence[int]], max_new_tokens: int, n_positions: int) -> int:
    """The padded prompt length plus max_new_tokens must fit the model's positions; returns the total."""
    S = max(len(p) for p in prompts)
    error = length_error(S, max_new_tokens, n_positions)
    if error:
        raise GenerationError(error)
    return S + max_new_tokens


def prefill_expanded(
    lm: LM, prompts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int, n: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Prefill P left-padded prompts once and expand to P*n rows.

    Returns (P*n, V) next-token log-probs, the (P*n, total) attention mask (prompt columns set) and the
    prefill time in ms (the row copy included).
    """
    total = check_fits(prompts, max_new_tokens, lm.n_positions)
    ids, mask = left_pad(prompts, pad_id, total)
    S = ids.shape[1]
    lm.start(len(prompts) * n, total - 1)  # the last token is never fed back
    lm.use_rows(len(prompts))
    t0 = time.perf_counter()
    logprobs = prefill(lm, ids, mask[:, :S])
    if n > 1:
        lm.expand_rows(n)
        logprobs = np.repeat(logprobs, n, axis=0)
        mask = np.repeat(mask, n, axis=0)
    return logprobs, mask, (time.perf_counter() - t0) * 1e3


def iter_generate_expanded(
    lm: LM, tokenizer: TextTokenizer, state: GenerationState, pad_id: int, n: int
) -> Iterator[Step]:
    """iter_generate with n sampled sequences per prompt. state.prompts holds the P prompts on entry and, once
    started, one entry per row (P*n, prompt p's samples at rows p*n .. p*n+n-1). One seeded generator draws
    every row in order, so a seed reproduces all n samples (and equals sampling a batch of n copies)."""
    prompts, params = state.prompts, state.params
    start = time.perf_counter()
    logprobs, mask, state.prefill_ms = prefill_expanded(lm, prompts, pad_id, params.max_new_tokens, n)
    state.prompts = [list(p) for p in prompts for _ in range(n)]
    state.generated = [[] for _ in state.prompts]
    state.finish_reasons = [None] * len(state.prompts)
    state.texts = [TextStream(tokenizer, params.stop) for _ in state.prompts]
    rng = np.random.default_rng(params.seed)
    try:
        for step in decode_n_tokens(lm, state, logprobs, mask, pad_id, rng):
            state.wall_ms = (time.perf_counter() - start) * 1e3
            yield step
    except KeyboardInterrupt:
        state.finish_reasons = [r or "interrupted" for r in state.finish_reasons]
