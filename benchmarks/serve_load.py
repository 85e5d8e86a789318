"""Load on `gpt2edge serve`: real HTTP clients (httpx, streaming) at several concurrencies.

    python benchmarks/serve_load.py MODEL_DIR [--concurrency 1 4 16 64] [--threads 2] [--max-tokens 32] [--json]
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 ...      # a server that is already running

With MODEL_DIR it starts `gpt2edge serve MODEL_DIR --port 0` in a subprocess (loopback only) and stops it at the
end. At each concurrency c, c clients each send streaming completions back to back (closed loop) until
`--requests` (default max(16, 4c)) have finished; every request is greedy with ignore_eos, so each returns
exactly --max-tokens tokens, and the prompts are distinct (about --prompt-tokens tokens each). Reported per
level: requests/s, completion tokens/s, latency p50/p99 (send -> [DONE]), time to first token p50/p99 (send ->
first non-empty text), and the mean batch the server formed (from /health). The clients run on the same
machine as the server and take CPU from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from gpt2edge.sample_text import SAMPLE_TEXT


@dataclass
class Level:
    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    mean_batch: float
    errors: int


def prompts(n: int, words: int) -> list[str]:
    """n distinct prompts of `words` words from the sample text (a different window each)."""
    text = SAMPLE_TEXT.split()
    return [" ".join(text[(i * 7) % (len(text) - words) :][:words]) + f" ({i})" for i in range(n)]


async def one_request(client: httpx.AsyncClient, body: dict) -> tuple[float, float, int]:
    """(latency s, time to first token s, completion tokens) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, tokens = math.nan, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif math.isnan(ttft) and event["choices"] and event["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
    return time.perf_counter() - t0, ttft, tokens


async def run_level(url: str, c: int, n: int, texts: list[str], max_tokens: int) -> Level:
    health0 = httpx.get(url + "/health", timeout=30).json()
    todo = iter(range(n))
    results: list[tuple[float, float, int]] = []
    errors = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in todo:
            body = {"prompt": texts[i % len(texts)], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
            try:
                results.append(await one_request(client, body))
            except (httpx.HTTPError, RuntimeError) as e:
                errors += 1
                print(f"  request failed: {e}", file=sys.stderr)

    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(c)))
        seconds = time.perf_counter() - t0
    health1 = httpx.get(url + "/health", timeout=30).json()
    lat = np.array([r[0] for r in results]) * 1e3
    ttft = np.array([r[1] for r in results]) * 1e3
    batches = health1["batches"] - health0["batches"]
    return Level(
        concurrency=c,
        requests=len(results),
        seconds=seconds,
        requests_per_s=len(results) / seconds,
        tokens_per_s=sum(r[2] for r in results) / seconds,
        latency_p50_ms=float(np.percentile(lat, 50)),
        latency_p99_ms=float(np.percentile(lat, 99)),
        ttft_p50_ms=float(np.nanpercentile(ttft, 50)),
        ttft_p99_ms=float(np.nanpercentile(ttft, 99)),
        mean_batch=(health1["rows_served"] - health0["rows_served"]) / batches if batches else 0.0,
        errors=errors,
    )


@contextmanager
def local_server(model_dir: str, threads: int | None, max_batch: int, max_queue: int):
    """`gpt2edge serve` on 127.0.0.1, a free port; yields its URL."""
    cmd = [sys.executable, "-m", "gpt2edge.cli", "serve", model_dir, "--port", "0", "--max-batch", str(max_batch),
           "--max-queue", str(max_queue)]  # fmt: skip
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
    try:
        match = re.search(r"on (http://\S+) ", proc.stdout.readline())
        if match is None:
            raise SystemExit(f"the server did not start (exit {proc.poll()}); run the command by hand: {cmd}")
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="export folder to serve (else --url)")
    ap.add_argument("--url", help="a running server instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=None, help="requests per level [default: max(16, 4c)]")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="about this many words per prompt")
    ap.add_argument("--threads", type=int, default=None, help="the server's ONNX Runtime threads")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-queue", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print the levels as JSON")
    args = ap.parse_args()
    if (args.model_dir is None) == (args.url is None):
        ap.error("give MODEL_DIR or --url")
    texts = prompts(256, args.prompt_tokens)

    async def levels(url: str) -> list[Level]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # warm-up: first request loads lazily
            await one_request(client, {"prompt": texts[0], "max_tokens": 4, "stream": True})
        out = []
        for c in args.concurrency:
            out.append(await run_level(url, c, args.requests or max(16, 4 * c), texts, args.max_tokens))
            if not args.json:
                print(_row(out[-1]), flush=True)
        return out

    if not args.json:
        print(f"{'c':>3} {'req':>4} {'s':>6} {'req/s':>6} {'tok/s':>7} {'lat p50':>8} {'lat p99':>8} "
              f"{'ttft p50':>8} {'ttft p99':>8} {'batch':>5} {'err':>3}")  # fmt: skip
    if args.url:
        result = asyncio.run(levels(args.url))
    else:
        with local_server(args.model_dir, args.threads, args.max_batch, args.max_queue) as url:
            result = asyncio.run(levels(url))
    by_c = {lv.concurrency: lv for lv in result}
    ratio = by_c[16].tokens_per_s / by_c[1].tokens_per_s if 1 in by_c and 16 in by_c else None
    if args.json:
        print(json.dumps({"levels": [asdict(lv) for lv in result], "tokens_per_s_c16_over_c1": ratio}, indent=2))
    elif ratio is not None:
        print(f"tokens/s at concurrency 16 / concurrency 1: {ratio:.2f} (target >= 3)")


def _row(lv: Level) -> str:
    return (
        f"{lv.concurrency:>3} {lv.requests:>4} {lv.seconds:>6.1f} {lv.requests_per_s:>6.2f} {lv.tokens_per_s:>7.1f} "
        f"{lv.latency_p50_ms:>8.0f} {lv.latency_p99_ms:>8.0f} {lv.ttft_p50_ms:>8.0f} {lv.ttft_p99_ms:>8.0f} "
        f"{lv.mean_batch:>5.1f} {lv.errors:>3}"
    )


if __name__ == "__main__":
    main()
