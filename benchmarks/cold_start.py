"""Cold start: wall time from process start to the first generated token (and to exit), and the child's peak
RSS, for `gpt2edge generate` on each folder next to llama.cpp's own start on the same weights, in interleaved
rounds under the bench lock, the page cache warm (each command runs once before the timed rounds).

    python benchmarks/cold_start.py --cell small-fp32=DIR ... [--gguf small-f32=FILE ...] \
        [--llama PEERS/llama-build/bin/llama-simple] [--variants nocache,cached] [--rounds 3]

gpt2edge variants: `nocache` (GPT2EDGE_GRAPH_CACHE=0: ONNX Runtime optimizes the graph at every start, as before
the optimized-graph cache), `cached` (the cache filled by the warm-up run), `first` (an empty cache each round:
this start optimizes and saves), `full` (`--verify`: every folder file and the cache entry hashed). Every
variant's folder check is the verified record's fast one except `full`. `--tree NAME=PATH` (repeatable) runs every
gpt2edge cell from that source tree as well (`python -m gpt2edge.cli` with PYTHONPATH=PATH, its modules compiled
first), its rows named `NAME:variant`: a before/after of a change in one run. The first token is the moment the
child's stdout grows past the prompt it echoes (both programs print the prompt, then stream tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lock import LOCK, TICKS, busy_ticks  # noqa: E402

PROMPT = "def fibonacci(n):\n    "


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def timed(cmd: list[str], env: dict, echo: int, cwd: str) -> dict:
    """Seconds to the first byte past the `echo` bytes of prompt cmd prints, to exit, and its peak RSS; for
    `gpt2edge serve`, health_ready."""
    if "serve" in cmd[:4]:  # gpt2edge serve, or python -m gpt2edge.cli serve
        return health_ready(cmd, env, int(cmd[cmd.index("--port") + 1]), cwd)
    log = tempfile.TemporaryFile()  # a file, not a pipe: llama.cpp logs its load there (a full pipe blocks it)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, bufsize=0, cwd=cwd)
    seen, first = 0, None
    while chunk := p.stdout.read(4096):
        seen += len(chunk)
        if first is None and seen > echo:
            first = time.perf_counter() - t0
    _, status, usage = os.wait4(p.pid, 0)
    total = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        log.seek(0)
        raise SystemExit(f"error: {' '.join(cmd)} exited {p.returncode}: {log.read().decode()[-400:]}")
    return {"first_s": first if first is not None else total, "total_s": total, "rss_mb": usage.ru_maxrss / 1024}


def health_ready(cmd: list[str], env: dict, port: int, cwd: str) -> dict:
    """Start `gpt2edge serve` and poll GET /health every 10 ms: seconds until it answers 200, and peak RSS."""
    log = tempfile.TemporaryFile()  # a file, not a pipe: every poll adds an access-log line
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=cwd)
    ready = None
    while ready is None and p.poll() is None and time.perf_counter() - t0 < 300:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                ready = time.perf_counter() - t0 if r.status == 200 else None
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, _, usage = os.wait4(p.pid, 0)
    if ready is None:
        log.seek(0)
        raise SystemExit(f"error: {' '.join(cmd)} never became ready: {log.read().decode()[-400:]}")
    return {"first_s": ready, "total_s": ready, "rss_mb": usage.ru_maxrss / 1024}


def bare(variant: str) -> str:
    """A variant without its tree's prefix (`base:cached` -> `cached`)."""
    return variant.rsplit(":", 1)[-1]


