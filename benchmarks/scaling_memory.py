"""Peak RSS and wall time of random-checkpoint, export and quantize at each GPT-2 size, as /usr/bin/time -v
measures them, against the fp32 weight bytes.

    python benchmarks/scaling_memory.py ROOT [--sizes small medium large xl] [--tokenizer DIR] [--table-only]
        [--steps ckpt export int4 int8 run-fp32 run-int8 run-int4] [--times DIR]

For each size: ROOT/ckpt-SIZE (random-checkpoint --size SIZE), ROOT/SIZE-fp32 (export --kv-cache shared, with
validation), ROOT/SIZE-int4 and ROOT/SIZE-int8 (quantize --no-report); run-PRECISION (not by default):
`generate` 16 tokens from ROOT/SIZE-PRECISION, the RAM to run it. Each run's `time -v` output is kept as
ROOT/time-STEP-SIZE.txt (--times DIR: in DIR instead, e.g. to time read-only folders). Before each step it
checks `free` (MemAvailable): gpt2edge refuses a step that does not fit by itself. --table-only: print the
table from the time files already there. (Debian: apt-get install time.)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

STEPS = {
    "ckpt": lambda root, s, tok: ["random-checkpoint", f"{root}/ckpt-{s}", "--size", s, "--force"]
    + (["--tokenizer", tok] if tok else []),
    "export": lambda root, s, tok: ["export", "-m", f"{root}/ckpt-{s}", f"{root}/{s}-fp32", "--kv-cache", "shared",
                                    "--force"],  # fmt: skip
    "int4": lambda root, s, tok: ["quantize", f"{root}/{s}-fp32", "-o", f"{root}/{s}-int4", "--mode", "int4",
                                  "--no-report", "--force"],  # fmt: skip
    "int8": lambda root, s, tok: ["quantize", f"{root}/{s}-fp32", "-o", f"{root}/{s}-int8", "--mode", "int8",
                                  "--no-report", "--force"],  # fmt: skip
}


def _run(precision: str):
    """The RAM to run a folder: load ROOT/SIZE-PRECISION and generate a few tokens."""
    return lambda root, s, tok: ["generate", f"{root}/{s}-{precision}", "-p", "Hello", "--max-new-tokens", "16"]


RUNS = {f"run-{p}": _run(p) for p in ("fp32", "fp16", "int8", "int4")}


def parse_time(path: Path) -> tuple[float, float] | None:
    """(peak RSS GB, wall seconds) from a /usr/bin/time -v report."""
    if not path.exists():
        return None
    text = path.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    if not rss or not wall or "Exit status: 0" not in text:
        return None
    secs = 0.0
    for part in wall.group(1).split(":"):
        secs = secs * 60 + float(part)
    return int(rss.group(1)) * 1024 / 1e9, secs


def weight_bytes(size: str) -> int:
    from gpt2edge.budget.needs import n_parameters
    from gpt2edge.export.random_checkpoint import SIZES

    return 4 * n_parameters(SIZES[size])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--sizes", nargs="+", default=["small", "medium", "large", "xl"])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--steps", nargs="+", choices=[*STEPS, *RUNS], default=list(STEPS))
    ap.add_argument("--times", type=Path, default=None, help="where the time-STEP-SIZE.txt files go (default ROOT)")
    args = ap.parse_args()
    times = args.times or args.root
    steps = {**STEPS, **RUNS}
    exe = str(Path(sys.executable).with_name("gpt2edge"))
    if not args.table_only:
        for size in args.sizes:
            for step in args.steps:
                argv = steps[step]
                subprocess.run(["free", "-g"], check=False)
                out = times / f"time-{step}-{size}.txt"
                subprocess.run(["/usr/bin/time", "-v", "-o", str(out), exe, *argv(args.root, size, args.tokenizer)])
    print("| size | fp32 weights GB | step | peak RSS GB | ÷ weights | wall s |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        w = weight_bytes(size) / 1e9
        for step in args.steps:
            got = parse_time(times / f"time-{step}-{size}.txt")
            if got is not None:
                print(f"| {size} | {w:.2f} | {step} | {got[0]:.2f} | {got[0] / w:.2f} | {got[1]:.0f} |")


if __name__ == "__main__":
    main()
