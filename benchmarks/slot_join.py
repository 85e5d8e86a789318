"""How newcomers should join a running batch on the shared-cache graph: the two correct ways, timed.

    python benchmarks/slot_join.py SHARED_MODEL_DIR [--newcomers 1 4 16] [--prompt 32] [--past 96] [--threads 2]

(a) SlotLM.join (what the server does): the newcomers' prompts are prefilled together with an empty past (one
    left-padded batch), then their keys/values are copied into free cache rows at slots P-L .. P-1.
(b) in place, row by row: each newcomer runs alone (batch 1, the graph refuses batch > 1 with a past) on its
    own row of the shared buffer with a mask of P slots, so the graph writes its keys/values where they belong
    (no copy; it attends over the P - L masked slots too).

Prints the median of --repeats runs (after a warm-up) for each, and (a)'s split between the prefill run and the
copy. Run under flock /tmp/bench.lock on a quiet host; the CPU is printed with the figures.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import platform
import time

import numpy as np

from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.slots import SlotLM

LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")


def in_place(slot: SlotLM, prompts: list[list[int]]) -> None:
    """(b): each prompt prefilled on its own free row, writing slots P-L .. P-1 of that row in place."""
    g, P = slot.graph, slot.past_len
    for j, p in enumerate(prompts):
        r, L = slot.live + j, len(p)
        ids = np.array([p], dtype=np.int64)
        mask = np.zeros((1, P), dtype=np.int64)
        mask[0, P - L :] = 1
        pos = np.arange(L, dtype=np.int64)[None]
        b = g.session.io_binding()
        for name, arr in (("input_ids", ids), ("attention_mask", mask), ("position_ids", pos)):
            b.bind_input(name, "cpu", 0, np.int64, list(arr.shape), arr.ctypes.data)
        b.bind_output("logprobs", "cpu")
        for t, (past, present) in enumerate(zip(g.past_names, g.present_names)):
            view = slot._storage[t, r : r + 1]  # (1, nh, capacity, hs), contiguous
            b.bind_input(past, "cpu", 0, view.dtype.type, list(view.shape), view.ctypes.data)
            b.bind_output(present, "cpu", 0, view.dtype.type, list(view.shape), view.ctypes.data)
        g.session.run_with_iobinding(b, g.run_options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--newcomers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt", type=int, default=32, help="tokens per newcomer prompt")
    ap.add_argument("--past", type=int, default=96, help="the running batch's shared length P")
    ap.add_argument("--running", type=int, default=16, help="rows already decoding")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    gen = Generator(args.model_dir, threads=args.threads)
    if not gen.graph.shared:
        raise SystemExit("give a shared-cache export (gpt2edge export --kv-cache shared)")
    rng = np.random.default_rng(0)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical; threads {args.threads}")
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for n in args.newcomers:
            times = {"a": [], "a_prefill": [], "a_copy": [], "b": []}
            for rep in range(args.repeats + 1):
                slot = SlotLM(gen.graph, args.running + n)
                running = [list(rng.integers(0, 1000, args.past)) for _ in range(args.running)]
                slot.join(running, gen.pad_token_id)  # P = past
                prompts = [list(rng.integers(0, 1000, args.prompt)) for _ in range(n)]
                before = dict(slot.seconds)
                t0 = time.perf_counter()
                slot.join(prompts, gen.pad_token_id)
                a = time.perf_counter() - t0
                slot2 = SlotLM(gen.graph, args.running + n)
                slot2.join(running, gen.pad_token_id)
                t0 = time.perf_counter()
                in_place(slot2, prompts)
                b = time.perf_counter() - t0
                if rep:  # the first is a warm-up
                    times["a"].append(a)
                    times["a_prefill"].append(slot.seconds["prefill"] - before["prefill"])
                    times["a_copy"].append(slot.seconds["join_copy"] - before["join_copy"])
                    times["b"].append(b)
            med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
            print(f"{n:>3} newcomers x {args.prompt} tokens into P={args.past}: (a) batched prefill + copy "
                  f"{med['a']:.1f} ms (prefill {med['a_prefill']:.1f}, copy {med['a_copy']:.2f}); "
                  f"(b) row by row in place {med['b']:.1f} ms; b/a {med['b'] / med['a']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
