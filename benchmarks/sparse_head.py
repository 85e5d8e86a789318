"""The certified sparse head against the full head of the same precision, in one interleaved run.

    python benchmarks/sparse_head.py [--model ../shared/trained-gpt2-py] [--work /tmp/sparse-bench]
                                     [--rounds 5] [--tokens 128] [--threads 2] [--rank 16] [--candidates 256]
                                     [--workloads greedy,top-k 40,top-p 0.9,forced] [--breakdown] [--random]
                                     [--lock-once]

Builds (once, under --work) the shared-cache fp32 export of --model, its int8 and int4 variants and the sparse
head of each (`gpt2edge sparse-head`). Then, round by round (order alternating, each pair under
`flock $BENCH_LOCK`), decodes each prompt with the full and the sparse folder, the order alternating per
prompt and round: greedy, top-k 40 and top-p 0.9 sampling (temperature 0.8, seeded; top-p needs the full head
every step). Prints per precision and workload:
decode ms/token (median of the generate() medians) of each, the per-(round, prompt) ratio (median and
range), whether every token matched, the
fraction of steps certified and of head rows read. --random repeats the certification figures on a
random-weight model of the same shape (flat distributions: nothing to certify). --breakdown first times a
step's parts (full forward, the sparse body run, the native certified step, the head graph, the sparse
forward), teacher-forced over the greedy continuations. GPT2EDGE_NATIVE=0 runs the body graph's own certified
step instead of the native one (gpt2edge/runtime/sparse_head/native.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics as st
import subprocess
import sys
from pathlib import Path

LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")
PROMPTS = [
    "import os\n\ndef main(argv):\n    ",
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n",
    'def read_config(path):\n    """Read the configuration file at path."""\n',
]
WORKLOADS = {
    "greedy": dict(),
    "top-k 40": dict(do_sample=True, top_k=40, temperature=0.8, seed=7),
    "top-p 0.9": dict(do_sample=True, top_p=0.9, temperature=0.8, seed=7),  # the full head every step
}


def gpt2edge(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gpt2edge.cli", *args], check=True, stdout=subprocess.DEVNULL)


def build(model: str, work: Path, rank: int, candidates: int = 256) -> dict[str, tuple[Path, Path]]:
    """precision -> (full folder, sparse folder), built when missing."""
    fp32 = work / "fp32"
    if not fp32.exists():
        gpt2edge("export", "-m", model, str(fp32), "--kv-cache", "shared", "--no-validate")
    out = {}
    for p in ("fp32", "int8", "int4"):
        full, sparse = work / p, work / f"{p}-sparse-r{rank}-k{candidates}"
        if not full.exists():
            gpt2edge("quantize", str(fp32), "-o", str(full), "--mode", p, "--no-report")
        if not sparse.exists():
            gpt2edge("sparse-head", str(full), "-o", str(sparse), "--rank", str(rank), "--candidates", str(candidates))
        out[p] = full, sparse
    return out


def decode(gen, kw: dict, tokens: int, prompts: list[str] = PROMPTS) -> tuple[float, list[list[int]]]:
    """Median over the prompts of generate()'s decode median (ms/token), and the token ids."""
    times, ids = [], []
    for p in prompts:
        r = gen.generate(p, max_new_tokens=tokens, ignore_eos=True, **kw)
        times.append(r.timings["decode_ms_per_token_median"])
        ids.append(r.token_ids)
    return st.median(times), ids


def forced(gen, ids: list[int], sparse: bool) -> tuple[float, list[int]]:
    """Teacher-forced decode over ids (one token a step, the greedy head configured on the sparse folder):
    median ms per step, and each step's argmax."""
    import time

    import numpy as np

    from gpt2edge.runtime.decoding.sampling import SamplingParams

    lm = gen.graph.new_lm()
    lm.start(1, len(ids))
    if sparse:
        lm.configure_head(SamplingParams())
    times, best = [], []
    mask = np.ones((1, len(ids)), dtype=np.int64)
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        row = lm.forward(np.array([[t]]), mask[:, : i + 1], np.array([[i]]))
        times.append((time.perf_counter() - t0) * 1e3)
        best.append(int(row[0].argmax()))
    return st.median(times), best


