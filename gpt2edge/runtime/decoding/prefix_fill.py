"""The Generator's prefix cache (Generator(prefix_cache_bytes=N)) on a one-row generation: generate() and stream()
of one prompt and one sequence, and session() turns.

A prompt's longest cached prefix (gpt2edge.runtime.model.prefix_cache) goes into the fresh cache row as a
restored session's would (CacheRows.load_row), and only the rest of the prompt is prefilled on it (its last
token always: its log-probs start the decode). When the generation ends, the row's keys and values (the prompt
and every token fed back) are offered to the cache, which copies the blocks it lacks.
"""

from __future__ import annotations

import numpy as np

from gpt2edge.budget.memory import Estimate, check_fits
from gpt2edge.errors import GenerationError
from gpt2edge.runtime.model.columns import forward_columns
from gpt2edge.runtime.model.contract import LM, Graph
from gpt2edge.runtime.model.prefix_cache import PrefixCache


def generator_prefix_cache(graph: Graph, max_bytes: int) -> PrefixCache | None:
    """Generator(prefix_cache_bytes=N)'s cache (None for 0), refused before any work when the folder cannot
    take it or N is beyond what this machine's memory holds (one line naming the estimate)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise GenerationError(f"prefix_cache_bytes must be a whole number of bytes >= 0, got {max_bytes!r}.")
    if max_bytes == 0:
        return None
    if not graph.supports_prefix_cache:
        raise GenerationError("prefix_cache_bytes needs a dynamic export on CPU (not a static-shape, sparse-head or "
                              "CUDA one); pass 0.")  # fmt: skip
    check_fits(Estimate((("prefix cache", max_bytes),)), "prefix_cache_bytes", "lower it or pass 0 (off).",
               GenerationError)  # fmt: skip
    return PrefixCache.for_graph(graph, max_bytes)


def usable(lm: LM, cache: PrefixCache | None, rows: int) -> PrefixCache | None:
    """The cache when this generation can take it: one row on an LM whose row state moves in and out (a CPU
    OrtLM; not a static, sparse-head or CUDA context, whose rows are laid out otherwise)."""
    if cache is None or rows != 1 or not lm.supports_row_state:
        return None
    return cache


def load_prefix(lm: LM, cache: PrefixCache, ids: list[int]) -> int:
    """Copy ids' longest cached prefix into lm's fresh one-row cache (past_len 0); returns its length."""
    blocks = cache.lookup(ids, len(ids) - 1)
    if not blocks:
        return 0
    lm.load_row([np.concatenate([b[t] for b in blocks], axis=1) for t in range(len(lm.past_names))])
    return lm.past_len


def prefill_on_cache(lm: LM, cache: PrefixCache | None, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, int]:
    """prefill() of one (1, S) prompt, its cached prefix loaded first: (log-probs, tokens taken from the cache)."""
    S = ids.shape[1]
    cached = load_prefix(lm, cache, ids[0].tolist()) if cache is not None else 0
    positions = np.arange(cached, S, dtype=np.int64)[None]
    return forward_columns(lm, ids[:, cached:], mask, positions), cached


def remember(lm: LM, cache: PrefixCache | None, ids: list[int]) -> None:
    """Offer the one-row cache's keys/values (ids: the tokens at its first past_len positions) to the cache."""
    if cache is not None and lm.past_len > 0:
        cache.insert(ids[: lm.past_len], lm.row_tensors())
