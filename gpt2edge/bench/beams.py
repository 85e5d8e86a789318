"""`bench --num-beams`: what beam search costs per step at several beam widths, and what the cache reorder costs.

Each width runs the same seeded prompt(s) through runtime.beam.time_beam_search (no EOS, so every run has the
same number of steps); the widths are interleaved over the repeats so that a shared host's drift hits them alike.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gpt2edge.bench.workload import BenchConfig, Workload, bench_prompts, progress
from gpt2edge.runtime.decoding.beam import time_beam_search


@dataclass(frozen=True)
class BeamBenchRow:
    """Medians over the timed runs of one beam width (ms); per_token = one step's ms (a step gives every prompt
    one more token, whatever the width)."""

    num_beams: int
    rows: int  # batch x num_beams cache rows
    decode_ms_per_step: float  # the graph's forward over all rows
    reorder_ms_per_step: float  # moving the cache rows to the surviving beams
    select_ms_per_step: float  # beam bookkeeping: candidates, hypotheses
    step_ms: float  # the three together: ms per generated token of each prompt
    step_ms_range: tuple[float, float]

    def to_json(self) -> dict:
        return asdict(self)


def run_beam_bench(model_dir: Path, cfg: BenchConfig, widths: Sequence[int], log=None) -> list[BeamBenchRow]:
    """Beam search at each width, cfg.repeat timed runs after one warm-up each, interleaved."""
    log = log or sys.stderr
    work = Workload(Path(model_dir), cfg)
    cfg = work.cfg
    prompts = bench_prompts(cfg, work.folder.dims["vocab_size"])
    runs: dict[int, list] = {w: [] for w in widths}
    for i in progress(range(cfg.repeat + 1), "bench beams", "round", log):
        for w in widths:
            t = time_beam_search(work.lm, prompts, cfg.new_tokens, w)
            if i > 0:  # round 0 warms up every width (allocations, kernel choice)
                runs[w].append(t)
    rows = []
    for w in widths:
        steps = [t.decode_ms_per_step + t.reorder_ms_per_step + t.select_ms_per_step for t in runs[w]]

        def med(xs: list[float]) -> float:
            return float(np.median(xs))

        rows.append(
            BeamBenchRow(
                num_beams=w,
                rows=cfg.batch * w,
                decode_ms_per_step=med([t.decode_ms_per_step for t in runs[w]]),
                reorder_ms_per_step=med([t.reorder_ms_per_step for t in runs[w]]),
                select_ms_per_step=med([t.select_ms_per_step for t in runs[w]]),
                step_ms=med(steps),
                step_ms_range=(min(steps), max(steps)),
            )
        )
    return rows


def beam_rows(rows: Sequence[BeamBenchRow]) -> list[tuple[str, str]]:
    """Table lines for the CLI."""
    return [
        (
            f"beams {r.num_beams} ({r.rows} rows)",
            f"{r.step_ms:.2f} ms/token (decode {r.decode_ms_per_step:.2f} + reorder {r.reorder_ms_per_step:.2f} + "
            f"select {r.select_ms_per_step:.2f}; range {r.step_ms_range[0]:.2f}-{r.step_ms_range[1]:.2f})",
        )
        for r in rows
    ]
