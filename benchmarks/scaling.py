"""The GPT-2 family side by side with llama.cpp: decode ms/token and prefill ms per size x precision, each next
to its read floor (from `gpt2edge bench`) and llama.cpp on the same weights, interleaved in one run.

    python benchmarks/scaling.py ROOT [--sizes small medium large xl] [--rounds 3] [--threads 2]
        [--gguf-dir /work/peers/scale] [--llama-bench /work/peers/llama-build/bin/llama-bench] [--out FILE]

ROOT holds the folders SIZE-fp32, SIZE-int8, SIZE-int4 (`gpt2edge export` / `quantize`); --gguf-dir holds
gpt2-SIZE-{f32,q8_0,q4_0}.gguf (benchmarks/scaling_gguf.sh makes them from the same checkpoints). Workload:
batch 1, prompt 128, 128 new tokens, --threads threads, both engines. Each round visits every (size,
precision) cell once, running gpt2edge bench and llama-bench back to back under `flock /tmp/bench.lock`
(other helpers' timing runs hold it too), so both sides of a ratio see the same host load. Prints per-cell
medians and per-round ratios (median [min..max]) as a Markdown table, and writes every raw record as JSON.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_lock import LOCK, TICKS, busy_ticks  # noqa: E402  (the lock every timing script here takes)

GGUF = {"fp32": "f32", "int8": "q8_0", "int4": "q4_0"}


def gpt2edge_bench(folder: Path, threads: int, repeat: int) -> dict:
    """`gpt2edge bench --json` on one folder: decode median, prefill, the read floor and its inputs."""
    exe = Path(sys.executable).with_name("gpt2edge")
    cmd = [str(exe), "bench", str(folder), "--threads", str(threads), "--repeat", str(repeat), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    keep = (
        "decode_ms_per_token",
        "prefill_ms",
        "decode_floor_ms",
        "decode_vs_floor",
        "decode_floor_note",
        "bytes_read_per_step",
        "machine_read_bandwidth_gbs",
        "model_bytes",
        "peak_rss_mb",
    )
    return {k: r.get(k) for k in keep}


def llama_bench(gguf: Path, binary: Path, threads: int, reps: int) -> dict:
    """llama-bench pp128 + tg128 (batch 1): ms per generated token and prefill ms."""
    cmd = [str(binary), "-m", str(gguf), "-p", "128", "-n", "128", "-t", str(threads), "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return {"decode_ms_per_token": 1e3 / tg["avg_ts"], "prefill_ms": 128 * 1e3 / pp["avg_ts"]}


def median_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}..{max(xs):.2f}]"


def cpu_line() -> str:
    name = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from gpt2edge.quantize.targets import detect

    cpu = detect()
    return f"{name}; target {cpu.target}; runs {', '.join(cpu.runs)}; flags {' '.join(cpu.flags)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--sizes", nargs="+", default=["small", "medium", "large", "xl"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int8", "int4"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="gpt2edge bench timed runs per round (after a warm-up)")
    ap.add_argument("--llama-reps", type=int, default=1)
    ap.add_argument("--gguf-dir", type=Path, default=Path("/work/peers/scale"))
    ap.add_argument("--llama-bench", type=Path, default=Path("/work/peers/llama-build/bin/llama-bench"))
    ap.add_argument("--out", type=Path, default=Path("scaling.json"))
    args = ap.parse_args()

    cells = [(s, p) for s in args.sizes for p in args.precisions]
    records: list[dict] = []
    print(f"CPU: {cpu_line()}", file=sys.stderr)
    for rnd in range(args.rounds):
        # alternate the order each round: no cell always follows the same neighbour
        for size, prec in cells if rnd % 2 == 0 else cells[::-1]:
            folder = args.root / f"{size}-{prec}"
            gguf = args.gguf_dir / f"gpt2-{size}-{GGUF[prec]}.gguf"
            if not folder.exists() or not gguf.exists():
                print(f"skip {size} {prec}: missing {folder if not folder.exists() else gguf}", file=sys.stderr)
                continue
            t0 = time.time()
            # one lock for the pair: both sides of a ratio run back to back under the same host load
            with open(LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # flock(2): the lock `flock /tmp/bench.lock` takes
                b0, w0 = busy_ticks(), time.monotonic()
                try:
                    g = gpt2edge_bench(folder, args.threads, args.repeat)
                    ll = llama_bench(gguf, args.llama_bench, args.threads, args.llama_reps)
                except subprocess.CalledProcessError as e:  # one failed cell is reported, the run goes on
                    tail = (e.stderr or "").strip().splitlines()[-1:]
                    print(f"round {rnd} {size} {prec}: failed ({' '.join(e.cmd[:2])}): {tail}", file=sys.stderr)
                    continue
                # CPUs busy per wall second, ours included (2 = our threads alone on 2 cores)
                busy = (busy_ticks() - b0) / TICKS / (time.monotonic() - w0)
            rec = {"round": rnd, "size": size, "precision": prec, "gpt2edge": g, "llama": ll, "s": time.time() - t0,
                   "cpus_busy": busy}  # fmt: skip
            records.append(rec)
            print(
                f"round {rnd} {size:6s} {prec}: gpt2edge {g['decode_ms_per_token']:.2f} ms/tok (floor "
                f"{g['decode_floor_ms'] or float('nan'):.2f}), prefill {g['prefill_ms']:.0f} ms; llama.cpp "
                f"{ll['decode_ms_per_token']:.2f} ms/tok, prefill {ll['prefill_ms']:.0f} ms ({rec['s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            args.out.write_text(json.dumps({"cpu": cpu_line(), "args": vars(args) | {"root": str(args.root),
                "gguf_dir": str(args.gguf_dir), "llama_bench": str(args.llama_bench), "out": str(args.out)},
                "records": records}, indent=1))  # fmt: skip
    print_table(records)


def print_table(records: list[dict]) -> None:
    """Per cell: medians of both engines, the floor, and per-round ratios as median [min..max]."""
    print(
        "| size | precision | decode ms/tok | floor ms | ÷ floor | llama.cpp ms/tok | ÷ llama.cpp | prefill ms "
        "| llama.cpp prefill ms | prefill ÷ llama.cpp | rounds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    seen: list[tuple[str, str]] = []
    for r in records:
        if (r["size"], r["precision"]) not in seen:
            seen.append((r["size"], r["precision"]))
    for size, prec in seen:
        rs = [r for r in records if (r["size"], r["precision"]) == (size, prec)]
        dec = [r["gpt2edge"]["decode_ms_per_token"] for r in rs]
        floors = [r["gpt2edge"]["decode_floor_ms"] for r in rs if r["gpt2edge"]["decode_floor_ms"]]
        vs_floor = [d / f for d, f in zip(dec, floors)] if len(floors) == len(dec) else []
        ll = [r["llama"]["decode_ms_per_token"] for r in rs]
        pre = [r["gpt2edge"]["prefill_ms"] for r in rs]
        llp = [r["llama"]["prefill_ms"] for r in rs]
        print(
            f"| {size} | {prec} | {statistics.median(dec):.2f} | "
            f"{statistics.median(floors):.2f} | {median_range(vs_floor) if vs_floor else 'n/a (fits in cache)'} | "
            f"{statistics.median(ll):.2f} | {median_range([d / x for d, x in zip(dec, ll)])} | "
            f"{statistics.median(pre):.0f} | {statistics.median(llp):.0f} | "
            f"{median_range([p / x for p, x in zip(pre, llp)])} | {len(rs)} |"
            if floors
            else f"| {size} | {prec} | {statistics.median(dec):.2f} | n/a | n/a | {statistics.median(ll):.2f} | "
            f"{median_range([d / x for d, x in zip(dec, ll)])} | {statistics.median(pre):.0f} | "
            f"{statistics.median(llp):.0f} | {median_range([p / x for p, x in zip(pre, llp)])} | {len(rs)} |"
        )


if __name__ == "__main__":
    main()
