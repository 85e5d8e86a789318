"""A join's prefill when some newcomers start with a cached prefix (SlotLM.join with PrefixCache blocks).

A row with cached blocks copies them into a past of its own and runs only the rest of its prompt on it, as a
batch of one (the shared graph's GroupQueryAttention takes a past with several new tokens one row at a time; the
concat graph's past would have to be padded to the longest prefix), with the positions and mask a full prefill
of that row gives. Rows without a prefix are prefilled together with an empty past, as SlotLM does for all rows
otherwise. Each row's keys and values come back whole (the cached part included), for SlotLM to copy into its
cache row.
"""

from __future__ import annotations

import numpy as np

from gpt2edge.manifest import KEEP_INPUT
from gpt2edge.runtime.model.ort_session import run_errors
from gpt2edge.runtime.model.prefix_cache import BLOCK


def prefill_rows(
    slot, prompts: list[list[int]], pad_id: int, prefixes: list[list[np.ndarray]]
) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """(n, W) log-probs after each prompt, and per prompt its (nh, len, hs) keys/values per tensor."""
    n = len(prompts)
    plain = [j for j in range(n) if not prefixes[j]]
    rows: list[list[np.ndarray]] = [[] for _ in range(n)]
    lps: list[np.ndarray | None] = [None] * n
    if plain:
        lp, presents = slot._prefill([prompts[j] for j in plain], pad_id)
        L = max(len(prompts[j]) for j in plain)
        for r, j in enumerate(plain):
            m = len(prompts[j])
            rows[j] = [p[r, :, L - m :] for p in presents]
            lps[j] = lp[r]
    for j in range(n):
        if prefixes[j]:
            lps[j], rows[j] = prefill_on_prefix(slot, prompts[j], prefixes[j])
    return np.stack(lps), rows


def prefill_on_prefix(slot, prompt: list[int], blocks: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """One row: its first len(blocks) * BLOCK tokens' keys/values from the cache, the rest run on them.
    Returns its (W,) next-token log-probs and (nh, len(prompt), hs) keys/values per tensor."""
    T, m = len(blocks) * BLOCK, len(prompt)
    if not 0 < T < m:
        raise ValueError(f"a cached prefix of {T} tokens for a prompt of {m}: at least its last token must run")
    g = slot.graph
    # the shared graph reads and writes one buffer as long as the mask; the concat graph takes the past itself
    past = np.zeros((slot.n_tensors, 1, slot.nh, m if slot.shared else T, slot.hs), slot.dtype)
    for b, kv in enumerate(blocks):  # (n_tensors, nh, BLOCK, hs) each
        past[:, 0, :, b * BLOCK : (b + 1) * BLOCK] = kv
    feed = {
        "input_ids": np.array([prompt[T:]], dtype=np.int64),
        "attention_mask": np.ones((1, m), dtype=np.int64),
        "position_ids": np.arange(T, m, dtype=np.int64)[None],
    }
    if g.keeps:
        feed[KEEP_INPUT] = np.array([m - T - 1], dtype=np.int64)
    feed.update(zip(g.past_names, past))
    feed.update(slot.switches)
    with run_errors(g.folder.graph_path):
        lp, *presents = g.session.run([slot.output, *g.present_names], feed, g.run_options)
    return slot._head(lp[:, -1] if lp.ndim == 3 else lp)[0], [p[0, :, :m] for p in presents]