def breakdown(full, sparse, tokens: int) -> dict[str, float]:
    """Per-step parts, teacher-forced over the prompts' greedy continuations (min and 25th percentile, ms):
    the full folder's forward, the sparse folder's body run alone (the blocks, with the graph's own certified step
    unless the native step runs), the native step (when built), its head graph alone (the fallback), and its whole
    configured forward (body + step + certificate check + rows)."""
    import time

    import numpy as np

    from gpt2edge.runtime.decoding.sampling import SamplingParams

    seqs = [full.tokenizer.encode(p) + full.generate(p, max_new_tokens=tokens, ignore_eos=True).token_ids
            for p in PROMPTS]  # fmt: skip
    parts: dict[str, list[float]] = {"full forward": [], "sparse body run": [], "native step": [], "head graph": [],
                                     "sparse forward": []}  # fmt: skip

    def clock(key, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        parts[key].append((time.perf_counter() - t0) * 1e3)
        return out

    for ids in seqs:
        mask = np.ones((1, len(ids)), dtype=np.int64)
        a, b, c = full.graph.new_lm(), sparse.graph.new_lm(), sparse.graph.new_lm()
        for lm in (a, b, c):
            lm.start(1, len(ids))
        c.configure_head(SamplingParams())
        for i, t in enumerate(ids):
            step = (np.array([[t]]), mask[:, : i + 1], np.array([[i]]))
            clock("full forward", a.forward, *step)
            b.fused.arm(1)
            h = clock("sparse body run", b.body.forward, *step)
            if b.native is not None:  # the body ran without its own step: the native one (native.py) does it
                f = b.fused
                clock("native step", b.native.certify, h, f.ids, f.logits, f.bar, f.read)
            clock("head graph", sparse.graph.full_head, h)
            clock("sparse forward", c.forward, *step)
    return {f"{k} {q}": float(np.percentile(v, p)) for k, v in parts.items() if v for q, p in (("min", 0), ("p25", 25))}


_HELD = []  # the lock file while --lock-once holds it for the whole timed part


def locked(fn):
    if _HELD:
        return fn()
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return fn()


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def random_model(model: str, work: Path) -> str:
    """A random-weight checkpoint of --model's shape (seed 0), written once."""
    out = work / "random-ckpt"
    if not out.exists():
        import torch
        from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config.from_pretrained(model)).save_pretrained(out)
        AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return str(out)


def add_pair(rows: dict, got: dict) -> None:
    """One interleaved pair: got[label] = (ms per token, tokens) for "full" and "sparse"."""
    rows["full"].append(got["full"][0])
    rows["sparse"].append(got["sparse"][0])
    rows["ratio"].append(got["full"][0] / got["sparse"][0])
    rows["identical"] &= got["full"][1] == got["sparse"][1]


