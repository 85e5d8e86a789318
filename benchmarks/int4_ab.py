"""Interleaved A/B of gpt2edge folders against llama-bench on GGUF files: the quick way to try an int4 recipe
against llama.cpp Q4_0 without the whole ../shared/peers run.

    SCRATCH=/path/to/peers python benchmarks/int4_ab.py DIR [DIR ...] [--llama q4_0,q8_0] [--rounds 5]
                                                        [--empty-context]

Needs ../shared/peers/setup.sh's llama.cpp build and GGUF files under $SCRATCH. Workload as the peers run:
batch 1, 2 threads, prompt 128, 128 new tokens. Each run takes `flock $BENCH_LOCK` (/tmp/bench.lock), waits
for a quiet second first, and is retried (up to 40 times) while other processes used more than 0.15 CPU per
wall second during it. The order rotates every round. Reports gpt2edge's pooled decode median (sampler
excluded) and prefill, with --empty-context also decoding from a 1-token prompt (tg128's contexts);
llama-bench tg128 from an empty cache and tg128 at depth 128 (`-d 128`, the context gpt2edge decodes at), and
pp128.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import time
from pathlib import Path

from bench_lock import run_locked


def run_quiet(cmd: list[str], max_others: float) -> tuple[str, float]:
    for _ in range(40):
        out, others = run_locked(cmd, wait_quiet=True)
        if others <= max_others:
            break
        time.sleep(10)
    return out, others


def gpt2edge_run(folder: str, new: int, prompt: int = 128) -> tuple[float, float]:
    cmd = [
        sys.executable,
        "-m",
        "gpt2edge.cli",
        "bench",
        folder,
        "--threads",
        "2",
        "--prompt-len",
        str(prompt),
        "--new-tokens",
        str(new),
        "--repeat",
        "5",
        "--json",
    ]
    d = json.loads(run_quiet(cmd, ARGS.max_others)[0])
    return d["decode_ms_per_token_median"], d["prefill_ms"]


def llama_run(gguf: Path, new: int, depth: bool) -> tuple[float, float]:
    bench = Path(os.environ["SCRATCH"]) / "llama-build/bin/llama-bench"
    extra = ["-p", "0", "-n", str(new), "-d", "128"] if depth else ["-p", "128", "-n", str(new)]
    d = json.loads(
        run_quiet([str(bench), "-m", str(gguf), "-t", "2", "-r", "3", "-o", "json", *extra], ARGS.max_others)[0]
    )
    tg = next(e for e in d if e["n_gen"] > 0)
    pp = [e for e in d if e["n_prompt"] > 0]
    return 1e3 / tg["avg_ts"], (128e3 / pp[0]["avg_ts"] if pp else float("nan"))


def main() -> None:
    if "SCRATCH" not in os.environ:
        sys.exit("error: set SCRATCH to the folder ../shared/peers/setup.sh built (llama-build/, gguf/)")
    jobs = [("gpt2edge", d) for d in ARGS.dirs]
    if ARGS.empty_context:  # decode from a 1-token prompt: the contexts llama-bench's tg128 decodes at
        jobs += [("gpt2edge-p1", d) for d in ARGS.dirs]
    for q in filter(None, ARGS.llama.split(",")):
        jobs += [("llama", q), ("llama-d128", q)]
    results: dict[str, list[tuple[float, float]]] = {}
    for r in range(ARGS.rounds):
        k = r % len(jobs)
        for kind, x in jobs[k:] + jobs[:k]:  # rotate the order so no variant always runs first
            if kind == "gpt2edge":
                name, rec = Path(x).name, gpt2edge_run(x, ARGS.new_tokens)
            elif kind == "gpt2edge-p1":
                name, rec = f"{Path(x).name} (prompt 1)", gpt2edge_run(x, ARGS.new_tokens, prompt=1)
            else:
                gguf = Path(os.environ["SCRATCH"]) / f"gguf/gpt2-{x}.gguf"
                name, rec = f"{kind} {x}", llama_run(gguf, ARGS.new_tokens, kind == "llama-d128")
            results.setdefault(name, []).append(rec)
            print(f"round {r + 1} {name}: decode {rec[0]:.3f} ms/token, prefill {rec[1]:.1f} ms", flush=True)
    print("\n| variant | decode ms/token median [min..max] | prefill 128 ms median [min..max] |\n|---|---|---|")
    for name, v in results.items():
        dec, pre = [x[0] for x in v], [x[1] for x in v]
        print(
            f"| {name} | {st.median(dec):.2f} [{min(dec):.2f}..{max(dec):.2f}] | "
            f"{st.median(pre):.1f} [{min(pre):.1f}..{max(pre):.1f}] |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="gpt2edge folders")
    ap.add_argument("--llama", default="q4_0", help="GGUF types to run next to them, comma-separated ('' for none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--empty-context", action="store_true", help="also decode each folder from a 1-token prompt")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-others", type=float, default=0.15, help="retry a run when others used more CPU")
    ARGS = ap.parse_args()
    main()
