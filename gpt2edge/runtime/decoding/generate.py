"""The generate loop in gpt-fast's shape: prefill, decode_one_token, decode_n_tokens, generate.

Batches are left-padded: every row ends at the same column, so one (B, 1) step serves all rows; position ids
count each row's own tokens, and a row that has finished keeps being fed a pad token (its output is ignored).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.decoding.logprobs import LogprobRecorder, TokenLogprob
from gpt2edge.runtime.decoding.prefix_fill import prefill_on_cache, remember, usable
from gpt2edge.runtime.decoding.row_decoder import RowDecoder, RowGroup
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.model.columns import forward_columns, lm_columns
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.positions import left_pad, position_ids_from_mask
from gpt2edge.runtime.model.tokenizer import TextStream, TextTokenizer

if TYPE_CHECKING:
    from gpt2edge.runtime.constraints.engine import CompiledConstraint
    from gpt2edge.runtime.model.prefix_cache import PrefixCache


@dataclass
class Step:
    """What one decode step produced: the token of every row, and which rows are finished after it."""

    index: int
    tokens: np.ndarray  # (B,)
    active: np.ndarray  # (B,) bool: the row took this token (it was not already finished)
    finished: list[str | None]
    logprobs: list[TokenLogprob | None] | None = None  # (B,) each row's record of this token, when recorded


@dataclass
class GenerationState:
    prompts: list[list[int]]
    params: SamplingParams
    generated: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    texts: list[TextStream] = field(default_factory=list)  # per row: its text and the stop-string matcher
    prefill_ms: float = 0.0
    decode_ms: list[float] = field(default_factory=list)  # one entry per forward after the prefill
    sampler_ms: list[float] = field(default_factory=list)  # one entry per sampled token step
    wall_ms: float = 0.0  # from the start of the prefill to the last sampled token
    logprobs: LogprobRecorder | None = None  # set to record each generated token's log-prob (and top-N)
    head: dict | None = None  # an approximate sparse head's description (runtime/sparse_head/approx.py)
    constraint: CompiledConstraint | None = None  # structured output: a matcher per row (runtime/constraints)
    prefix: PrefixCache | None = None  # the Generator's prefix cache (runtime/decoding/prefix_fill.py)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied


def prefill(lm: LM, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Run the whole (left-padded) prompt with an empty past; returns next-token log-probs (B, V), or (B, K) on
    a vocabulary-trimmed head (its columns: lm_columns(lm))."""
    return forward_columns(lm, ids, mask, position_ids_from_mask(mask, ids.shape[1]))


