"""`gpt2edge bench --sweep`: decode latency at growing contexts, and its plot (`--plot`, needs matplotlib)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from gpt2edge.bench.workload import BenchConfig, Workload, progress
from gpt2edge.errors import GenerationError


def sweep_contexts(n_positions: int, new_tokens: int) -> list[int]:
    """32, 64, 128, ... and the longest context that still leaves room for `new_tokens`."""
    top = n_positions - new_tokens
    out, c = [], 32
    while c < top:
        out.append(c)
        c *= 2
    return out + [top] if top >= 1 else out


def run_sweep(model_dir: Path, cfg: BenchConfig, new_tokens: int = 8, log=None) -> list[dict[str, float]]:
    """Decode ms/token (median over `repeat` runs of `new_tokens`) at growing contexts."""
    log = log or sys.stderr
    work = Workload(Path(model_dir), cfg, fixed_lengths=False)
    rows = []
    contexts = sweep_contexts(work.lm.n_positions, new_tokens)
    for context in progress(contexts, "sweep", "context", log):
        work.run(context, new_tokens)  # warm-up at this size
        steps = []
        for _ in range(cfg.repeat):
            steps += work.run(context, new_tokens).decode_ms
        median = float(np.median(steps))
        rows.append({"context": context, "decode_ms_per_token": median, "decode_ms_per_token_median": median})
    return rows


def check_plotting() -> None:
    """Fail before any measurement when --plot cannot be honoured."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise GenerationError("--plot needs matplotlib: pip install 'gpt2edge[plot]'.")


def plot_sweep(rows: list[dict[str, float]], path: Path, title: str) -> None:
    """PNG of decode ms/token against context (needs the `plot` extra: matplotlib)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["context"] for r in rows], [r["decode_ms_per_token"] for r in rows], marker="o")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
