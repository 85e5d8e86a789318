"""What constraints cost the server: 16 rows in the continuous scheduler, constrained against free.

    python benchmarks/structured_server.py MODEL_DIR [MODEL_DIR ...] [--rows 16] [--tokens 32] [--rounds 3]

Per folder and constraint (the ten-field JSON Schema and the regex of benchmarks/structured.py): `--rows` seeded
requests (temperature 0.8, `--tokens` each, end of text ignored) are queued together into one continuous
scheduler, so they join one batch and decode side by side; the figure is the wall time per scheduler step
(joins excluded: it counts from the first decode step) with every row constrained, next to the same run with no
constraint (the same folder, rows and lengths), in interleaved rounds. The overhead is what the 16 rows' masks,
their application and the matchers add to a step after the overlap with the forward (the scheduler computes
the next masks while ONNX Runtime runs the step). Rows that finish early (a complete grammar) leave the batch:
the step count per run is printed so a shorter batch is visible. Medians and ranges over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from structured import CONSTRAINTS

from gpt2edge.runtime.constraints import Constraint
from gpt2edge.serve import ServeConfig
from gpt2edge.serve.scheduling.continuous import load_scheduler
from gpt2edge.serve.scheduling.jobs import Job, Sampling

PROMPT = "Here is the record as JSON:"


def run(scheduler, rows: int, tokens: int, constraint: Constraint | None, seed: int) -> tuple[float, int]:
    """(ms per decode step, decode steps) for `rows` requests decoded together."""
    gen = scheduler.generator
    compiled = None if constraint is None else scheduler.compile(constraint)
    plen = len(gen.tokenizer.encode(PROMPT))
    jobs = [
        Job(
            [PROMPT],
            [plen],
            1,
            tokens,
            Sampling(temperature=0.8, seed=seed + i, ignore_eos=True, constraint=constraint),
            (),
            lambda e: None,
            gen.tokenizer,
            constraint=compiled,
        )  # fmt: skip
        for i in range(rows)
    ]
    steps0 = scheduler.stats()["steps"]
    for j in jobs:
        scheduler.submit(j)
    while scheduler.stats()["steps"] == steps0:  # the rows have joined once the first step ran
        time.sleep(0.0005)
    t0, s0 = time.perf_counter(), scheduler.stats()["steps"]
    while not all(j.finished for j in jobs):
        time.sleep(0.0005)
    t1, s1 = time.perf_counter(), scheduler.stats()["steps"]
    return (t1 - t0) * 1e3 / max(1, s1 - s0), s1 - s0


def bench(folder: str, rows: int, tokens: int, rounds: int) -> dict:
    scheduler = load_scheduler(folder, ServeConfig(model_name="bench", max_batch=rows))
    scheduler.start()
    try:
        run(scheduler, rows, 4, None, 0)  # warm-up: the cache rows and ONNX Runtime's first runs
        for c in CONSTRAINTS.values():
            run(scheduler, rows, 4, c, 0)
        out: dict = {"folder": folder, "rows": rows, "tokens": tokens}
        for name, c in CONSTRAINTS.items():
            free, cons, steps = [], [], []
            for r in range(rounds):  # interleaved: the host's load moves both alike
                free.append(run(scheduler, rows, tokens, None, 100 * r)[0])
                ms, n = run(scheduler, rows, tokens, c, 100 * r)
                cons.append(ms)
                steps.append(n)
            f, k = statistics.median(free), statistics.median(cons)
            out[name] = {
                "free_step_ms": f, "free_range": [min(free), max(free)], "constrained_step_ms": k,
                "constrained_range": [min(cons), max(cons)], "steps": steps, "overhead_pct": 100 * (k - f) / f,
            }  # fmt: skip
        return out
    finally:
        scheduler.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = [bench(f, args.rows, args.tokens, args.rounds) for f in args.folders]
    print(f"{'folder':<28} {'constraint':<22} {'free step':>16} {'constrained step':>18} {'overhead':>9} steps")
    for r in results:
        for name in CONSTRAINTS:
            c = r[name]
            lo, hi = c["free_range"]
            klo, khi = c["constrained_range"]
            print(f"{r['folder'][-28:]:<28} {name:<22} {c['free_step_ms']:>6.2f} ({lo:.2f}-{hi:.2f}) "
                  f"{c['constrained_step_ms']:>7.2f} ({klo:.2f}-{khi:.2f}) {c['overhead_pct']:>+8.1f}% "
                  f"{c['steps']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