def decode_one_token(lm: LM, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One (B, 1) step on top of the cache; returns next-token log-probs (B, V), or (B, K) as prefill."""
    return forward_columns(lm, tokens[:, None], mask, positions[:, None])


def _check_finite(logprobs: np.ndarray, step: int) -> None:
    if np.isnan(logprobs).any():
        raise GenerationError(
            f"The model produced NaN log-probabilities at decode step {step}; generation stopped rather than "
            "emit garbage (an fp16 overflow or a corrupted model?). Try the fp32 export."
        )


def length_error(prompt_len: int, max_new_tokens: int, n_positions: int) -> str | None:
    """None when the prompt and max_new_tokens fit the model's positions, else the one-line fix that can work.

    When max_new_tokens alone leaves no room for the prompt, truncating the prompt cannot help: only a lower
    max_new_tokens can.
    """
    P, n, N = prompt_len, max_new_tokens, n_positions
    if P + n <= N:
        return None
    if n >= N:
        fix = f"lower --max-new-tokens to at most {N - P}" if P < N else f"lower --max-new-tokens below {N}"
        return (
            f"max_new_tokens={n} leaves no room for the {P}-token prompt in the model's {N} positions; {fix} "
            "(truncating the prompt cannot help)."
        )
    fixes = [f"lower --max-new-tokens to at most {N - P}"] if P < N else []
    fixes += ["shorten the prompt", f"pass --truncate to keep its last {N - n} tokens"]
    return (
        f"The prompt has {P} tokens; with max_new_tokens={n} only {N - n} fit the model's {N} positions. "
        f"{', '.join(fixes[:-1]).capitalize()} or {fixes[-1]}."
    )


def decode_n_tokens(
    lm: LM,
    state: GenerationState,
    logprobs: np.ndarray,
    mask: np.ndarray,
    pad_id: int,
    rng: np.random.Generator,
) -> Iterator[Step]:
    """Sample, record, feed back, until every row has finished; yields after each sampled token. `logprobs`
    are prefill's: on a trimmed head, its K columns, and only the chosen ids become full ids. Each row is a
    RowDecoder of one RowGroup (row_decoder.py: the processor order, the finish rule), as in the server."""
    params = state.params
    columns = lm_columns(lm)
    S = lm.past_len
    positions = mask[:, :S].sum(1)  # next position of each row
    width = columns.width if columns is not None else logprobs.shape[1]
    rows = [RowDecoder(params, p, t, width, columns) for p, t in zip(state.prompts, state.texts, strict=True)]
    group = RowGroup(rows, params, rng, columns, state.constraint)
    state.generated = [r.generated for r in rows]  # the rows' own lists: callers read them as they grow
    for step in range(params.max_new_tokens):
        _check_finite(logprobs, step)
        raw = logprobs.copy() if state.logprobs is not None else None  # the model's, before any processor
        active = group.active()
        t0 = time.perf_counter()
        tokens = group.choose(logprobs)
        state.sampler_ms.append((time.perf_counter() - t0) * 1e3)
        for b in np.flatnonzero(active):
            group.push(b, int(tokens[b]))
        state.finish_reasons = [r.finish_reason for r in rows]
        recorded = state.logprobs.record(raw, tokens, active, columns) if raw is not None else None
        yield Step(step, tokens, active, list(state.finish_reasons), recorded)
        if group.finished:
            return
        feed = np.where(active, tokens, pad_id)
        mask[:, S + step] = 1
        group.prefetch()  # the next masks depend on the tokens only: computed during the forward
        t0 = time.perf_counter()
        logprobs = decode_one_token(lm, feed, mask[:, : S + step + 1], positions)
        state.decode_ms.append((time.perf_counter() - t0) * 1e3)
        positions = positions + 1


def generate(
    lm: LM,
    tokenizer: TextTokenizer,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int,
    callback: Callable[[Step], None] | None = None,
) -> GenerationState:
    """Generate for a batch of tokenized prompts. Ctrl-C stops cleanly: rows keep what they have."""
    state = GenerationState(prompts=prompts, params=params)
    for step in iter_generate(lm, tokenizer, state, pad_id):
        if callback is not None:
            callback(step)
    return state


def configure_head(lm: LM, state: GenerationState) -> None:
    """A sparse head (gpt2edge.runtime.sparse_head) serves the steps this call allows; other LMs ignore it."""
    if state.constraint is not None and lm.graph.approximate:
        raise GenerationError("An approximate sparse head does not take a constraint; use an exact export.")
    # a constraint's mask needs every allowed token's score: the full head, as for recorded log-probs
    full = state.logprobs is not None or state.constraint is not None or state.params.row_penalties
    # an approximate head describes itself (the result says so), the others return None
    state.head = lm.configure_head(state.params, full)


def iter_generate(lm: LM, tokenizer: TextTokenizer, state: GenerationState, pad_id: int) -> Iterator[Step]:
    """generate() as an iterator over steps (streaming consumers use this)."""
    params, prompts = state.params, state.prompts
    B = len(prompts)
    S = max(len(p) for p in prompts)
    total = S + params.max_new_tokens
    error = length_error(S, params.max_new_tokens, lm.n_positions)
    if error:
        raise GenerationError(error)
    state.generated = [[] for _ in range(B)]
    state.finish_reasons = [None] * B
    state.texts = [TextStream(tokenizer, params.stop) for _ in range(B)]
    rng = np.random.default_rng(params.seed)
    ids, mask = left_pad(prompts, pad_id, total)
    # the last sampled token is never fed back, so the cache needs total - 1 positions
    lm.start(B, total - 1)
    configure_head(lm, state)
    cache = usable(lm, state.prefix, B)  # one row: its cached prefix is loaded, the rest prefilled
    try:
        t0 = time.perf_counter()
        if cache is None:
            logprobs = prefill(lm, ids, mask[:, :S])
        else:
            logprobs, state.cached_tokens = prefill_on_cache(lm, cache, ids, mask[:, :S])
        state.prefill_ms = (time.perf_counter() - t0) * 1e3
        for step in decode_n_tokens(lm, state, logprobs, mask, pad_id, rng):
            state.wall_ms = (time.perf_counter() - t0) * 1e3  # the prefill up to this token
            yield step
        remember(lm, cache, prompts[0] + state.generated[0] if cache is not None else [])
    except KeyboardInterrupt:
        state.finish_reasons = [r or "interrupted" for r in state.finish_reasons]