def folder_bytes(path: str) -> int:
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", action="append", default=[], help="LABEL=gpt2edge folder")
    ap.add_argument("--gguf", action="append", default=[], help="LABEL=GGUF file for --llama")
    ap.add_argument("--llama", help="llama.cpp's llama-simple (prints the prompt, then each token, flushed)")
    ap.add_argument("--variants", default="nocache,cached")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpt2edge", default=shutil.which("gpt2edge") or "gpt2edge")
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of another gpt2edge source tree to time")
    ap.add_argument("--json", help="also write every run here (JSON lines)")
    ap.add_argument(
        "--health",
        action="append",
        default=[],
        help="LABEL of a --cell whose `gpt2edge serve` start to its first /health 200 is also timed (repeatable)",
    )
    args = ap.parse_args()
    # records and graphs of this run only; also every child's working directory: `python -m` puts its working
    # directory before PYTHONPATH on sys.path, so a run from a checkout would import that checkout, not the --tree
    cache = tempfile.mkdtemp(prefix="gpt2edge-cold-bench-")
    base = {**os.environ, "GPT2EDGE_CACHE_DIR": cache}
    echo = len(PROMPT.encode())
    runs: list[tuple[str, str, str, list[str], dict]] = []  # (cell, variant, source, cmd, env)
    trees = [("", [args.gpt2edge], {})]  # (row prefix, the command, its environment)
    for tree in args.tree:
        name, path = tree.split("=", 1)
        # this host may set PYTHONDONTWRITEBYTECODE: compile once, as an installed wheel would have
        subprocess.run([sys.executable, "-m", "compileall", "-q", f"{path}/gpt2edge"], check=True)
        trees.append((f"{name}:", [sys.executable, "-m", "gpt2edge.cli"], {"PYTHONPATH": path}))
    for cell in args.cell:
        label, folder = cell.split("=", 1)
        folder = os.path.abspath(folder)  # the children run in the cache directory (see `cache` above)
        for prefix, program, tree_env in trees:
            gen = [*program, "generate", folder, "-p", PROMPT, "-n", str(args.new_tokens), "--greedy"]
            gen += ["-t", str(args.threads), "--ignore-eos"]
            # a cache directory for each tree and cell: a `first` run empties only its own folder's entry
            own = {"GPT2EDGE_CACHE_DIR": os.path.join(cache, f"{prefix}{label}")}
            for v in args.variants.split(","):
                env = {**base, **tree_env, **own, "GPT2EDGE_GRAPH_CACHE": "0" if v == "nocache" else "1"}
                runs.append((label, prefix + v, folder, gen + (["--verify"] if v == "full" else []), env))
                if label in args.health:
                    with socket.socket() as sock:  # a free port for this cell's server
                        sock.bind(("127.0.0.1", 0))
                        port = sock.getsockname()[1]
                    serve = [*program, "serve", folder, "--port", str(port), "-t", str(args.threads)]
                    serve += ["--verify"] if v == "full" else []
                    runs.append((label, f"{prefix}{v} /health", folder, serve, env))
    for cell in args.gguf:
        label, gguf = cell.split("=", 1)
        gguf = os.path.abspath(gguf)
        cmd = [os.path.abspath(args.llama), "-m", gguf, "-n", str(args.new_tokens), PROMPT]
        runs.append((label, "llama.cpp", gguf, cmd, base))
    results: dict[tuple[str, str], list[dict]] = {(c, v): [] for c, v, *_ in runs}
    with open(LOCK, "a") as lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
        for cell, v, _, cmd, env in runs:  # page cache warm, verify records and graph cache filled
            t = timed(cmd, env, echo, cache)
            if bare(v) in ("cached", "cached /health"):  # this run filled the cache: a first start, once
                results.setdefault((cell, v.replace("cached", "first (warm-up, 1 run)")), []).append(t)
        b0, w0 = busy_ticks(), time.monotonic()
        for r in range(args.rounds):
            for cell, v, _, cmd, env in runs if r % 2 == 0 else runs[::-1]:  # interleaved, order alternating
                if bare(v) == "first":
                    shutil.rmtree(Path(env["GPT2EDGE_CACHE_DIR"]) / "graphs", ignore_errors=True)
                t = timed(cmd, env, echo, cache)
                results[(cell, v)].append(t)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({"cell": cell, "variant": v, "round": r, **t}) + "\n")
        busy = (busy_ticks() - b0) / TICKS / (time.monotonic() - w0)
    shutil.rmtree(cache, ignore_errors=True)
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs, {args.rounds} rounds, {args.new_tokens} new tokens, "
        f"{args.threads} threads, page cache warm; all processes used {busy:.2f} CPUs/s meanwhile"
    )
    print("| cell | variant | bytes | first token s (range) | total s (range) | peak RSS MB (range) | RSS/bytes |")
    print("|---|---|---:|---|---|---|---:|")
    for (cell, v), ts in results.items():
        src = next(s for c, _, s, *_ in runs if c == cell)
        size = folder_bytes(src)

        def col(key: str, fmt: str = ".2f", ts: list[dict] = ts) -> str:
            xs = [t[key] for t in ts]
            return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"

        rss = statistics.median(t["rss_mb"] for t in ts)
        print(
            f"| {cell} | {v} | {size / 1e6:.0f} MB | {col('first_s')} | {col('total_s')} | {col('rss_mb', '.0f')} "
            f"| {rss * 2**20 / size:.2f} |"
        )


if __name__ == "__main__":
    main()
