"""Whether a folder's batched rows are bit for bit their runs alone when every row's left pad is a multiple of 8
(or 16): the condition gpt2edge.runtime.model.slots.SlotLM keeps when rows are admitted by length. A probe at load.

What moves a batched row on ONNX Runtime's CPU kernels (benchmarks/determinism.py kernels, benchmarks/README.md):
  - the attention's reductions over the key axis (Softmax, attn x V, GroupQueryAttention) follow the SIMD lanes,
    so a row's numbers depend on where its keys start: a left pad that is a multiple of 8 gave exactly the row's
    alone numbers on this AVX-512 CPU, any other pad moved them by ~1e-6 (ALIGNS tries 8, then 16 for kernels
    16 lanes wide; 8 covers 4-lane NEON);
  - int8 DynamicQuantizeMatMul scales the whole batch's activations together: never invariant;
  - int4/int8 MatMulNBits at accuracy level 4 may take another path for one row (M = 1) than for several, which
    depends on the shapes: invariant on some models, not on others.
The probe runs one row alone and in batches of 2 and 5 with pads 0 and the alignment (prefill and one decode step) and
compares every log-prob bit; a folder that passes is served batched, one that fails runs each row alone
(gpt2edge.runtime.decoding.solo_rows.SoloRows). Shape-driven kernel choices are what the probe samples: the
batch sizes it runs (1, 2, 5) cover the M = 1 / M >= 2 split.
"""

from __future__ import annotations

import numpy as np

from gpt2edge.runtime.model.positions import left_pad, position_ids_from_mask

ALIGNS = (8, 16)  # left-pad multiples tried, smallest first (a newcomer waits up to align - 1 steps for its turn)
PROBE_LEN = 21  # probe prompt tokens (not a multiple of the lane widths: their tails are exercised too)


def row_alignment(graph) -> tuple[int | None, str]:
    """(the smallest left-pad multiple at which batched rows are exact, or None; what differed otherwise)."""
    why = ""
    for align in ALIGNS:
        why = batch_refusal(graph, align)
        if why is None:
            return align, ""
    return None, why


def batch_refusal(graph, align: int) -> str | None:
    """None when the probe finds the batched rows exact at pads 0 and `align`; else what differed."""
    rng = np.random.default_rng(0)
    vocab = int(graph.vocab_size)
    row = rng.integers(0, vocab, PROBE_LEN).tolist()
    ref = _run(graph, [row], 0, rng)
    for batch in (2, 5):
        for pad in (0, align):
            got = _run(graph, [row] + [rng.integers(0, vocab, PROBE_LEN + pad).tolist() for _ in range(batch - 1)],
                       pad, rng)  # fmt: skip
            for what, a, b in zip(("prefill", "decode step"), got, ref):
                if not np.array_equal(a, b):
                    return (f"a row batched with {batch - 1} other(s) at a left pad of {pad} differs from it alone at "
                            f"its {what} (by {float(np.abs(a - b).max()):.1e})")  # fmt: skip
    return None


def _run(graph, prompts: list[list[int]], pad: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Row 0's log-probs after the prefill and after one decode step, the batch left-padded to row 0 + pad."""
    S = PROBE_LEN + pad
    lm = graph.new_lm()
    lm.start(len(prompts), S + 1)
    ids, mask = left_pad(prompts, 0, S + 1)
    first = lm.forward_kept(ids, mask[:, :S], position_ids_from_mask(mask[:, :S], S))[0].copy()
    mask[:, S] = 1  # the decode step's own token
    nxt = rng.integers(0, int(graph.vocab_size), (len(prompts), 1))
    nxt[0, 0] = 1  # row 0 feeds the same token in every run
    then = lm.forward_kept(nxt, mask, position_ids_from_mask(mask, S + 1)[:, -1:])[0].copy()
    return first, then
