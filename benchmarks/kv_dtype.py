"""Decode ms/token with a float32, float16 and int8 KV cache, in one run: each folder prefills 512 tokens and
decodes to position 1,024 (the long context), and separately decodes positions 16-80 (the short one). The
attention share is the part of a long-context step that the context adds: (long - short) / long, where nearly
all of that part is attention reading (and, concat, copying) the cache.

    python benchmarks/kv_dtype.py FOLDER... [--threads 2] [--json OUT]

Folders: benchmarks/kv_dtype_build.py's (SIZE-KIND-int4, SIZE-KIND-int4-float16, SIZE-KIND-int4-int8).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.open_model import load_graph

LONG_FROM, LONG_TO = 512, 1024
SHORT_FROM, SHORT_TO = 16, 80


def decode_ms(lm, start: int, stop: int, rng: np.random.Generator) -> float:
    """Mean ms of the decode steps at positions start..stop-1, after a prefill of `start` tokens."""
    V = lm.vocab_size
    lm.start(1, stop)
    mask = np.ones((1, stop), np.int64)
    lm.forward(rng.integers(0, V, (1, start)), mask[:, :start], np.arange(start, dtype=np.int64)[None])
    times = []
    for t in range(start, stop):
        t0 = time.perf_counter()
        lm.forward(rng.integers(0, V, (1, 1)), mask[:, : t + 1], np.array([[t]], np.int64))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.mean(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for path in args.folders:
        folder = ModelFolder.open(path, verify=False)
        lm = load_graph(folder, threads=args.threads).new_lm()
        rng = np.random.default_rng(0)
        decode_ms(lm, SHORT_FROM, SHORT_FROM + 8, rng)  # warm-up
        short = decode_ms(lm, SHORT_FROM, SHORT_TO, rng)
        long = decode_ms(lm, LONG_FROM, LONG_TO, rng)
        d = folder.dims
        cache_mb = (
            2 * d.n_layer * d.n_head * d.head_dim * np.dtype(folder.kv_dtype).itemsize * (LONG_FROM + LONG_TO) / 2 / 1e6
        )
        row = {
            "folder": path.name,
            "kv_cache": folder.kv_cache,
            "kv_dtype": folder.graph.kv_dtype,
            "precision": folder.precision,
            "ms_short": round(short, 2),
            "ms_long": round(long, 2),
            "attention_share": round((long - short) / long, 3),
            "cache_mb_mean": round(cache_mb, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del lm
    print(
        "\n| folder | cache | KV dtype | ms/token 16-80 | ms/token 512-1024 | attention share | cache read (MB, mean) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['folder']} | {r['kv_cache']} | {r['kv_dtype']} | {r['ms_short']} | {r['ms_long']} | "
            f"{r['attention_share'] * 100:.0f} % | {r['cache_mb_mean']} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
