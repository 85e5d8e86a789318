"""What one generation will hold in memory, estimated from the folder's dimensions and the request before the
KV cache is reserved (gpt2edge.budget.memory compares it with what is available)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpt2edge.budget.memory import Estimate, check_fits
from gpt2edge.errors import GenerationError
from gpt2edge.runtime.model.folder import ModelFolder

# bytes per (row, vocabulary entry) a decode step holds: the graph's (R, V) float32 log-probs, the sampler's
# or the beam scorer's float copies (processors, softmax, top-p's sort) and int64 sort indices
_STEP_BYTES_PER_LOGIT = 32
# one recorded alternative of logprobs=N: a TokenLogprob (a Python object with a decoded string), its JSON
# form and text (~1.7 kB measured with --json)
_LOGPROB_ENTRY_BYTES = 2000
# a prefill's activations per (row, position): attention scores (nh x S floats) are counted apart
_PREFILL_FLOATS_PER_POSITION = 16  # x n_embd: residual, layer norms, QKV, the MLP's 4x expansion, their copies


def generation_estimate(
    folder: ModelFolder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    logprobs: int | None = None,
) -> Estimate:
    """The memory a generate() call will hold: KV cache for every row (prompts x beams or samples) over the
    whole context, the per-step log-prob arrays of every row, the prefill's activations, recorded log-probs."""
    d = folder.dims
    batch = len(prompts)
    rows = batch * max(num_beams, num_return_sequences)
    prompt_len = max((len(p) for p in prompts), default=1)
    context = min(prompt_len + max_new_tokens, folder.n_positions)
    kv_bytes = np.dtype(folder.kv_dtype).itemsize
    # concat graphs ping-pong between two buffers; a shared cache is one (plus a row-reorder scratch for beams)
    copies = 2 if folder.kv_cache == "concat" else 1
    kv = copies * 2 * d.n_layer * rows * d.n_head * context * d.head_dim * kv_bytes
    width = folder.info.vocab.kept if folder.info.vocab is not None else d.vocab_size
    steps = _STEP_BYTES_PER_LOGIT * rows * width
    # the prompts run once (batch rows): activations and one layer's attention scores at a time
    prefill = 4 * batch * prompt_len * (_PREFILL_FLOATS_PER_POSITION * d.n_embd + d.n_head * prompt_len)
    recorded = 0 if logprobs is None else _LOGPROB_ENTRY_BYTES * rows * max_new_tokens * (int(logprobs) + 1)
    return Estimate(
        (
            (f"KV cache {rows} rows x {context} positions x {d.n_layer} layers x {d.n_head} heads", kv),
            (f"log-probs of {rows} rows x {width} tokens", steps),
            (f"prefill of {batch} prompt(s) x {prompt_len} tokens", prefill),
            (f"recorded log-probs ({logprobs} alternatives)", recorded),
        )
    )


def check_generation_memory(
    folder: ModelFolder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    logprobs: int | None = None,
) -> None:
    """Refuse, before the KV cache is reserved, a generation that would not fit in the available memory."""
    est = generation_estimate(folder, prompts, max_new_tokens, num_beams, num_return_sequences, logprobs)
    check_fits(
        est,
        "This generation",
        "ask for fewer prompts, beams (num_beams) or samples (num_return_sequences), fewer new tokens or "
        "log-prob alternatives, or free memory.",
        GenerationError,
    )


def check_session_memory(folder: ModelFolder) -> None:
    """A conversation reserves one row for all n_positions at once (and an int64 mask as long): refused when a
    folder's n_positions (an edited manifest may say 10^12) would not fit."""
    n = folder.n_positions
    est = generation_estimate(folder, [[0]], n)
    est = Estimate((*est.parts, (f"attention mask of {n} positions", 8 * n)))
    check_fits(est, "A session", f"the folder's n_positions ({n}) is more than this machine can hold.", GenerationError)


# a scored token: its id and log-prob in Python lists, the tokenizer's encoding of it, the float64 array,
# and its --json entry
_SCORED_TOKEN_BYTES = 400


def check_score_memory(folder: ModelFolder, tokens: int, max_length: int | None = None) -> None:
    """Refuse scoring a text whose tokens (an upper bound: one per byte of text) would not fit in memory."""
    d = folder.dims
    window = min(max_length or folder.n_positions, folder.n_positions)
    width = folder.info.vocab.kept if folder.info.vocab is not None else d.vocab_size
    est = Estimate(
        (
            (f"{tokens} tokens and their log-probs", _SCORED_TOKEN_BYTES * tokens),
            (f"a window's log-probs ({window} x {width})", 4 * window * width if folder.head == "all" else 0),
        )
    )
    check_fits(est, "Scoring this text", "score a part of it, or free memory.", GenerationError)