def summary(rows: dict, sparse) -> dict:
    """Medians and the ratio's range over the pairs, with the sparse head's certification counts."""
    stats = sparse.graph.stats.to_json(sparse.graph.vocab_size)
    return dict(
        full_ms=st.median(rows["full"]),
        sparse_ms=st.median(rows["sparse"]),
        ratio_median=st.median(rows["ratio"]),
        ratio_range=[min(rows["ratio"]), max(rows["ratio"])],
        identical=rows["identical"],
        certified_fraction=stats["certified_fraction"],
        rows_read_fraction=stats["rows_read_fraction"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared" / "trained-gpt2-py"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparse-bench"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--candidates", type=int, default=256, help="exact rows per step in the body graph")
    ap.add_argument("--breakdown", action="store_true", help="also time a step's parts (min and p25 of each)")
    ap.add_argument("--workloads", default="greedy,top-k 40,top-p 0.9,forced",
                    help="which of greedy, top-k 40, top-p 0.9, forced")  # fmt: skip
    ap.add_argument("--precisions", default="int8,int4")
    ap.add_argument("--random", action="store_true", help="also the random-weight model's certification figures")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--lock-once", action="store_true", help="hold the bench lock once, over every timed round")
    args = ap.parse_args()
    import gpt2edge.runtime.sparse_head  # noqa: F401  (loaded now, not after a long wait for the lock)
    from gpt2edge.runtime.decoding.sampling import SamplingParams  # noqa: F401
    from gpt2edge.runtime.generator import Generator

    args.work.mkdir(parents=True, exist_ok=True)
    folders = build(args.model, args.work, args.rank, args.candidates)
    precisions = args.precisions.split(",")
    if args.lock_once:  # one wait in the queue instead of one per pair (a shared host's lock can be held for minutes)
        _HELD.append(open(LOCK, "a"))
        fcntl.flock(_HELD[0], fcntl.LOCK_EX)
    gens = {p: (Generator(folders[p][0], threads=args.threads), Generator(folders[p][1], threads=args.threads))
            for p in precisions}  # fmt: skip
    results = {}
    wanted = args.workloads.split(",")
    for p, (full, sparse) in gens.items():
        if args.breakdown:
            results[f"{p} breakdown"] = locked(lambda f=full, s=sparse: breakdown(f, s, args.tokens))
        for name, kw in WORKLOADS.items():
            if name not in wanted:
                continue
            decode(full, kw, 8), decode(sparse, kw, 8)  # warm-up
            sparse.graph.reset_stats()
            rows = {"full": [], "sparse": [], "ratio": [], "identical": True}
            for r in range(args.rounds):
                for i, prompt in enumerate(PROMPTS):  # A B / B A per prompt: a shared host's load drifts in seconds
                    order = [("full", full), ("sparse", sparse)][:: 1 if (r + i) % 2 == 0 else -1]
                    got = {}
                    for label, gen in order:
                        got[label] = locked(lambda g=gen, kw=kw, p=prompt: decode(g, kw, args.tokens, [p]))
                    add_pair(rows, got)
            results[f"{p} {name}"] = summary(rows, sparse)
        if "forced" not in wanted:
            continue
        # real text, not the model's own (peaked, repetitive) greedy output: this repo's source, held out
        text = (Path(__file__).resolve().parents[1] / "gpt2edge" / "runtime" / "decoding" / "sampling.py").read_text()
        ids = full.tokenizer.encode(text)[: full.graph.n_positions - 1]
        forced(full, ids[:8], False), forced(sparse, ids[:8], True)  # warm-up
        sparse.graph.reset_stats()
        rows = {"full": [], "sparse": [], "ratio": [], "identical": True}
        for r in range(args.rounds):
            order = [("full", full, False), ("sparse", sparse, True)][:: 1 if r % 2 == 0 else -1]
            got = {label: locked(lambda g=g, sp=sp, ids=ids: forced(g, ids, sp)) for label, g, sp in order}
            add_pair(rows, got)
        results[f"{p} forced (real code)"] = summary(rows, sparse)
    if args.random:
        rnd = build(random_model(args.model, args.work), args.work / "random", args.rank, args.candidates)
        gen = Generator(rnd["int8"][1], threads=args.threads)
        full = Generator(rnd["int8"][0], threads=args.threads)
        gen.graph.reset_stats()
        same = decode(full, {}, 32)[1] == decode(gen, {}, 32)[1]
        s = gen.graph.stats.to_json(gen.graph.vocab_size)
        results["random-weight int8 greedy"] = dict(
            identical=same, certified_fraction=s["certified_fraction"], rows_read_fraction=s["rows_read_fraction"]
        )
    if args.json:
        print(json.dumps(dict(cpu=cpu_name(), threads=args.threads, rank=args.rank, candidates=args.candidates,
                              results=results), indent=2))
        return
    print(f"{cpu_name()}, {args.threads} threads, rank {args.rank}, {args.candidates} candidates, "
          f"{args.rounds} interleaved rounds, "
          f"{len(PROMPTS)} prompts x {args.tokens} tokens")  # fmt: skip
    print(f"{'folder / workload':28} {'full ms/tok':>11} {'sparse':>8} {'speed-up (range)':>20} {'same ids':>8} "
          f"{'certified':>9} {'rows read':>9}")  # fmt: skip
    for k, v in results.items():
        if k.endswith("breakdown"):
            print(f"{k}: " + ", ".join(f"{n} {x:.3f}" for n, x in v.items()) + " (ms a step)")
        elif "full_ms" in v:
            rng = f"{v['ratio_median']:.2f}x ({v['ratio_range'][0]:.2f}-{v['ratio_range'][1]:.2f})"
            print(f"{k:28} {v['full_ms']:11.3f} {v['sparse_ms']:8.3f} {rng:>20} {str(v['identical']):>8} "
                  f"{v['certified_fraction']:9.1%} {v['rows_read_fraction']:9.2%}")  # fmt: skip
        else:
            print(f"{k:28} {'':11} {'':8} {'':>20} {str(v['identical']):>8} {v['certified_fraction']:9.1%} "
                  f"{v['rows_read_fraction']:9.2%}")  # fmt: skip


if __name__ == "__main__":
    main()
