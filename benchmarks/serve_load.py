"""Load on `gpt2edge serve`: real HTTP clients (httpx, streaming) at several concurrencies, both schedulers.

    python benchmarks/serve_load.py MODEL_DIR [--concurrency 16 64] [--scheduler continuous next-batch]
        [--rounds 3] [--max-batch 64] [--threads 2] [--max-tokens 32] [--json]
    python benchmarks/serve_load.py MODEL_DIR --soak 180 [--concurrency 64]   # half the clients leave mid-stream
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 ...           # a server that is already running

With MODEL_DIR it starts `gpt2edge serve MODEL_DIR --port 0 --scheduler S` in a subprocess (loopback only) for
each scheduler in turn, round after round (interleaved, so a noisy neighbour hits both alike), under
flock /tmp/bench.lock. At each concurrency c, c clients each send streaming completions back to back (closed
loop) until --requests (default max(16, 4c)) have finished; every request is greedy with ignore_eos, so each
returns exactly --max-tokens tokens, and the prompts are distinct (about --prompt-tokens words each). Per level:
completion tokens/s, latency p50/p99 (send -> [DONE]), time to first token p50/p99 (send -> first text),
inter-token latency p50/p99 (between consecutive text chunks of one stream). Then per level the median and range
over rounds, and the continuous / next-batch ratio of tokens/s per round. The clients run on the same machine
as the server and take CPU from it.

--soak S: c clients for S seconds, every other request abandoned after its 3rd event; checks that every finished
stream has the text its prompt always gets (greedy: one text per prompt, so a mixed-up row shows), counts 5xx,
and reports the server's RSS at the start and the end and whether /health is back to idle.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from gpt2edge.sample_text import SAMPLE_TEXT

LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")
SOAK_PROMPTS = 24


@dataclass
class Level:
    scheduler: str
    round: int
    concurrency: int
    requests: int
    seconds: float
    tokens_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    server_ttft_p50_ms: float  # the server's own histogram (arrival -> first token), no client or network delay
    errors: int
    # the server's own accounting over the level (continuous batching's /health): decode steps, joins (prefill
    # groups), seconds in steps, prefills, copies into cache rows and re-packs; mean rows per step
    server: dict | None = None


def prompts(n: int, words: int) -> list[str]:
    """n distinct prompts of `words` words from the sample text (a different window each)."""
    text = SAMPLE_TEXT.split()
    return [" ".join(text[(i * 7) % (len(text) - words) :][:words]) + f" ({i})" for i in range(n)]


async def one_request(client: httpx.AsyncClient, body: dict, leave_after: int | None = None) -> dict:
    """One streamed completion: latency, time to first text, gaps between text chunks, tokens, its text."""
    t0 = time.perf_counter()
    stamps, text, tokens, events = [], "", 0, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events += 1
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                stamps.append(time.perf_counter())
                text += event["choices"][0]["text"]
            if leave_after is not None and events >= leave_after:
                return {"left": True}
    ttft = stamps[0] - t0 if stamps else math.nan
    return {"latency": time.perf_counter() - t0, "ttft": ttft, "gaps": list(np.diff(stamps)), "tokens": tokens,
            "text": text, "left": False}  # fmt: skip


def body(text: str, max_tokens: int) -> dict:
    return {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def run_level(url: str, c: int, n: int, texts: list[str], max_tokens: int, name: str, rnd: int) -> Level:
    todo = iter(range(n))
    results: list[dict] = []
    errors = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in todo:
            try:
                results.append(await one_request(client, body(texts[i % len(texts)], max_tokens)))
            except (httpx.HTTPError, RuntimeError) as e:
                errors += 1
                print(f"  request failed: {e}", file=sys.stderr)

    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    buckets0, health0 = ttft_buckets(url), health(url)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(c)))
        seconds = time.perf_counter() - t0
    server_ttft = histogram_quantile(buckets0, ttft_buckets(url), 0.5) * 1e3
    pct = lambda key, q: float(np.nanpercentile([r[key] for r in results], q)) * 1e3  # noqa: E731
    gaps = np.concatenate([r["gaps"] for r in results]) * 1e3
    tokens = sum(r["tokens"] for r in results)
    return Level(name, rnd, c, len(results), seconds, tokens / seconds,
                 pct("latency", 50), pct("latency", 99), pct("ttft", 50), pct("ttft", 99),
                 float(np.percentile(gaps, 50)), float(np.percentile(gaps, 99)), server_ttft, errors,
                 server_delta(health0, health(url), tokens - len(results)))  # fmt: skip


def health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=30)
    return r.json() if r.status_code == 200 else {}


def server_delta(before: dict, after: dict, decoded_rows: int) -> dict | None:
    """What the server spent over a level, from two /health reads (None without continuous batching's fields)."""
    keys = ("steps", "batches", "cache_step_s", "cache_prefill_s", "cache_join_copy_s", "cache_relayout_s")
    if not all(k in before and k in after for k in keys):
        return None
    out = {k: round(after[k] - before[k], 3) for k in keys}
    out["rows_per_step"] = round(decoded_rows / max(1, out["steps"]), 1)  # tokens after each first: step tokens
    if "cache_slots_read" in after:  # cache slots the steps read per slot holding a token (masked ones are waste)
        read = after["cache_slots_read"] - before.get("cache_slots_read", 0)
        used = after["cache_slots_used"] - before.get("cache_slots_used", 0)
        out["slots_read_per_used"] = round(read / max(1, used), 2)
    return out


def ttft_buckets(url: str) -> dict[float, float]:
    """The server's time-to-first-token histogram: upper bound -> cumulative count (empty without /metrics)."""
    r = httpx.get(url + "/metrics", timeout=30)
    if r.status_code != 200:
        return {}
    out = {}
    for m in re.finditer(r'^gpt2edge_time_to_first_token_seconds_bucket\{le="([^"]+)"\} (\S+)$', r.text, re.M):
        out[float(m.group(1))] = float(m.group(2))
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Prometheus' histogram_quantile over the counts added between two scrapes (linear within a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if math.isinf(b):
                return lower
            return lower + (b - lower) * (rank - below) / max(c - below, 1e-12)
        lower, below = b, c
    return lower


async def soak(url: str, c: int, seconds: float, texts: list[str], max_tokens: int, pid: int | None) -> dict:
    """c clients for `seconds`; every other request leaves after 3 events; one text per prompt, no 5xx."""
    seen: dict[str, str] = {}
    agree: list[float] = []  # per mismatch: the share of the first text the other one repeats before diverging
    counts = {"finished": 0, "left": 0, "mixed": 0, "5xx": 0, "other_errors": 0}
    rss0 = rss_mb(pid)
    deadline = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient, k: int) -> None:
        i = k
        while time.monotonic() < deadline:
            prompt = texts[i % SOAK_PROMPTS]  # few prompts: each finishes several times, so a mix-up shows
            try:
                r = await one_request(client, body(prompt, max_tokens), leave_after=3 if i % 2 else None)
            except RuntimeError as e:
                counts["5xx" if re.search(r"HTTP 5\d\d|error event", str(e)) else "other_errors"] += 1
                continue
            except httpx.HTTPError:
                counts["other_errors"] += 1
                continue
            if r["left"]:
                counts["left"] += 1
            else:
                counts["finished"] += 1
                first = seen.setdefault(prompt, r["text"])
                if first != r["text"]:  # another text: how far it agrees (a near-tie flip shares a prefix)
                    counts["mixed"] += 1
                    agree.append(len(os.path.commonprefix([first, r["text"]])) / max(1, len(first)))
            i += c

    samples: list[float | None] = []

    async def sample_rss() -> None:  # every 10 s: a leak shows as growth after the warm-up
        while time.monotonic() < deadline:
            samples.append(rss_mb(pid))
            await asyncio.sleep(10)

    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(sample_rss(), *(client_loop(client, k) for k in range(c)))
    idle = None
    for _ in range(100):  # back to idle: nothing queued, no row decoding
        h = httpx.get(url + "/health", timeout=30).json()
        if (h["waiting"], h["running"]) == (0, 0):
            idle = h
            break
        await asyncio.sleep(0.1)
    return {**counts, "rss_start_mb": rss0, "rss_end_mb": rss_mb(pid), "rss_every_10s_mb": samples,
            "back_to_idle": idle is not None,
            "dropped_rows": (idle or {}).get("dropped_rows"), "prompts_checked": len(seen),
            "finished_per_prompt": counts["finished"] / max(1, len(seen)),
            "mismatch_common_prefix_share": sorted(round(a, 2) for a in agree)}  # fmt: skip


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    text = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


