"""Ray Serve replicas on the same cores: R replicas x C CPUs each, against one another, same load.

    python benchmarks/serve_ray.py MODEL_DIR [--layouts 2x1 1x2] [--concurrency 16 64] [--rounds 2]
        [--max-batch 64] [--max-tokens 32] [--json]

Each layout RxC runs `gpt2edge serve MODEL_DIR --ray --replicas R --replica-cpus C --threads C` (a local Ray
instance on loopback, continuous batching in every replica, Ray's proxy spreading requests), then the closed-loop
streaming load of benchmarks/serve_load.py (greedy, ignore_eos, exactly --max-tokens tokens per request, distinct
prompts) at each concurrency; layouts interleaved round by round (ABBA), all under flock /tmp/bench.lock. Prints
per layout and level: tokens/s, time to first token p50/p99, inter-token latency p50/p99; then medians over
rounds and the tokens/s ratio of the first layout to the second per round.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict

import httpx
import numpy as np
from serve_load import LOCK, Level, _row, body, one_request, prompts, run_level


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_server(model_dir: str, replicas: int, cpus: int, max_batch: int):
    """`gpt2edge serve --ray` on a free loopback port; yields its URL once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "gpt2edge.cli", "serve", model_dir, "--ray", "--replicas", str(replicas),
           "--replica-cpus", str(cpus), "--threads", str(cpus), "--max-batch", str(max_batch), "--port", str(port),
           "--max-queue", "256"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the Ray server did not start (exit {proc.poll()}); run by hand: {cmd}")
            try:
                # every replica must answer: several probes through the proxy
                if all(httpx.get(url + "/health", timeout=10).status_code == 200 for _ in range(4 * replicas)):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # the command deletes the app and stops its Ray instance
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--layouts", nargs="+", default=["2x1", "1x2"], help="RxC: R replicas of C CPUs each")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    texts = prompts(256, 32)

    async def levels(url: str, name: str, rnd: int) -> list[Level]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # warm-up, every replica likely hit
            await asyncio.gather(*(one_request(client, body(texts[i], 4)) for i in range(8)))
        out = []
        for c in args.concurrency:
            out.append(await run_level(url, c, max(16, 4 * c), texts, args.max_tokens, name, rnd))
            if not args.json:
                print(_row(out[-1]), flush=True)
        return out

    results: list[Level] = []
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for rnd in range(args.rounds):
            for name in args.layouts if rnd % 2 == 0 else args.layouts[::-1]:
                r, c = (int(x) for x in name.split("x"))
                with ray_server(args.model_dir, r, c, args.max_batch) as url:
                    results += asyncio.run(levels(url, name, rnd))
    if args.json:
        print(json.dumps([asdict(lv) for lv in results], indent=2))
        return
    a, b = args.layouts[0], args.layouts[-1]
    for c in args.concurrency:
        for name in args.layouts:
            mine = [lv for lv in results if lv.concurrency == c and lv.scheduler == name]
            cells = {k: float(np.median([getattr(lv, k) for lv in mine])) for k in
                     ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}  # fmt: skip
            print(f"c={c:<3} {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in cells.items()))
        ratios = [x.tokens_per_s / y.tokens_per_s for x in results for y in results
                  if x.concurrency == y.concurrency == c and x.round == y.round and x.scheduler == a
                  and y.scheduler == b]  # fmt: skip
        if ratios:
            print(f"c={c:<3} tokens/s {a} / {b}: {np.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
