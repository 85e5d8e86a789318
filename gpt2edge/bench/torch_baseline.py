"""The PyTorch source model on the bench workload, in the same run (`gpt2edge bench --vs-torch`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gpt2edge.extras import require_extra


def torch_bench(
    source: str, prompts: list[list[int]], new_tokens: int, repeat: int, threads: int | None
) -> dict[str, Any]:
    """Prefill (one forward over the prompts) and cached greedy decode steps of the transformers model."""
    require_extra("export", "bench --vs-torch")
    import torch

    from gpt2edge.export.checkpoint import load_checkpoint

    if threads:
        torch.set_num_threads(threads)
    model = load_checkpoint(source).model
    ids = torch.tensor(prompts)
    prefill, decode = [], []
    with torch.inference_mode():
        for i in range(repeat + 1):  # the first run is a warm-up
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            p_ms = (time.perf_counter() - t0) * 1e3
            cache = getattr(out, "cache", None) or out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            steps = []
            for _ in range(new_tokens - 1):
                t0 = time.perf_counter()
                out = model(nxt, cache, use_cache=True)
                steps.append((time.perf_counter() - t0) * 1e3)
                cache = getattr(out, "cache", None) or out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            if i:
                prefill.append(p_ms)
                decode += steps
    return {
        "source": source,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "prefill_ms": float(np.median(prefill)),
        "decode_ms_per_token": float(np.median(decode)),
    }