@contextmanager
def local_server(model_dir: str, scheduler: str, threads: int | None, max_batch: int, max_queue: int,
                 prefill_tokens: int | None = None):  # fmt: skip
    """`gpt2edge serve` on 127.0.0.1, a free port; yields (URL, pid) once /health says ok."""
    cmd = [sys.executable, "-m", "gpt2edge.cli", "serve", model_dir, "--port", "0", "--max-batch", str(max_batch),
           "--max-queue", str(max_queue), "--scheduler", scheduler]  # fmt: skip
    if prefill_tokens:
        cmd += ["--prefill-tokens", str(prefill_tokens)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
    try:
        match = re.search(r"on (http://\S+) ", proc.stdout.readline())
        if match is None:
            raise SystemExit(f"the server did not start (exit {proc.poll()}); run the command by hand: {cmd}")
        url = match.group(1)
        while httpx.get(url + "/health", timeout=30).status_code != 200:
            time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def summarize(levels: list[Level]) -> list[dict]:
    """Per (scheduler, concurrency): median and range over rounds; per concurrency: the tokens/s ratio."""
    out = []
    for c in sorted({lv.concurrency for lv in levels}):
        row: dict = {"concurrency": c}
        for name in ("continuous", "next-batch"):
            mine = [lv for lv in levels if lv.concurrency == c and lv.scheduler == name]
            for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "server_ttft_p50_ms", "itl_p50_ms",
                        "itl_p99_ms"):  # fmt: skip
                vals = [getattr(lv, key) for lv in mine]
                if vals:
                    row[f"{name}.{key}"] = [float(np.median(vals)), min(vals), max(vals)]
        cont = {lv.round: lv for lv in levels if lv.concurrency == c and lv.scheduler == "continuous"}
        base = {lv.round: lv for lv in levels if lv.concurrency == c and lv.scheduler == "next-batch"}
        pairs = [cont[r].tokens_per_s / base[r].tokens_per_s for r in cont if r in base]
        if pairs:
            row["tokens_per_s_ratio"] = [float(np.median(pairs)), min(pairs), max(pairs)]
        out.append(row)
    return out


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the server it started too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="export folder to serve (else --url)")
    ap.add_argument("--url", help="a running server instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--scheduler", nargs="+", default=["continuous", "next-batch"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=None, help="requests per level [default: max(16, 4c)]")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="about this many words per prompt")
    ap.add_argument("--threads", type=int, default=None, help="the server's ONNX Runtime threads")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=None, help="the server's --prefill-tokens")
    ap.add_argument("--soak", type=float, default=None, help="seconds of soak instead of levels")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if (args.model_dir is None) == (args.url is None):
        ap.error("give MODEL_DIR or --url")
    texts = prompts(256, args.prompt_tokens)

    async def levels(url: str, name: str, rnd: int) -> list[Level]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # warm-up
            await one_request(client, body(texts[0], 4))
        out = []
        for c in args.concurrency:
            out.append(await run_level(url, c, args.requests or max(16, 4 * c), texts, args.max_tokens, name, rnd))
            if not args.json:
                print(_row(out[-1]), flush=True)
        return out

    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other helpers' timing runs wait for this one, and it for them
        if args.soak is not None:
            with local_server(args.model_dir, args.scheduler[0], args.threads, args.max_batch, args.max_queue) as (
                url, pid):  # fmt: skip
                result = asyncio.run(soak(url, args.concurrency[-1], args.soak, texts, args.max_tokens, pid))
            print(json.dumps(result, indent=2))
            return
        if not args.json:
            head = ("scheduler", "rnd", "c", "req", "s", "tok/s", "lat p50", "lat p99", "ttft p50", "ttft p99",
                    "srv ttft", "itl p50", "itl p99", "err")  # fmt: skip
            print(" ".join(f"{h:>{w}}" for h, w in zip(head, (11, 3, 3, 4, 6, 7, 8, 8, 8, 8, 8, 7, 7, 3))))
        results: list[Level] = []
        for rnd in range(args.rounds):
            order = args.scheduler if rnd % 2 == 0 else args.scheduler[::-1]  # interleaved: ABBA...
            for name in order:
                if args.url:
                    results += asyncio.run(levels(args.url, name, rnd))
                    continue
                with local_server(args.model_dir, name, args.threads, args.max_batch, args.max_queue,
                                  args.prefill_tokens) as (url, _):  # fmt: skip
                    results += asyncio.run(levels(url, name, rnd))
    summary = summarize(results)
    if args.json:
        print(json.dumps({"levels": [asdict(lv) for lv in results], "summary": summary}, indent=2))
        return
    print("\nmedian [min, max] over rounds")
    for row in summary:
        for name in args.scheduler:
            cells = [f"{k.split('.')[1]} {v[0]:.0f} [{v[1]:.0f}, {v[2]:.0f}]" for k, v in row.items()
                     if k.startswith(name + ".")]  # fmt: skip
            print(f"c={row['concurrency']:<3} {name:>11}: " + "; ".join(cells))
        if "tokens_per_s_ratio" in row:
            r = row["tokens_per_s_ratio"]
            print(f"c={row['concurrency']:<3} tokens/s continuous / next-batch: {r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]")


def _row(lv: Level) -> str:
    return (
        f"{lv.scheduler:>11} {lv.round:>3} {lv.concurrency:>3} {lv.requests:>4} {lv.seconds:>6.1f} "
        f"{lv.tokens_per_s:>7.1f} {lv.latency_p50_ms:>8.0f} {lv.latency_p99_ms:>8.0f} {lv.ttft_p50_ms:>8.0f} "
        f"{lv.ttft_p99_ms:>8.0f} {lv.server_ttft_p50_ms:>8.0f} {lv.itl_p50_ms:>7.0f} {lv.itl_p99_ms:>7.0f} "
        f"{lv.errors:>3}"
    ) + ("" if not lv.server else "  | " + " ".join(f"{k.removeprefix('cache_')} {v}" for k, v in lv.server.items()))


if __name__ == "__main__":
    main()
