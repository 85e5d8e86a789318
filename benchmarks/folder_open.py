"""ModelFolder.open's wall time: a full sha256 check (verify="full") against the verified record's fast check
(verify="fast", a record present) and presence only (verify=False), in interleaved rounds, each open in this
process with the page cache warm (the first round's full check warms it and is not counted).

    python benchmarks/folder_open.py DIR [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

from gpt2edge.runtime.model.folder import ModelFolder


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    # records of this run go to a directory of its own, not the user's cache
    os.environ["GPT2EDGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpt2edge-open-bench-")
    ModelFolder.open(args.folder, verify="full")  # page cache warm, and the record written
    times: dict[str, list[float]] = {"full": [], "fast": [], "False": []}
    for _ in range(args.rounds):
        for mode in ("full", "fast", False):  # interleaved: a slow moment of the machine hits every mode
            t = time.perf_counter()
            ModelFolder.open(args.folder, verify=mode)
            times[str(mode)].append((time.perf_counter() - t) * 1e3)
    size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(args.folder) for n in ns)
    print(f"{args.folder}: {size / 1e6:.0f} MB, {cpu_name()}, {args.rounds} rounds")
    for mode, ts in times.items():
        print(f"  verify={mode:5s} median {statistics.median(ts):8.2f} ms  (range {min(ts):.2f}-{max(ts):.2f})")


if __name__ == "__main__":
    main()
